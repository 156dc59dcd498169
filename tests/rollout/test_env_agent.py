"""User environments (gymnasium API) and chat-template tool calls in the agent loop, on a scripted policy
through a ChatML tokenizer built in the tests (tests/rollout/chatml.py), and on a real tiny model."""

import threading
import time
from typing import ClassVar

import gymnasium
import pytest
import torch

from rlcore.data.prompts import make_prompt_batch
from rlcore.data.rows import Row
from rlcore.models.forward import compute_logprobs
from rlcore.rewards.pool import RewardScorer
from rlcore.rewards.step import score_step
from rlcore.rollout import NativeEngine, SamplingParams
from rlcore.rollout.agent import run_agent
from rlcore.rollout.agent.chat import load_tools, parse_hermes
from rlcore.rollout.agent.loop import EnvOptions
from tests.rollout.chatml import THINK_TEMPLATE, build_chatml_tokenizer
from tests.rollout.fakes import BiasedLM, ScriptedLMCache, pieces

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny ops, shared cores

GENERATION = "<|im_start|>assistant\n"


def obs(text):
    """The observation tokens' text after an assistant turn ended by its <|im_end|>."""
    return f"\n<|im_start|>user\n{text}<|im_end|>\n{GENERATION}"


@pytest.fixture(scope="module")
def tok():
    return build_chatml_tokenizer()


def chat_script(tokenizer, turns):
    """Writes `turns[k]` after the k-th generation prompt of the response (then <|im_end|>)."""
    marker = tokenizer(GENERATION, add_special_tokens=False)["input_ids"]
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in turns]

    def script(ctx):
        starts = [p for p in range(len(ctx) - len(marker) + 1) if ctx[p : p + len(marker)] == marker]
        k, done = len(starts) - 1, len(ctx) - starts[-1] - len(marker)
        target = encoded[k] if k < len(encoded) else []
        return target[done] if done < len(target) else tokenizer.eos_token_id

    return script


def rows_for(tokenizer, truths, prompt="Guess the number.", tools=()):
    rows = [
        Row(data_source="guess", prompt=[{"role": "user", "content": prompt}], ground_truth=t) for t in truths
    ]
    return make_prompt_batch(rows, tokenizer, uids=[f"u{i}" for i in range(len(rows))], tools=tools)


def rollout(
    tokenizer, turns, truths=("5",), *, n=1, max_tokens=200, model=None, temperature=0.0, seed=None, **kw
):
    model = model or ScriptedLMCache(chat_script(tokenizer, turns), len(tokenizer))
    sampling = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=seed)
    prompts = rows_for(tokenizer, truths, tools=kw["chat_tools"].schemas if kw.get("chat_tools") else ())
    return run_agent(NativeEngine(model, tokenizer), prompts, sampling, tokenizer, **kw)


def prompt_text(tokenizer, out, i):
    return tokenizer.decode(out["input_ids"][i][out["attention_mask"][i].bool()], skip_special_tokens=False)


class Guess:
    """Guess the row's digit: "higher"/"lower" after a miss (-0.25), 1 and the end on a hit."""

    first = ""
    seeds: ClassVar[list] = []

    def reset(self, *, seed=None, options=None):
        self.secret = int(options["row"]["ground_truth"])
        Guess.seeds.append((options["row"]["ground_truth"], seed))
        return self.first, {}

    def step(self, action):
        if not action.strip().isdigit():
            return "say a digit", -0.5, False, False, {}
        guess = int(action.strip())
        if guess == self.secret:
            return "", 1.0, True, False, {}
        return ("higher" if guess < self.secret else "lower"), -0.25, False, False, {}


def env(cls, **kw):
    return {"env": EnvOptions(cls=cls, **kw)}


def test_env_episode_masks_rewards_and_turns(tok):
    out = rollout(tok, ["3", "7", "5"], n=2, **env(Guess))
    for i in range(2):
        assert pieces(tok, out, i) == [
            ("3<|im_end|>", 1),
            (obs("higher"), 0),  # rendered by the template as the next user turn: attended, not trained
            ("7<|im_end|>", 1),
            (obs("lower"), 0),
            ("5<|im_end|>", 1),
        ]
    assert out["finish_reason"] == ["stop", "stop"]
    assert out["num_turns"].tolist() == [3, 3] and out["num_tool_calls"].tolist() == [0, 0]
    assert out["env_rewards"].tolist() == [0.5, 0.5]  # 1 - 0.25 - 0.25
    assert out["num_observation_tokens"].tolist() == (out["response_mask"] == 0).logical_and(
        out["response_attention"] == 1).sum(-1).tolist()  # fmt: skip
    assert out["retokenize_mismatch"].tolist() == [0.0, 0.0]
    assert not out["env_errors"].any() and not out["env_timeouts"].any()


def test_max_turns_truncation_and_budget_end_episodes(tok):
    out = rollout(tok, ["1"] * 5, **env(Guess), max_turns=3)
    assert out["finish_reason"] == ["max_turns"] and out["num_turns"].tolist() == [3]
    assert out["env_rewards"].tolist() == [-0.75]
    assert pieces(tok, out, 0)[-1] == ("1<|im_end|>", 1)  # no observation after the last step

    class Truncating(Guess):
        def step(self, action):
            return "never", 0.1, False, True, {}

    out = rollout(tok, ["1"] * 5, **env(Truncating), max_turns=3)
    assert out["finish_reason"] == ["truncated"] and out["num_turns"].tolist() == [1]
    assert out["env_rewards"].tolist() == pytest.approx([0.1])
    first = len(tok("1<|im_end|>", add_special_tokens=False)["input_ids"])
    out = rollout(
        tok, ["1"] * 5, **env(Guess), max_turns=3, max_tokens=first + 3
    )  # cut inside an observation
    assert out["finish_reason"] == ["length"] and int(out["response_attention"].sum()) == first + 3


def test_first_observation_follows_the_rows_prompt(tok):
    class Intro(Guess):
        first = "It is between 0 and 9."

    out = rollout(tok, ["5"], **env(Intro))
    messages = [{"role": "user", "content": "Guess the number."}, {"role": "user", "content": Intro.first}]
    assert prompt_text(tok, out, 0) == tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert out["env_rewards"].tolist() == [1.0] and out["retokenize_mismatch"].tolist() == [0.0]


def test_a_group_shares_its_seed_and_prompts_differ(tok):
    Guess.seeds = []
    rollout(tok, ["5"], truths=("5", "6"), n=3, **env(Guess))
    by_row = {}
    for truth, seed in Guess.seeds:
        by_row.setdefault(truth, set()).add(seed)
    assert len(Guess.seeds) == 6 and all(len(s) == 1 for s in by_row.values())
    assert by_row["5"] != by_row["6"]


class Faulty(Guess):
    def reset(self, *, seed=None, options=None):
        if options["row"]["ground_truth"] == "reset-fails":
            raise OSError("no such level")
        self.secret = options["row"]["ground_truth"]
        return "", {}

    def step(self, action):
        if self.secret == "raise":
            raise RuntimeError("env bug")
        if self.secret == "bad-output":
            return "only", "two"
        if self.secret == "hang":
            time.sleep(120)
        return "", 1.0, True, False, {}


def test_raising_bad_and_hanging_envs_end_only_their_episode(tok, caplog):
    start = time.perf_counter()
    truths = ("raise", "reset-fails", "hang", "bad-output", "fine")
    out = rollout(tok, ["4"], truths=truths, **env(Faulty, failure_score=-1.0), timeout_s=1.0)
    assert time.perf_counter() - start < 20  # the hang is cut at its deadline
    assert out["finish_reason"] == ["env_error", "env_error", "env_timeout", "env_error", "stop"]
    assert out["env_rewards"].tolist() == [-1.0, -1.0, -1.0, -1.0, 1.0]
    assert out["env_errors"].tolist() == [True, True, False, True, False]
    assert out["env_timeouts"].tolist() == [False, False, True, False, False]
    assert out["num_turns"].tolist() == [1, 0, 1, 1, 1] and int(out["response_mask"][1].sum()) == 0
    assert "RuntimeError: env bug" in caplog.text and "timed out after 1 s" in caplog.text


def test_env_calls_of_a_batch_run_concurrently(tok):
    class Slow(Guess):
        active, most = 0, 0
        lock = threading.Lock()

        def step(self, action):
            with Slow.lock:
                Slow.active += 1
                Slow.most = max(Slow.most, Slow.active)
            time.sleep(0.3)
            with Slow.lock:
                Slow.active -= 1
            return "", 1.0, True, False, {}

    rollout(tok, ["5"], truths=("5",) * 4, n=2, **env(Slow), timeout_s=30.0)
    assert Slow.most == 8  # all eight steps were in flight at once


def test_a_gymnasium_env_subclass_works_unchanged(tok):
    class GymGuess(gymnasium.Env):
        observation_space = gymnasium.spaces.Text(64)
        action_space = gymnasium.spaces.Text(64)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.secret = int(self.np_random.integers(0, 10))
            return "Guess a digit.", {"secret": self.secret}

        def step(self, action):
            hit = action.strip() == str(self.secret)
            return ("" if hit else "no"), float(hit), hit, False, {}

    out = rollout(tok, [str(d) for d in range(10)], n=2, **env(GymGuess), max_turns=10, max_tokens=400)
    assert out["finish_reason"] == ["stop", "stop"] and out["env_rewards"].tolist() == [1.0, 1.0]
    turns = out["num_turns"].tolist()
    assert turns[0] == turns[1] >= 1  # one seed per group: both samples play the same secret
    assert pieces(tok, out, 0)[-1] == (f"{turns[0] - 1}<|im_end|>", 1)


TOOLS_FILE = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


def fail(x: str) -> str:
    """Always raises.

    Args:
        x: anything
    """
    raise RuntimeError("no luck")


def _private(x: int) -> int:
    return x
'''


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "tools.py"
    path.write_text(TOOLS_FILE)
    return load_tools(str(path))


def call(name, **arguments):
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def tool_obs(*results):
    blocks = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results)
    return f"\n<|im_start|>user{blocks}<|im_end|>\n{GENERATION}"


def test_tools_schemas_come_from_signatures_and_docstrings(tools):
    assert sorted(tools.functions) == ["add", "fail"]
    add = next(s for s in tools.schemas if s["function"]["name"] == "add")["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first addend"}
    assert add["parameters"]["required"] == ["a", "b"]


def test_tool_calls_are_parsed_run_and_rendered_as_tool_messages(tok, tools):
    out = rollout(tok, [call("add", a=2, b=3) + call("add", a=1, b=1), "5"], chat_tools=tools)
    assert pieces(tok, out, 0) == [
        (call("add", a=2, b=3) + call("add", a=1, b=1) + "<|im_end|>", 1),
        (tool_obs(5, 2), 0),  # two calls in one turn: one user turn with two tool responses
        ("5<|im_end|>", 1),
    ]
    assert out["num_tool_calls"].tolist() == [2] and out["num_tool_errors"].tolist() == [0]
    assert out["finish_reason"] == ["stop"] and out["retokenize_mismatch"].tolist() == [0.0]
    assert '"name": "add"' in prompt_text(tok, out, 0)  # the schemas are in the prompt's system turn


@pytest.mark.parametrize(
    "turn, content",
    [
        ("<tool_call>{not json}</tool_call>", "error: invalid tool call JSON (Expecting property name"),
        (call("abacus", x=1), "error: unknown tool 'abacus'; tools: add, fail"),
        (call("fail", x="y"), "error: no luck"),
        (call("add", a=1), "error: add() missing 1 required positional argument: 'b'"),
        (
            '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
            "error: the tool call's 'arguments' must",
        ),
        ("<tool_call>{}", "error: unclosed <tool_call>"),
    ],
)
def test_bad_tool_calls_become_error_tool_messages(tok, tools, turn, content):
    out = rollout(tok, [turn, "ok"], chat_tools=tools)
    observation = pieces(tok, out, 0)[1][0]
    assert observation.startswith("\n<|im_start|>user\n<tool_response>\n" + content), observation
    assert out["num_tool_errors"].tolist() == [1] and out["finish_reason"] == ["stop"]


def test_hermes_parser():
    assert [
        c.name for c in parse_hermes('a <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    ] == ["f"]
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[0].arguments == {
        "x": 1
    }
    assert parse_hermes("no calls") == []


def test_tools_and_env_together(tok, tools):
    out = rollout(tok, [call("add", a=2, b=3), "5"], chat_tools=tools, **env(Guess))
    assert [m for _, m in pieces(tok, out, 0)] == [1, 0, 1]
    assert out["num_tool_calls"].tolist() == [1] and out["env_rewards"].tolist() == [1.0]
    assert out["num_turns"].tolist() == [2]


def test_a_template_that_is_not_prefix_stable_is_reported(tok):
    think = build_chatml_tokenizer(THINK_TEMPLATE)
    turns = ["<think>small</think>3", "5"]
    stable = rollout(tok, turns, **env(Guess))
    dropped = rollout(think, turns, **env(Guess))
    assert stable["retokenize_mismatch"].tolist() == [0.0] and dropped["retokenize_mismatch"].tolist() == [
        1.0
    ]
    # the trained tokens are the sampled ones either way
    assert pieces(think, dropped, 0) == pieces(tok, stable, 0)


def test_legacy_format_when_the_template_has_no_tool_role(tmp_path):
    from rlcore.models import load_policy
    from tests.rollout.fakes import turn_script

    tokenizer = load_policy("builtin:tiny")[1]
    path = tmp_path / "shout.py"
    path.write_text('def shout(text: str) -> str:\n    """Upper-case.\n\n    Args:\n        text: what\n    """\n'
                    "    return text.upper()\n")  # fmt: skip
    model = ScriptedLMCache(turn_script(tokenizer, ["<tool>shout: hi</tool>", "HI<|eos|>"]), len(tokenizer))
    rows = [Row(data_source="x", prompt=[{"role": "user", "content": "q"}])]
    out = run_agent(NativeEngine(model, tokenizer), make_prompt_batch(rows, tokenizer, uids=["u"]),
                    SamplingParams(max_tokens=80, temperature=0.0), tokenizer, chat_tools=load_tools(str(path)))  # fmt: skip
    text = tokenizer.decode(out["responses"][0], skip_special_tokens=True)
    assert text.startswith("<tool>shout: hi</tool><result>HI</result>HI"), text
    assert out["num_tool_calls"].tolist() == [1] and "retokenize_mismatch" not in out


def test_scores_are_env_rewards_plus_covered_reward_functions():
    from rlcore.batch import Batch

    tokenizer = build_chatml_tokenizer()
    ids = tokenizer("12<|im_end|>", add_special_tokens=False)["input_ids"]
    t = len(ids)
    batch = Batch.from_dict({
        "responses": torch.tensor([ids] * 3), "response_mask": torch.ones(3, t), "response_attention": torch.ones(3, t),
        "data_source": ["guess", "builtin/reverse", "builtin/reverse"], "ground_truth": ["", "21", "21"],
        "extra_info": [{}, {}, {}], "env_rewards": torch.tensor([0.5, 0.25, 0.75]),
        "env_errors": torch.tensor([False, False, True]), "env_timeouts": torch.tensor([False, False, False]),
    })  # fmt: skip
    out, metrics = score_step(RewardScorer(data_sources=["builtin/reverse"]), batch, tokenizer=tokenizer)
    # row 0: no reward function for "guess" -> the env's 0.5; row 1: reverse("12") scores 0 vs "21" + 0.25;
    # row 2: the env failed -> its env_rewards (the failure score) alone
    assert out["token_scores"].sum(-1).tolist() == [0.5, 0.25, 0.75]
    assert out["token_scores"][:, -1].tolist() == [0.5, 0.25, 0.75]
    batch = batch.with_(ground_truth=["", "12", "12"], overwrite=True)
    out, metrics = score_step(RewardScorer(data_sources=["builtin/reverse"]), batch, tokenizer=tokenizer)
    assert out["token_scores"].sum(-1).tolist() == [0.5, 1.25, 0.75]
    assert float(metrics["reward/env_mean"]) == pytest.approx(0.5)


def test_real_model_recomputed_logprobs_match_the_rollouts(tok):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    bias = torch.zeros(len(tok))
    bias[tok.eos_token_id] = 5.0  # turns end after a few tokens
    model = BiasedLM(Qwen2ForCausalLM(config).eval(), bias)

    class Any3(Guess):
        def step(self, action):
            return "again", 0.0, False, False, {}

    out = rollout(tok, [], n=3, model=model, temperature=1.0, seed=7, max_tokens=80, **env(Any3), max_turns=3)
    assert (out["num_turns"] >= 1).all() and (out["num_observation_tokens"] > 0).any()
    logprobs, _ = compute_logprobs(model, out)
    mask = out["response_mask"].bool()
    assert torch.allclose(logprobs[mask], out["rollout_logprobs"][mask], atol=1e-4)
    assert (out["rollout_logprobs"][~mask] == 0).all()


def test_without_a_prompt_the_first_observation_is_the_first_user_turn(tok):
    from rlcore.data.rows import row_from_dict

    class Intro(Guess):
        first = "Guess a digit."

    row = row_from_dict(
        {"data_source": "guess", "reward_model": {"ground_truth": "5"}}, "r", prompt_optional=True
    )
    assert row.prompt == ""
    with pytest.raises(ValueError, match="missing field 'prompt'"):
        row_from_dict({"data_source": "guess"}, "r")
    prompts = make_prompt_batch([row], tok, uids=["u0"])
    sampling = SamplingParams(max_tokens=50, temperature=0.0)
    model = ScriptedLMCache(chat_script(tok, ["5"]), len(tok))
    out = run_agent(NativeEngine(model, tok), prompts, sampling, tok, env=EnvOptions(cls=Intro))
    messages = [{"role": "user", "content": Intro.first}]
    assert prompt_text(tok, out, 0) == tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert out["env_rewards"].tolist() == [1.0] and pieces(tok, out, 0) == [("5<|im_end|>", 1)]


def test_partial_rollouts_keep_episodes_and_tag_each_turns_tokens(tok):
    """Multi-turn partial rollouts (`rlcore.step.partial.tagged` over the agent loop) with a gymnasium
    env: a push taken between every two decode steps (the version goes up by one) leaves the episodes in
    flight alone (each env reset once, its secret and the misses so far kept: the same episodes, hints
    and rewards as without pushes), and every model token carries the version it was sampled with,
    rising along the episode across turns."""
    from rlcore.rollout.agent.loop import AgentEngine
    from rlcore.step.partial import tagged

    class GymRowGuess(Guess, gymnasium.Env):  # a gymnasium env: its state is the secret and the misses
        observation_space = gymnasium.spaces.Text(64)
        action_space = gymnasium.spaces.Text(64)

    model = ScriptedLMCache(chat_script(tok, ["3", "7", "5"]), len(tok))
    agent = AgentEngine(NativeEngine(model, tok), tok, max_turns=4, env=EnvOptions(cls=GymRowGuess))
    calls = {"version": 0}

    def take():  # a push at every decode step (each turn here is 2 tokens: one step between them)
        calls["version"] += 1

    Guess.seeds.clear()
    prompts = rows_for(tok, ("5", "5"))
    greedy = SamplingParams(n=2, max_tokens=200, temperature=0.0)
    out = tagged(agent, version=lambda: calls["version"], take=take).generate(prompts, greedy)
    plain = agent.generate(prompts, greedy)
    assert len(Guess.seeds) == 2 * 4  # one reset per episode, in each run
    for key in ("responses", "response_mask", "env_rewards", "num_turns"):
        assert torch.equal(out[key], plain[key]), key
    assert out["env_rewards"].tolist() == [0.5] * 4 and out["num_turns"].tolist() == [3] * 4
    versions, model_tokens = out["rollout_versions"], out["response_mask"] > 0
    assert "rollout_versions" not in plain and calls["version"] >= 3
    for row in range(4):
        tags = versions[row][model_tokens[row]]
        assert tags[0] == 0 and tags[-1] >= 2 and bool((tags[1:] >= tags[:-1]).all()), tags
    turns = [versions[0][model_tokens[0]][:2], versions[0][model_tokens[0]][-2:]]
    assert turns[0].max() < turns[1].min()  # the last turn was sampled with later weights than the first

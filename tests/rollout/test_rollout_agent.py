"""The multi-turn agent loop (masks, observations, budgets, turn limits, tool errors) on a scripted
policy and on the tiny model; the calculator and python tools; the built-in `calc` task."""

import pytest
import torch

from rlcore.data import agent_tasks
from rlcore.data.prompts import make_prompt_batch
from rlcore.data.rows import Row
from rlcore.data.tasks import split_of
from rlcore.models import load_policy
from rlcore.pure.logprobs import token_logprobs
from rlcore.rollout import NativeEngine, SamplingParams
from rlcore.rollout.agent import ToolFormat, run_agent
from rlcore.rollout.agent import tools as tools_module
from rlcore.rollout.agent.loop import observe, parse_tool_call
from rlcore.rollout.agent.tools import TOOLS, ToolError, calculator, python_tool
from tests.rollout.fakes import BiasedLM, ScriptedLMCache, pieces, turn_script

EOS = 2


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny ops, shared cores


@pytest.fixture(scope="module")
def tokenizer():
    return load_policy("builtin:tiny")[1]


def prompts_for(tokenizer, texts):
    rows = [Row(data_source="builtin/calc", prompt=[{"role": "user", "content": t}]) for t in texts]
    return make_prompt_batch(rows, tokenizer, uids=[f"u{i}" for i in range(len(texts))])


def scripted_rollout(tokenizer, turns, *, n=1, texts=("347*829",), tools=None, **kw):
    model = ScriptedLMCache(turn_script(tokenizer, turns), len(tokenizer))
    engine = NativeEngine(model, tokenizer)
    sampling = SamplingParams(
        n=n, max_tokens=kw.pop("max_tokens", 160), temperature=kw.pop("temperature", 0.0)
    )
    return run_agent(engine, prompts_for(tokenizer, list(texts)), sampling, tokenizer, tools=tools, **kw)


CALL = "<tool>calculator: 347*829</tool>"


def test_tool_call_observation_and_answer(tokenizer):
    out = scripted_rollout(tokenizer, [CALL, "287663<|eos|>"], n=2)
    for i in range(2):
        assert pieces(tokenizer, out, i) == [
            (CALL, 1),  # sampled: trained
            ("<result>287663</result>", 0),  # observation: attended, not trained
            ("287663<|eos|>", 1),
        ]
        n = int(out["response_attention"][i].sum())
        assert torch.all(out["response_attention"][i, :n] == 1) and torch.all(
            out["response_attention"][i, n:] == 0
        )
        obs = out["response_mask"][i] == 0
        assert torch.all(out["rollout_logprobs"][i][obs] == 0)
        assert torch.all(out["rollout_logprobs"][i][~obs] == 0)  # greedy
    assert out["finish_reason"] == ["stop", "stop"] and out["uid"] == ["u0", "u0"]
    assert out["num_turns"].tolist() == [2, 2] and out["num_tool_calls"].tolist() == [1, 1]
    assert out["num_tool_errors"].tolist() == [0, 0]
    text = tokenizer.decode(out["responses"][0], skip_special_tokens=True)
    assert agent_tasks.compute_score("builtin/calc", text, "287663") == 1.0  # 347 * 829 = 287663


def test_sampled_ids_are_appended_verbatim(tokenizer):
    # "<tool>" can also be spelled as single characters; the loop must keep the ids the model chose.
    marker = tokenizer.convert_tokens_to_ids("<|assistant|>")
    call_ids = tokenizer(CALL, add_special_tokens=False)["input_ids"]
    odd_ids = [tokenizer.convert_tokens_to_ids("<|user|>"), *call_ids]  # a special token inside the turn

    def script(ctx):
        done = ctx[::-1].index(marker)
        return odd_ids[done] if done < len(odd_ids) else EOS

    engine = NativeEngine(ScriptedLMCache(script, len(tokenizer)), tokenizer)
    out = run_agent(
        engine, prompts_for(tokenizer, ["1*1"]), SamplingParams(max_tokens=80, temperature=0.0), tokenizer
    )
    assert out["responses"][0, : len(odd_ids)].tolist() == odd_ids
    obs_ids = tokenizer("<result>287663</result>", add_special_tokens=False)["input_ids"]
    assert out["responses"][0, len(odd_ids) : len(odd_ids) + len(obs_ids)].tolist() == obs_ids


@pytest.mark.parametrize(
    "call, message",
    [
        ("calculator 2+2</tool>", "error: malformed tool call: </tool> without <tool>"),
        ("<tool>calculator 2+2</tool>", "error: malformed tool call: expected <tool>NAME: ARGUMENT</tool>"),
        ("<tool>abacus: 2+2</tool>", "error: unknown tool 'abacus'; tools: calculator, python"),
        ("<tool>calculator: 2+</tool>", "error: cannot parse '2+'"),
        ("<tool>calculator: __import__('os')</tool>", "error: not arithmetic"),
    ],
)
def test_bad_calls_become_error_observations(tokenizer, call, message):
    out = scripted_rollout(tokenizer, [call, "4<|eos|>"])
    runs = pieces(tokenizer, out, 0)
    assert runs[0] == (call, 1) and runs[2] == ("4<|eos|>", 1)
    assert (
        runs[1][1] == 0 and runs[1][0].startswith(f"<result>{message}") and runs[1][0].endswith("</result>")
    )
    assert out["num_tool_errors"].tolist() == [1] and out["finish_reason"] == ["stop"]


def test_a_raising_tool_is_an_observation(tokenizer):
    def broken(argument):
        raise RuntimeError(f"boom on {argument}")

    out = scripted_rollout(tokenizer, ["<tool>broken: x</tool>", "ok<|eos|>"], tools={"broken": broken})
    assert pieces(tokenizer, out, 0)[1] == ("<result>error: boom on x</result>", 0)


def test_max_turns_ends_after_a_call(tokenizer):
    out = scripted_rollout(tokenizer, [CALL] * 5, max_turns=2)
    assert [m for _, m in pieces(tokenizer, out, 0)] == [1, 0, 1]  # call, observation, call (unanswered)
    assert out["finish_reason"] == ["max_turns"] and out["num_turns"].tolist() == [2]
    assert out["num_tool_calls"].tolist() == [1]


def test_budget_cuts_an_observation(tokenizer):
    budget = len(CALL) + 5  # room for 5 observation tokens
    out = scripted_rollout(tokenizer, [CALL, "287663<|eos|>"], max_tokens=budget)
    assert out["responses"].shape[1] == budget
    assert pieces(tokenizer, out, 0) == [(CALL, 1), ("<resu", 0)]
    assert out["finish_reason"] == ["length"]


def test_budget_cuts_a_turn(tokenizer):
    out = scripted_rollout(tokenizer, [CALL, "2876631234567890<|eos|>"], max_tokens=len(CALL) + 23 + 4)
    assert pieces(tokenizer, out, 0)[2] == ("2876", 1) and out["finish_reason"] == ["length"]


def test_rows_with_different_budgets_left_share_turns(tokenizer):
    # two prompts: the first answers at once, the second calls the tool; both in the same turn batches
    marker = tokenizer.convert_tokens_to_ids("<|assistant|>")
    scripts = {
        "a": turn_script(tokenizer, ["12<|eos|>"]),
        "b": turn_script(tokenizer, [CALL, "287663<|eos|>"]),
    }

    def script(ctx):
        user = tokenizer.decode(ctx[: ctx.index(marker)], skip_special_tokens=True)
        return scripts[user[-1]](ctx)

    engine = NativeEngine(ScriptedLMCache(script, len(tokenizer)), tokenizer)
    out = run_agent(
        engine, prompts_for(tokenizer, ["a", "b"]), SamplingParams(max_tokens=64, temperature=0.0), tokenizer
    )
    assert pieces(tokenizer, out, 0) == [("12<|eos|>", 1)]
    assert [m for _, m in pieces(tokenizer, out, 1)] == [1, 0, 1]
    assert out["num_turns"].tolist() == [1, 2]
    assert torch.all(out["responses"][0, 3:] == 0)  # right-padded with the pad id


def test_user_stop_string_is_an_answer(tokenizer):
    model = ScriptedLMCache(turn_script(tokenizer, ["42 END more"]), len(tokenizer))
    sampling = SamplingParams(max_tokens=40, temperature=0.0, stop_strings=("END",))
    out = run_agent(NativeEngine(model, tokenizer), prompts_for(tokenizer, ["q"]), sampling, tokenizer)
    assert pieces(tokenizer, out, 0) == [("42 END", 1)] and out["finish_reason"] == ["stop"]


def test_tiny_model_multi_turn_masks_and_logprob_agreement(tokenizer):
    """Real sampled tokens of the tiny model, with its logits biased so that "e" (which closes a
    'tool call' here, always malformed) is frequent and EOS rare: several observations land inside
    each response, and the teacher-forced log-probs over prompt + response (observations included)
    must still equal the rollout's on the trained tokens."""
    tiny, _ = load_policy("builtin:tiny")
    bias = torch.zeros(len(tokenizer))
    bias[tokenizer.convert_tokens_to_ids("e")], bias[EOS] = 2.5, -4.0
    model = BiasedLM(tiny, bias)
    engine = NativeEngine(model, tokenizer)
    batch = prompts_for(tokenizer, ["347*829", "12*34", "5"])
    fmt = ToolFormat(call_open="<<", call_close="e", result_open="[", result_close="]")
    sampling = SamplingParams(n=4, max_tokens=160, temperature=1.0, seed=5)
    out = run_agent(
        engine, batch, sampling, tokenizer, tool_format=fmt, max_turns=4, max_observation_chars=12
    )
    assert out["num_tool_calls"].sum() >= 20 and torch.all(out["num_tool_calls"] == out["num_tool_errors"])
    assert (
        set(out["finish_reason"]) <= {"stop", "length", "max_turns"} and "max_turns" in out["finish_reason"]
    )
    mask, attention = out["response_mask"], out["response_attention"]
    assert torch.all(mask <= attention) and torch.any(mask < attention)
    assert torch.all(out["rollout_logprobs"][mask == 0] == 0)
    expected = "[error: malfo...]"  # "error: malformed tool call: ..." cut to 12 characters
    for i in range(len(out)):
        runs = pieces(tokenizer, out, i)
        assert sum(m == 0 for _, m in runs) == int(out["num_tool_calls"][i])
        for k, (piece, m) in enumerate(runs):
            cut = k == len(runs) - 1 and out["finish_reason"][i] == "length"  # cut by the budget
            assert m == 1 or piece == expected or (cut and expected.startswith(piece))
            assert m == 0 or k == len(runs) - 1 or piece.endswith("e")  # each model turn ends the call
    ids = torch.cat([out["input_ids"], out["responses"]], dim=1)
    full_mask = torch.cat([out["attention_mask"].long(), attention.long()], dim=1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=full_mask, position_ids=pos).logits
    p = out["input_ids"].shape[1]
    recomputed = token_logprobs(logits[:, p - 1 : -1], out["responses"])
    diff = (recomputed - out["rollout_logprobs"]).abs()[mask.bool()]
    assert diff.max() <= 1e-5, diff.max()


# -- tools -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("2*(3+4)", "14"),
        ("347*829", str(347 * 829)),
        ("7/2", "3.5"),
        ("1/3", repr(1 / 3)),
        ("-3**2", "-9"),  # Python precedence: -(3**2)
        ("2**-2", "0.25"),
        ("10//3", "3"),
        ("10%3", "1"),
        ("3.5*2", "7"),
        (" ( ( 1 ) ) ", "1"),
        ("123456789*987654321", str(123456789 * 987654321)),  # exact on integers
    ],
)
def test_calculator_values(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    "expression, message",
    [
        ("1/0", "division by zero"),
        ("5%0", "division by zero"),
        ("2**1000", "out of range"),
        ("9" * 120, "more than 100 digits"),
        ("abs(3)", "not arithmetic"),
        ("x+1", "not arithmetic"),
        ("'a'*3", "not a number"),
        ("", "empty"),
        ("1+" * 150 + "1", "longer than 200"),
        ("(-8)**(1/3)", "complex"),
        ("1<2", "not arithmetic"),
    ],
)
def test_calculator_errors(expression, message):
    with pytest.raises(ToolError, match=message):
        calculator(expression)


def test_parse_and_observe():
    assert parse_tool_call("I will <tool> calculator : 1+1 </tool>") == ("calculator", "1+1")
    assert parse_tool_call("<tool>a: x</tool> <tool>b: y</tool>") == ("a", "x")  # the first call
    assert observe("<tool>calculator: 2*(3+4)</tool>", TOOLS) == ("<result>14</result>", False)
    long = observe("<tool>echo: x</tool>", {"echo": lambda a: a * 50}, max_chars=5)
    assert long == ("<result>xxxxx...</result>", False)
    assert observe("<tool>calculator: 1/0</tool>", TOOLS) == (
        "<result>error: division by zero</result>",
        True,
    )
    assert tools_module.RESULT_OPEN == agent_tasks.RESULT_OPEN
    assert tools_module.RESULT_CLOSE == agent_tasks.RESULT_CLOSE


def test_python_tool_formats_the_sandbox_result(monkeypatch):
    from types import SimpleNamespace

    from rlcore.rewards import sandbox

    results = iter(
        [
            SimpleNamespace(exit_code=0, stdout="42\n", stderr="", timed_out=False),
            SimpleNamespace(
                exit_code=1,
                stdout="",
                stderr="Traceback...\nZeroDivisionError: division by zero\n",
                timed_out=False,
            ),
            SimpleNamespace(exit_code=137, stdout="", stderr="", timed_out=True),
        ]
    )
    calls = []
    monkeypatch.setattr(sandbox, "run_python", lambda code, **kw: calls.append((code, kw)) or next(results))
    assert python_tool("print(6*7)") == "42"
    with pytest.raises(ToolError, match=r"^ZeroDivisionError: division by zero$"):
        python_tool("1/0")
    with pytest.raises(ToolError, match="timed out"):
        python_tool("while True: pass")
    assert calls[0] == ("print(6*7)", {"timeout_s": 5.0, "memory_mb": 512})


# -- the built-in calc task ----------------------------------------------------------------------------


def test_calc_rows_are_deterministic_and_split():
    train = agent_tasks.generate_rows("train", 50, seed=0)
    assert train == agent_tasks.generate_rows("train", 50, seed=0)
    val = agent_tasks.generate_rows("val", 10, seed=0)
    for row, split in [*((r, "train") for r in train), *((r, "val") for r in val)]:
        prompt = row["prompt"][0]["content"]
        a, b = (int(x) for x in prompt.split("*"))
        assert 100 <= a <= 999 and 100 <= b <= 999
        assert row["reward_model"]["ground_truth"] == str(a * b)
        assert split_of(prompt) == split and row["data_source"] == "builtin/calc"
    with pytest.raises(ValueError, match="unknown split"):
        agent_tasks.generate_rows("test", 1)


@pytest.mark.parametrize(
    "response, score",
    [
        ("<tool>calculator: 347*829</tool><result>287663</result>287663", 1.0),
        ("<tool>calculator: 347*829</tool><result>287663</result> 287663 \n", 1.0),
        ("287663", 1.0),  # right without the tool
        ("<tool>calculator: 347*828</tool><result>287284</result>287284", 0.1),  # used the tool, wrong
        ("<tool>calculator 1</tool><result>error: malformed tool call</result>287", 0.0),
        ("28766", 0.0),
        ("", 0.0),
    ],
)
def test_calc_reward(response, score):
    assert agent_tasks.compute_score("builtin/calc", response, "287663") == score


def test_calc_reward_checks_the_data_source():
    with pytest.raises(ValueError, match="builtin/calc"):
        agent_tasks.compute_score("builtin/add", "1", "1")


def test_python_tool_in_the_real_sandbox(monkeypatch):
    """Last: the sandbox is another helper's work and needs bubblewrap."""
    from rlcore.rewards import sandbox

    if not sandbox.sandbox_available():
        pytest.skip(f"sandbox unavailable: {sandbox.unavailable_reason()}")
    monkeypatch.setattr(tools_module, "PYTHON_TIMEOUT_S", 30.0)  # slack for a loaded machine
    assert observe("<tool>python: print(sum(range(10)))</tool>", TOOLS) == ("<result>45</result>", False)
    observation, error = observe("<tool>python: raise ValueError('no')</tool>", TOOLS)
    assert observation == "<result>error: ValueError: no</result>" and error

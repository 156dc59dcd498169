"""Exact mode (rlcore.models.exact, issue 41): a sequence's log-probs are the same bits in every arrangement.

Property tests (hypothesis): the native engine samples a random batch (which prompts, how many samples,
how many tokens); the trainer then scores it rearranged at random (rows shuffled, extra left padding,
micro-batches by rows or by a token budget, shared-prompt packing asked for or not). Every token's
log-prob must equal, bit for bit, the one the engine sampled it with (prefill, then cached decode, in the
engine's batch). fp32 and bf16 weights, on the built-in model and on SmolLM2-135M's real weights. Without
the padded products (one kernel path changed) the same comparison is not equal: the tests can fail.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlcore.batch import Batch
from rlcore.data.prompts import make_prompt_batch
from rlcore.data.rows import Row
from rlcore.models import exact, exact_kernels, load_policy
from rlcore.models.exact import BLOCK, MIN_ROWS, aligned_prompt_width, make_exact
from rlcore.models.forward import compute_logprobs
from rlcore.rollout import NativeEngine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: shared cores

PROMPTS = ["reverse 1234", "reverse 98", "what is 3 + 4?", "reverse 5551", "name a colour", "reverse 7",
           "count to five", "reverse 120", "reverse 88888888", "hi", "reverse 31415926535", "add 2 and 2"]  # fmt: skip
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.cache
def exact_policy(path: str, dtype: str):
    model, tokenizer = load_policy(path)
    return exact_or_refused(model.to(DTYPES[dtype]).eval()), tokenizer


def exact_or_refused(model: torch.nn.Module) -> torch.nn.Module:
    """`make_exact(model)`; or, on a CPU whose kernels no row layout makes row-invariant in the model's dtype
    (the pre-flight check refuses in one line), a skip that says so (the refusal itself is tested with
    injected kernels in test_exact_check.py)."""
    try:
        return make_exact(model)
    except ValueError as e:
        if "every layout tried" not in str(e):
            raise
        pytest.skip(f"this CPU refuses exact mode: {e}")


def rollout(
    path: str, dtype: str, prompts: list[str], n: int, max_tokens: int, seed: int, record_routes: bool = False
) -> Batch:
    model, tokenizer = exact_policy(path, dtype)
    rows = [Row(data_source="x", prompt=[{"role": "user", "content": p}]) for p in prompts]
    engine = NativeEngine(model, tokenizer, record_routes=record_routes)
    return engine.generate(
        make_prompt_batch(rows, tokenizer), SamplingParams(n=n, max_tokens=max_tokens, seed=seed)
    )


arrangements = st.fixed_dictionaries({
    "order_seed": st.integers(0, 2**16),
    "extra_padding": st.integers(0, 2 * BLOCK + 3),
    "micro": st.one_of(st.tuples(st.just("rows"), st.integers(1, 20)), st.tuples(st.just("budget"), st.integers(8, 600))),
    "share_prompts": st.booleans(),
})  # fmt: skip


def rescored(path: str, dtype: str, batch: Batch, how: dict) -> torch.Tensor:
    """The trainer's log-probs of `batch` scored in arrangement `how`, back in the batch's row order."""
    return rescored_by(exact_policy(path, dtype)[0], batch, how)


def rescored_by(model: torch.nn.Module, batch: Batch, how: dict) -> torch.Tensor:
    order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(how["order_seed"]))
    shuffled = exact.left_pad_prompts(batch[order], how["extra_padding"])
    kind, size = how["micro"]
    split = {"micro_batch_size": size} if kind == "rows" else {"max_tokens": size}
    logprobs, _ = compute_logprobs(model, shuffled, share_prompts=how["share_prompts"], **split)
    out = torch.empty_like(logprobs)
    out[order] = logprobs
    return out


def assert_bitwise(batch: Batch, logprobs: torch.Tensor) -> None:
    mask = batch["response_mask"] != 0
    engine = batch["rollout_logprobs"]
    differ = (engine != logprobs) & mask
    assert not bool(differ.any()), (
        f"{int(differ.sum())} of {int(mask.sum())} tokens differ, by up to {(engine - logprobs)[differ].abs().max():.3g}"
    )


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@settings(SETTINGS, max_examples=20)
@given(
    prompts=st.lists(st.sampled_from(PROMPTS), min_size=1, max_size=8),
    n=st.integers(1, 4),
    max_tokens=st.integers(1, 40),
    seed=st.integers(0, 1000),
    how=arrangements,
)
def test_builtin_log_probs_are_the_same_bits_in_every_arrangement(dtype, prompts, n, max_tokens, seed, how):
    batch = rollout("builtin:tiny-reverse", dtype, prompts, n, max_tokens, seed)
    assert_bitwise(batch, rescored("builtin:tiny-reverse", dtype, batch, how))


@functools.cache
def smollm2_rollout(dtype: str) -> tuple[str, Batch]:
    """One engine batch of SmolLM2-135M (its GGUF weights): 3 chat prompts x 2 samples, up to 40 tokens
    (responses cross two key blocks; the chat template's prompts are ~30-40 tokens)."""
    from tests.real_model import smollm2_gguf

    path = str(smollm2_gguf())
    return path, rollout(path, dtype, ["What is 2 + 2?", "Name a colour.", "Count to three."], 2, 40, 0)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@settings(SETTINGS, max_examples=4)
@given(how=arrangements)
def test_smollm2_log_probs_are_the_same_bits_in_every_arrangement(dtype, how):
    path, batch = smollm2_rollout(dtype)
    assert int(batch["response_mask"].sum(dim=1).max()) > BLOCK  # a response crosses a block boundary
    assert_bitwise(batch, rescored(path, dtype, batch, how))


def differing(path: str) -> int:
    """How many sampled tokens of one fixed fp32 engine batch the trainer scores otherwise."""
    batch = rollout(path, "fp32", PROMPTS[:8], 4, 24, 0)
    logprobs, _ = compute_logprobs(exact_policy(path, "fp32")[0], batch)
    return int(((batch["rollout_logprobs"] != logprobs) & (batch["response_mask"] != 0)).sum())


def in_halves(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b summed over a's last dimension in two halves: the same sum in another order, as a kernel that
    blocks otherwise computes it (the breaks below construct their difference; no library's choice of
    kernel decides whether they differ)."""
    k = a.shape[-1] // 2
    lo, hi = a.clone(), a.clone()
    lo[..., k:], hi[..., :k] = 0, 0
    return lo @ b + hi @ b


def _break_scores(monkeypatch) -> None:
    def few_rows_otherwise(a, b, rows=None):  # the decode step's few-query products in another order
        return in_halves(a, b) if a.shape[-2] < MIN_ROWS else a @ b

    monkeypatch.setattr(exact, "batched_product", few_rows_otherwise)


def _break_products(monkeypatch) -> None:
    def otherwise(kernels, func, a, b):  # the trainer's products by another kernel than the engine's
        return in_halves(a, b)

    monkeypatch.setitem(exact_kernels._HANDLERS, torch.ops.aten.mm.default, otherwise)


def _break_layout(monkeypatch) -> None:
    import rlcore.rollout.native.engine

    monkeypatch.setattr(rlcore.rollout.native.engine, "align_prompts", lambda batch, align: batch)  # blocks fall elsewhere


@pytest.mark.parametrize(
    "breaking",
    [_break_scores, _break_products, _break_layout],
    ids=["few-row-scores", "trainer-other-kernel", "unaligned-engine"],
)
def test_one_path_changed_and_the_log_probs_differ(breaking, monkeypatch):
    """One path changed (the attention's few-row products summed in another order; the trainer's products
    by another kernel than the engine's; the engine's prompts not laid out in whole blocks): the engine
    and the trainer disagree again, so the tests above can fail, on any CPU."""

    assert differing("builtin:tiny-reverse") == 0
    breaking(monkeypatch)
    assert differing("builtin:tiny-reverse") > 0


def test_products_run_on_at_least_min_rows_and_silu_is_exact():
    """The dispatch table: a few-row product equals the rows of a many-row one, and `exact.product` on the
    packed weight (the lean step's) gives the same bits; a weight changed in place is packed anew by the
    next forward (even through `.data`, which moves no version); `silu` is x / (1 + e^-x)."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 576), torch.randn(1536, 576)
    with exact.ExactKernels():
        few = torch.nn.functional.linear(x[:3], w)
        many = torch.nn.functional.linear(x, w)
        silu = torch.nn.functional.silu(x)
    assert torch.equal(few, many[:3]) and MIN_ROWS > 3
    assert torch.equal(exact.product(x[:3], exact.packed_or_plain(w)), few)
    w.data.mul_(2.0)  # a load through .data: no version bump
    with exact.ExactKernels():
        assert torch.equal(torch.nn.functional.linear(x[:3], w), 2.0 * few)
    assert torch.equal(silu, x / (1 + torch.exp(-x)))


def test_prompts_are_laid_out_in_whole_blocks():
    assert [aligned_prompt_width(w) for w in (1, BLOCK, BLOCK + 1)] == [BLOCK, BLOCK, 2 * BLOCK]
    batch = Batch.from_dict(
        {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5)}
    )
    out = exact.align_prompts(batch)
    assert out["input_ids"].shape == (2, BLOCK) and int(out["attention_mask"][:, : BLOCK - 5].sum()) == 0


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@settings(SETTINGS, max_examples=15)
@given(
    prompts=st.lists(st.sampled_from(PROMPTS), min_size=1, max_size=6),
    n=st.integers(1, 3),
    max_tokens=st.integers(1, 24),
    seed=st.integers(0, 1000),
    replay=st.booleans(),
    how=arrangements,
)
def test_moe_log_probs_are_the_same_bits_in_every_arrangement(dtype, prompts, n, max_tokens, seed, replay, how):
    """A mixture of experts (tiny-moe, Qwen3-MoE: grouped expert products, q/k norms): the same bits in every
    arrangement, with the engine's recorded routes replayed by the trainer (their prompt columns laid out
    in whole blocks like the tokens) or routed by the trainer's own routers."""
    batch = rollout("builtin:tiny-moe", dtype, prompts, n, max_tokens, seed, record_routes=replay)
    if replay:
        routes = batch["prompt_routes"]
        assert routes.shape[1] == batch["input_ids"].shape[1] and bool((routes >= 0).any())
    assert_bitwise(batch, rescored("builtin:tiny-moe", dtype, batch, how))


def test_moe_expert_products_by_their_own_kernel_differ(monkeypatch):
    """With each expert's rows multiplied by a kernel that follows their count (fewer than MIN_ROWS rows
    summed in another order) the engine's few-row decode products and the trainer's differ: the MoE test
    above can fail."""

    def by_count(kernels, func, a, b, offs=None, bias=None, out_dtype=None):
        out, ends = a.new_empty((a.shape[0], b.shape[-1])), offs.tolist()
        for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
            rows = a[start:end]
            out[start:end] = in_halves(rows, b[g]) if end - start < MIN_ROWS else rows @ b[g]
        return out

    assert differing("builtin:tiny-moe") == 0
    monkeypatch.setitem(exact_kernels._HANDLERS, torch.ops.aten._grouped_mm.default, by_count)
    assert differing("builtin:tiny-moe") > 0


def test_a_grouped_product_that_is_not_experts_is_refused():
    a, b = torch.randn(4, 8), torch.randn(2, 8, 3)  # b is no transposed (G, N, K) weight
    with exact.ExactKernels(), pytest.raises(NotImplementedError, match="not a mixture of experts"):
        torch._grouped_mm(a, b, offs=torch.tensor([2, 4], dtype=torch.int32))


def test_the_backward_is_plain_attentions_with_padded_rows():
    """The update's backward through exact attention is plain attention's (recomputed by sdpa, `exact.
    _ExactAttend`): gradients as the default model's to float noise, none NaN where a padded query sees
    no key; the forward's log-probs are bit for bit the no-grad forward's."""
    import copy

    torch.manual_seed(0)
    base, _ = load_policy("builtin:tiny-reverse")
    plain, exact_model = base.train(), make_exact(copy.deepcopy(base)).train()
    ids = torch.randint(3, 40, (3, 37))
    mask = torch.ones_like(ids)
    mask[0, :20] = 0  # left padding: those queries see no key
    mask[2, :5] = 0
    grads = []
    for model in (plain, exact_model):
        logits = model(input_ids=ids, attention_mask=mask).logits
        (logits.float().log_softmax(-1)[mask.bool()].mean()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        if model is exact_model:
            with torch.no_grad():
                assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, logits.detach())
    for name, grad in grads[1].items():
        assert bool(torch.isfinite(grad).all()), name
        torch.testing.assert_close(grad, grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


def test_stacked_products_are_checked_before_the_lean_step_fuses_them(monkeypatch):
    """q/k/v and gate/up stacked give the separate products' bits (SmolLM2's shapes); a product whose
    columns depended on how many there are would be caught, and the step would not fuse."""
    cpu = torch.device("cpu")
    assert exact.stacks_exactly(576, (576, 192, 192), torch.float32, cpu)
    assert exact.stacks_exactly(576, (1536, 1536), torch.bfloat16, cpu)
    plain = exact.product
    monkeypatch.setattr(exact_kernels, "product",
                        lambda x, w, b=None, rows=None: plain(x, w, b) * (1 + 1e-3 * (w.shape[0] > 600)))  # fmt: skip
    assert not exact_kernels._stacks_exactly.__wrapped__(576, (576, 192, 192), torch.float32, cpu, exact_kernels.KernelRows())



@functools.cache
def exact_vl(family: str, dtype: str):
    """A tiny random vision-language model of `family` (tests/models/vl_models.py) in exact mode, and the
    same weights left plain."""
    import copy

    from tests.models.vl_models import model

    plain = model(family).to(DTYPES[dtype])
    return exact_or_refused(copy.deepcopy(plain)), plain


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
@settings(SETTINGS, max_examples=8)
@given(rows=st.lists(st.integers(0, 2), min_size=1, max_size=3), n=st.integers(1, 3), seed=st.integers(0, 1000),
       how=arrangements)  # fmt: skip
def test_vision_language_log_probs_are_the_same_bits_in_every_arrangement(family, dtype, rows, n, seed, how):
    """Images (two in one prompt, of different shapes; none; one): the engine's log-probs (its prefill
    encodes each prompt's images once) equal every rearranged trainer forward's (each image encoded with
    whichever others share the micro-batch; the M-RoPE positions padded like the prompt), and exact mode
    computes the plain model (its vision attention is full, not causal; each rotary column reads its
    own position component) to float noise."""
    from tests.models.test_vision import rows as vl_rows
    from tests.models.vl_models import tokenizer, vision

    model, plain = exact_vl(family, dtype)
    prompts = make_prompt_batch([vl_rows()[i] for i in rows], tokenizer(), vision=vision(family))
    batch = NativeEngine(model, tokenizer()).generate(prompts, SamplingParams(n=n, max_tokens=20, seed=seed))
    out = rescored_by(model, batch, how)  # (packing is off for images)
    assert_bitwise(batch, out)
    reference, _ = compute_logprobs(plain, batch)
    mask = batch["response_mask"] != 0
    assert float((reference - out)[mask].abs().max()) < (1e-5 if dtype == "fp32" else 0.03)  # measured 5e-7, 4e-3

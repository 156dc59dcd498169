"""Exact mode's pre-flight check (rlcore.models.exact_check, issue 55) with injected kernels.

A CPU with AMX was measured to give bf16 rows 7-17 of a product other bits than the same rows among 64 or
more (its kernels block the rows by their count). This machine may have no AMX, so the tests construct
such kernels: `exact_kernels.kernel` replaced by one that sums over K in two halves (another reduction
order, as another blocking does) in the calls of 7-17 rows (`amx_like`), or for the rows at odd places of
every call (`placed`, which no layout can hide). Every test says which ISA it ran on (`cpu_isa`).
"""

from __future__ import annotations

import pytest
import torch

from rlcore.batch import Batch
from rlcore.models import exact_check, exact_kernels, load_policy
from rlcore.models.exact import make_exact
from rlcore.models.exact_kernels import KernelRows
from rlcore.models.forward import compute_logprobs
from rlcore.models.onednn import cpu_isa
from tests.models.test_exact import PROMPTS

pytestmark = pytest.mark.usefixtures("one_thread")

REAL = exact_kernels.kernel


def halves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b as (x's first half of K) W^T + b, plus its second half's: another order of the same sum."""
    k = x.shape[-1] // 2
    lo, hi = x.clone(), x.clone()
    lo[..., k:], hi[..., :k] = 0, 0
    return REAL(lo, weight, bias) + REAL(hi, weight, None)


def amx_like(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The real kernel, except that a call of 7 to 17 rows sums in another order (as AMX's bf16 kernels)."""
    return halves(x, weight, bias) if 7 <= x.shape[0] <= 17 else REAL(x, weight, bias)


def placed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The real kernel for the rows at even places of a call, another order for the odd ones."""
    out = REAL(x, weight, bias)
    out[1::2] = halves(x, weight, bias)[1::2]
    return out


@pytest.fixture
def fresh(monkeypatch):
    """A process that has calibrated nothing yet: no layouts chosen, no shapes seen."""
    monkeypatch.setattr(exact_kernels, "ROWS", {})
    monkeypatch.setattr(exact_check, "_SEEN", {})
    print(f"ISA: {cpu_isa()}")
    return monkeypatch


def sampled_and_rescored(model: torch.nn.Module, tokenizer) -> tuple[Batch, torch.Tensor]:
    """One engine batch of `model` (8 prompts x 4 samples, up to 24 tokens: decode steps of few rows) and the
    trainer's log-probs of it (one forward of all rows)."""
    from rlcore.data.prompts import make_prompt_batch
    from rlcore.data.rows import Row
    from rlcore.rollout import NativeEngine, SamplingParams

    rows = [Row(data_source="x", prompt=[{"role": "user", "content": p}]) for p in PROMPTS[:8]]
    batch = NativeEngine(model, tokenizer).generate(
        make_prompt_batch(rows, tokenizer), SamplingParams(n=4, max_tokens=24, seed=0)
    )
    return batch, compute_logprobs(model, batch)[0]


def differing(batch: Batch, logprobs: torch.Tensor) -> int:
    return int(((batch["rollout_logprobs"] != logprobs) & (batch["response_mask"] != 0)).sum())


def test_the_check_finds_a_layout_for_kernels_blocked_by_row_count_and_the_run_is_exact(fresh):
    """With AMX-like kernels the default layout (one call on >= 16 rows) is not row-invariant: calibration
    picks fixed tiles of 64 rows, and the engine's log-probs equal the trainer's bit for bit. Forced back
    to the default layout, the same batch differs: the check is what makes it exact."""
    fresh.setattr(exact_kernels, "kernel", amx_like)
    model, tokenizer = load_policy("builtin:tiny-reverse")
    make_exact(model.eval())
    assert exact_kernels.ROWS[torch.float32] == KernelRows(tile=64)
    assert differing(*sampled_and_rescored(model, tokenizer)) == 0
    fresh.setitem(exact_kernels.ROWS, torch.float32, KernelRows())
    assert differing(*sampled_and_rescored(model, tokenizer)) > 0


def test_on_this_cpu_the_real_kernels_keep_the_cheapest_layout_or_another_that_holds(fresh):
    """The real kernels: the layout chosen for SmolLM2-shaped products (fp32 and bf16) is row-invariant by
    the check's own measure, and a check that can say no (AMX-like kernels) says no for the default."""
    shapes = {(1536, 576, False), (576, 1536, False), (192, 576, False)}
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        rows = exact_check.choose(dtype, cpu, shapes)
        assert all(exact_check.row_invariant(rows, n, k, dtype, cpu, batched=b) for n, k, b in shapes)
        print(f"{cpu_isa()} {dtype}: {rows.name}")
    fresh.setattr(exact_kernels, "kernel", amx_like)
    assert not exact_check.row_invariant(KernelRows(), 1536, 576, torch.bfloat16, cpu, batched=False)


def test_kernels_no_layout_can_hide_are_refused_in_one_line(fresh):
    """A kernel whose bits follow a row's place in its call defeats every layout: make_exact refuses,
    naming the CPU's instructions and the way out; the trainer turns it into its one-line config error."""
    fresh.setattr(exact_kernels, "kernel", placed)
    model, _ = load_policy("builtin:tiny-reverse")
    with pytest.raises(ValueError, match="ONEDNN_MAX_CPU_ISA") as refused:
        make_exact(model)
    message = str(refused.value)
    assert "\n" not in message and cpu_isa() in message and "every layout tried" in message


def test_the_trainer_refuses_before_the_first_step(fresh):
    """Through the trainer's model loading (what train.py calls before any step): exit-2 config error."""
    from configs import ConfigError
    from rlcore.dist.mesh import init_distributed
    from rlcore.trainer.cli import parse
    from rlcore.trainer.models import _load

    fresh.setattr(exact_kernels, "kernel", placed)
    cfg = parse(["grpo", "--rollout.exact"])
    with pytest.raises(ConfigError, match=r"--rollout.exact with --model.path builtin:.*ONEDNN_MAX_CPU_ISA"):
        _load(cfg, init_distributed("cpu"))


@pytest.mark.parametrize("m", [1, 15, 16, 17, 63, 64, 65, 129])
def test_a_tiled_layout_calls_the_kernel_on_whole_tiles_only(m, monkeypatch):
    """Tiles of 64 rows: every kernel call holds exactly 64 rows, whatever the row count (across each
    boundary), and the rows come back in order: equal to the tile-by-tile products by hand."""
    calls = []

    def recording(x, weight, bias):
        calls.append(x.shape[0])
        return REAL(x, weight, bias)

    monkeypatch.setattr(exact_kernels, "kernel", recording)
    torch.manual_seed(0)
    x, w = torch.randn(m, 32), torch.randn(48, 32)
    out = exact_kernels.product(x, w, rows=KernelRows(tile=64))
    assert set(calls) == {64} and len(calls) == -(-m // 64)
    tiles = [torch.nn.functional.pad(t, (0, 0, 0, 64 - t.shape[0])) for t in x.split(64)]
    by_hand = torch.cat([REAL(t, w, None)[: len(s)] for t, s in zip(tiles, x.split(64), strict=True)])
    assert torch.equal(out, by_hand)

"""rlcore.pure.distill against values derived by hand.

Two rows of three tokens; student log-probs s, teacher log-probs q; row 1's last two positions are
masked and hold garbage (inf, nan) that must never show.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.pure.distill import distill_advantages, reverse_kl_stats

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
STUDENT = torch.tensor([[-1.0, -0.5, -2.0], [-0.1, float("inf"), 0.0]], dtype=torch.float64)
TEACHER = torch.tensor([[-0.5, -1.5, -9.0], [-0.1, 0.0, float("nan")]], dtype=torch.float64)
TASK = torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, -1.0]], dtype=torch.float64)


def test_pure_distillation_is_minus_the_reverse_kl_per_token():
    # q - s: row 0 = [-0.5 + 1, -1.5 + 0.5, -9 + 2] = [0.5, -1, -7]; row 1 = [0, masked, masked]
    got = distill_advantages(torch.zeros_like(TASK), STUDENT, TEACHER, MASK)
    assert got.tolist() == [[0.5, -1.0, -7.0], [0.0, 0.0, 0.0]]


def test_mixed_with_task_advantages_scaled_and_clipped():
    # A + 0.5 * clip(q - s, -2, 2): row 0 = 0.5 + 0.5 * [0.5, -1, -2] = [0.75, 0, -0.5]; row 1 = -1 + 0
    got = distill_advantages(TASK, STUDENT, TEACHER, MASK, coef=0.5, clip=2.0)
    assert got.tolist() == [[0.75, 0.0, -0.5], [-1.0, 0.0, 0.0]]
    once = distill_advantages(torch.zeros_like(TASK), STUDENT, TEACHER, MASK, clip=2.0)
    twice = distill_advantages(torch.zeros_like(TASK), STUDENT, STUDENT + once, MASK, clip=2.0)
    assert torch.equal(once, twice)  # clipping a clipped term again changes nothing


def test_reverse_kl_stats_by_hand():
    # s - q over the 4 response tokens: [-0.5, 1, 7, 0]: mean 7.5 / 4, max 7; the teacher's
    # probability is below 1e-3 (log -6.91) on one token of four (log-prob -9)
    stats = reverse_kl_stats(STUDENT, TEACHER, MASK)
    assert float(stats["teacher/reverse_kl"]) == pytest.approx(7.5 / 4, rel=1e-7)
    assert float(stats["teacher/reverse_kl_max"]) == 7.0
    assert float(stats["teacher/unlikely_frac"]) == pytest.approx(0.25, rel=1e-7)
    assert math.log(1e-3) > -9.0
    empty = reverse_kl_stats(STUDENT, TEACHER, torch.zeros_like(MASK))
    assert all(float(v) == 0.0 for v in empty.values())
    assert all(v.dim() == 0 for v in stats.values())  # metrics stay tensors (no host sync)


def test_advantage_step_adds_the_teacher_term_to_grpo_and_keeps_the_returns():
    """rlcore.step.steps.advantage_step with GRPO and a teacher (coef 0.5): one group of two rows scoring 1 and
    0 (mean 0.5, unbiased std 1/sqrt(2): GRPO advantages +-1/sqrt(2) ~ +-0.70711 on every response token),
    plus 0.5 * (teacher - old log-prob) per token; the returns stay GRPO's."""
    from functools import partial

    from rlcore.algorithm import Algorithm
    from rlcore.batch import Batch
    from rlcore.pure.advantages import ESTIMATORS
    from rlcore.pure.losses import POLICY_LOSSES
    from rlcore.step.steps import advantage_step

    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    batch = Batch.from_dict({
        "token_scores": torch.tensor([[0.0, 1.0], [0.0, 0.0]]), "response_mask": mask, "uid": ["p", "p"],
        "old_logprobs": torch.tensor([[-1.0, -2.0], [-0.5, -3.0]]),
        "teacher_logprobs": torch.tensor([[-0.5, -4.0], [-1.5, 0.0]]),
    })  # fmt: skip
    algorithm = Algorithm(advantage_fn=ESTIMATORS["grpo"], policy_loss_fn=POLICY_LOSSES["ppo_clip"],
                          distill=partial(distill_advantages, coef=0.5))  # fmt: skip
    out, metrics = advantage_step(batch, algorithm)
    a = 1 / math.sqrt(2)
    # teacher - old: [[0.5, -2], [-1, masked]]; halved: [[0.25, -1], [-0.5, 0]]
    expected = torch.tensor([[a + 0.25, a - 1.0], [-a - 0.5, 0.0]])
    assert torch.allclose(out["advantages"], expected, atol=1e-5)
    assert torch.allclose(out["returns"], torch.tensor([[a, a], [-a, 0.0]]), atol=1e-5)
    # reverse KL (old - teacher) over the 3 response tokens: [-0.5, 2, 1]: mean 2.5 / 3, max 2
    assert metrics["teacher/reverse_kl"].item() == pytest.approx(2.5 / 3)
    assert metrics["teacher/reverse_kl_max"].item() == pytest.approx(2.0)

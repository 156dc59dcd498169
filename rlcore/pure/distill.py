"""On-policy distillation (OPD): a teacher's per-token signal on the student's own samples.

The student samples; a frozen teacher scores every sampled token. The per-token advantage is the
negative reverse KL's sampled estimate,

    a_t = -(log pi_student(y_t | y_<t) - log pi_teacher(y_t | y_<t)),

so the usual policy-gradient loss over it moves the student toward the teacher on the student's own
distribution (mode-seeking). Optionally clipped to [-clip, clip], scaled by `coef`, and added to the
task's advantages (0 of them: pure distillation):

    A_t = A_task_t + coef * clip(log pi_teacher - log pi_student)       (0 off the response mask)

References: Thinking Machines, "On-Policy Distillation" (2025,
https://thinkingmachines.ai/blog/on-policy-distillation/); Agarwal et al. 2024, GKD, "On-Policy
Distillation of Language Models: Learning from Self-Generated Mistakes", arXiv:2306.13649 (its
reverse-KL case). verl's twin is its `distillation.distillation_loss` with `use_policy_gradient=true` and
`loss_mode=k1` (verl docs, algo/opd: the per-token signal enters the policy-gradient reward); slime's
`--opd-kl-coef` subtracts the same term from any estimator's advantages, as here. The student's log-probs
are the trainer's old log-probs (no gradient flows through the advantage).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlcore.pure.masks import apply_mask, masked_mean


def distill_advantages(
    advantages: Tensor,
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    response_mask: Tensor,
    *,
    coef: float = 1.0,
    clip: float | None = None,
) -> Tensor:
    """`advantages` (b, t) plus coef * clip(teacher - student log-probs), per token; 0 off the mask.
    `clip` bounds the per-token term to [-clip, clip] (None: unbounded)."""
    term = teacher_logprobs - student_logprobs  # (b, t): minus the reverse KL's sampled estimate
    if clip is not None:
        term = term.clamp(-clip, clip)
    return apply_mask(advantages + coef * term, response_mask)


def reverse_kl_stats(
    student_logprobs: Tensor, teacher_logprobs: Tensor, response_mask: Tensor, *, unlikely: float = 1e-3
) -> dict[str, Tensor]:
    """0-dim metrics of the sampled reverse KL `log pi_student - log pi_teacher` over response tokens:
    its mean and max, and the share of tokens the teacher gives probability below `unlikely`."""
    mask = response_mask != 0
    kl = student_logprobs - teacher_logprobs  # (b, t)
    low = (teacher_logprobs < math.log(unlikely)).to(kl.dtype)
    largest = torch.where(mask, kl, torch.finfo(kl.dtype).min).amax() if mask.numel() else kl.new_zeros(())
    return {
        "teacher/reverse_kl": masked_mean(kl, response_mask),
        "teacher/reverse_kl_max": torch.where(mask.any(), largest, torch.zeros_like(largest)),  # 0: no tokens
        "teacher/unlikely_frac": masked_mean(low, response_mask),
    }

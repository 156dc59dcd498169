"""rlcore.pure — the math of RL post-training as pure functions on tensors.

Tensors in, tensors out: no I/O, no `torch.distributed`, no host syncs (`.item()`), no in-place
writes to inputs, no config objects. Hyper-parameters are keyword-only. Semantics equal verl 0.9.1
`verl/trainer/ppo/core_algos.py` on the same inputs; each module's docstring lists the few
deliberate departures.

Modules: `masks` (masked reductions), `groups` (per-group statistics), `advantages` (ESTIMATORS),
`kl` (estimators, penalty, adaptive coefficient), `losses` (aggregation, POLICY_LOSSES, value and
entropy losses), `logprobs` (memory-bounded token log-probs), `distill` (on-policy distillation's
per-token advantages from a teacher's log-probs).
"""

from rlcore.pure import advantages, distill, groups, kl, logprobs, losses, masks
from rlcore.pure.advantages import ESTIMATORS
from rlcore.pure.kl import adaptive_kl_coef, apply_kl_penalty, kl_estimate
from rlcore.pure.logprobs import token_logprobs
from rlcore.pure.losses import AGG_MODES, POLICY_LOSSES, aggregate, entropy, entropy_loss, value_loss
from rlcore.pure.masks import apply_mask, masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "AGG_MODES",
    "ESTIMATORS",
    "POLICY_LOSSES",
    "adaptive_kl_coef",
    "advantages",
    "aggregate",
    "apply_kl_penalty",
    "apply_mask",
    "distill",
    "entropy",
    "entropy_loss",
    "groups",
    "kl",
    "kl_estimate",
    "logprobs",
    "losses",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "masks",
    "token_logprobs",
    "value_loss",
]

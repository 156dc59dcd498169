"""The Tinker API's loss functions, each backed by rlcore's pure losses (`rlcore.pure.losses`).

Every Tinker loss is a sum over tokens and over datums (no mean), on next-token-aligned tensors: position
i of a datum's model input predicts `target_tokens[i]`, and `logprobs` (the sampler's) and `advantages`
are given per position. Here lp is the trained model's log-prob of the target, q the sampler's, A the
advantage, r = exp(lp - q), sg a stop-gradient, and lo / hi the clip thresholds of `loss_fn_config`:

| name | loss | rlcore backing |
|---|---|---|
| cross_entropy | -sum w lp | `aggregate(-lp, w, "token-sum")` |
| importance_sampling | -sum r A | `ppo_clip` with the clip and the dual clip off |
| ppo | -sum min(r A, clip(r, lo, hi) A), lo/hi 0.8/1.2 | `ppo_clip` (clip_low = 1 - lo, clip_high = hi - 1), no dual clip |
| cispo | -sum sg(clip(r, lo, hi)) A lp, lo/hi 0/4 | `cispo` |
| dro | -sum (A lp - beta/2 (lp - q)^2), beta 0.05 | `dro` |
| gspo | GSPO-token: each token carries s = exp(mean over the mask of (lp - q)) with lp's gradient; -sum min(s A, clip(s, lo, hi) A), lo/hi 0.8/1.2 | `gspo` |

`weights` (optional for the policy-gradient losses) masks and scales each token's loss, as it does in
cross_entropy; without it every position of the datum counts (the cookbook puts 0 in `advantages` on the
prompt). gspo's sequence ratio is the mean over `sequence_ratio_mask` (default: the positions with a
non-zero advantage), and its sum runs over the same positions. `ppo_clip` clamps the log-ratio to +-20
before exp (Tinker's formula does not): the two differ only past a ratio of e^20.

Not served, each refused in one line: stable_reinforce (its formula and the stability records it reads are
not public) and server-side custom losses (the SDK runs `forward_backward_custom` on the client: a
forward-only cross_entropy, then cross_entropy with weights = -dLoss/dlp, which gives exactly the user's
gradient).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from torch import Tensor

from rlcore.pure.losses import aggregate, cispo, dro, gspo, ppo_clip
from rlcore.tinker.errors import UserError

SUM = "token-sum"

LossFn = Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float], Tensor], Tensor]
"""(lp (m, r) with grad, the loss inputs (m, r), the config with defaults filled, the mask (m, r): 1 on a
datum's positions, 0 on padding) -> the 0-dim sum of the loss over these rows."""


@dataclasses.dataclass(frozen=True)
class TinkerLoss:
    """One Tinker loss: what it reads and how it is computed."""

    inputs: tuple[str, ...]
    """Required loss inputs besides target_tokens."""
    optional: tuple[str, ...]
    """Loss inputs it reads when given."""
    config: Mapping[str, float]
    """Its `loss_fn_config` keys with their defaults."""
    fn: LossFn


def _mask(inputs: Mapping[str, Tensor], mask: Tensor) -> Tensor:
    return inputs["weights"] * mask if "weights" in inputs else mask


def _cross_entropy(lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float], mask: Tensor) -> Tensor:
    return aggregate(-lp, inputs["weights"] * mask, SUM)


def _importance_sampling(lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float], mask: Tensor) -> Tensor:
    return ppo_clip(lp, inputs["logprobs"], inputs["advantages"], _mask(inputs, mask), agg=SUM, clip_low=1.0,
                    clip_high=math.inf, clip_c=math.inf)[0]  # fmt: skip


def _ppo(lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float], mask: Tensor) -> Tensor:
    low, high = _thresholds(cfg)
    return ppo_clip(lp, inputs["logprobs"], inputs["advantages"], _mask(inputs, mask), agg=SUM, clip_low=1.0 - low,
                    clip_high=high - 1.0, clip_c=math.inf)[0]  # fmt: skip


def _cispo(lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float], mask: Tensor) -> Tensor:
    low, high = _thresholds(cfg)
    return cispo(lp, inputs["logprobs"], inputs["advantages"], _mask(inputs, mask), agg=SUM, clip_low=1.0 - low,
                 clip_high=high - 1.0)[0]  # fmt: skip


def _dro(lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float], mask: Tensor) -> Tensor:
    return dro(lp, inputs["logprobs"], inputs["advantages"], _mask(inputs, mask), agg=SUM, beta=cfg["beta"])[0]


def _gspo(lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float], mask: Tensor) -> Tensor:
    low, high = _thresholds(cfg)
    kept = inputs.get("sequence_ratio_mask", (inputs["advantages"] != 0).to(lp.dtype))
    return gspo(lp, inputs["logprobs"], inputs["advantages"], _mask(inputs, mask) * kept, agg=SUM,
                clip_low=1.0 - low, clip_high=high - 1.0)[0]  # fmt: skip


def _thresholds(cfg: Mapping[str, float]) -> tuple[float, float]:
    low, high = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    if not 0.0 <= low <= 1.0 <= high:
        raise UserError(f"loss_fn_config: clip thresholds {low} / {high} must satisfy 0 <= low <= 1 <= high")
    return low, high


_RL = ("logprobs", "advantages")
_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_CISPO = {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}

TINKER_LOSSES: dict[str, TinkerLoss] = {
    "cross_entropy": TinkerLoss(inputs=("weights",), optional=(), config={}, fn=_cross_entropy),
    "importance_sampling": TinkerLoss(inputs=_RL, optional=("weights",), config={}, fn=_importance_sampling),
    "ppo": TinkerLoss(inputs=_RL, optional=("weights",), config=_CLIP, fn=_ppo),
    "cispo": TinkerLoss(inputs=_RL, optional=("weights",), config=_CISPO, fn=_cispo),
    "dro": TinkerLoss(inputs=_RL, optional=("weights",), config={"beta": 0.05}, fn=_dro),
    "gspo": TinkerLoss(inputs=_RL, optional=("weights", "sequence_ratio_mask"), config=_CLIP, fn=_gspo),
}
"""The losses served, by their Tinker names (module docstring)."""

REFUSED: dict[str, str] = {
    "stable_reinforce": "stable_reinforce is not served: its formula and the stability records it reads are not "
    "public; use ppo, cispo or gspo",
    "custom": "server-side custom losses are not served: call forward_backward_custom, which the SDK runs on "
    "the client",
}


def loss_of(name: str, config: Mapping[str, float]) -> tuple[TinkerLoss, dict[str, float]]:
    """The loss called `name` and its config with defaults filled; a UserError naming the fix otherwise."""
    if name in REFUSED:
        raise UserError(REFUSED[name])
    loss = TINKER_LOSSES.get(name)
    if loss is None:
        raise UserError(f"unknown loss_fn {name!r}; served: {', '.join(TINKER_LOSSES)}")
    unknown = sorted(set(config) - set(loss.config))
    if unknown:
        keys = ", ".join(loss.config) or "none"
        raise UserError(f"loss_fn_config of {name}: unknown key(s) {', '.join(unknown)} (it takes: {keys})")
    return loss, {**loss.config, **config}


def check_inputs(name: str, loss: TinkerLoss, given: Mapping[str, Tensor], n: int, where: str) -> None:
    """Each required input given, none unknown, each of the datum's length `n` (one line naming the fix)."""
    wanted = {"target_tokens", *loss.inputs}
    missing = sorted(wanted - set(given))
    if missing:
        raise UserError(f"{where}: {name} needs loss_fn_inputs {', '.join(sorted(wanted))}; missing {', '.join(missing)}")
    unknown = sorted(set(given) - wanted - set(loss.optional))
    if unknown:
        raise UserError(f"{where}: {name} does not read loss_fn_inputs {', '.join(unknown)} "
                        f"(it reads {', '.join(sorted(wanted | set(loss.optional)))})")  # fmt: skip
    for key, t in given.items():
        if t.dim() != 1 or t.shape[0] != n:
            raise UserError(f"{where}: loss_fn_inputs[{key!r}] has shape {list(t.shape)}; expected [{n}], one value "
                            "per model input token (2-D top-k targets are not served)")  # fmt: skip

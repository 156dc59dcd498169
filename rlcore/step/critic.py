"""The PPO critic: a causal-LM backbone with a scalar value head, its value pass and its update.

    critic = build_critic("builtin:tiny-reverse", seed=0)              # or a Hugging Face directory
    batch = batch.with_(values=compute_values(critic, batch))          # V(s_t) for every response token
    state, metrics = critic_update(state, batch, partial(value_loss, clip=0.5), plan, mesh=mesh, horizon=64)

V(s_t) is read at the position *before* response token t (the state the token is sampled from), as
verl's critic does (`values[:, -response_length - 1 : -1]`). The head starts at zero, so the first
values are 0 and GAE starts as plain discounted returns. The update minimises verl's clipped value
loss (`rlcore.pure.losses.value_loss`) over the same mini-batches x micro-batches as the actor, with
global token / sequence counts, so any world size and micro-batch split give the same gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from rlcore.batch import Batch
from rlcore.models.forward import micro_batches, model_inputs
from rlcore.models.layouts import adapted, layout_of
from rlcore.models.policy import load_policy
from rlcore.plan import UpdatePlan
from rlcore.pure.masks import masked_mean, masked_sum, masked_var
from rlcore.state import ModelState
from rlcore.step.update import NORMS, run_updates


class ValueModel(nn.Module):
    """`backbone` (a Hugging Face base model: hidden states out) + `value_head` (hidden -> 1)."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self._no_split_modules = getattr(backbone, "_no_split_modules", None)  # FSDP2 wraps these layers
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):
        """The backbone's config (hidden size, attention implementation: shared-prompt packing reads them)."""
        return self.backbone.config

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, **vision: Tensor
    ) -> Tensor:
        """V at every position: (m, s) float32. `vision`: a vision-language backbone's images
        (`rlcore.models.forward.vision_inputs`)."""
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **vision
        )
        hidden = out.last_hidden_state  # (m, s, h)
        return self.value_head(hidden).float().squeeze(-1).clone()  # (m, s); a fresh tensor, not a view


def build_critic(
    path: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, lora: dict[str, Any] | None = None
) -> ValueModel:
    """A critic on the backbone of the causal LM at `path` (builtin:<name> or a directory), head at zero.
    `lora`: `rlcore.models.lora.apply_lora`'s keywords, for LoRA adapters on the backbone (then only
    they and the value head train)."""
    lm, _ = load_policy(path, dtype=dtype, seed=seed)
    if lora:
        from rlcore.models.lora import apply_lora

        lm = apply_lora(lm, seed=seed, **lora)
    critic = ValueModel(lm.model, lm.config.get_text_config().hidden_size).to(dtype)
    return critic.train()


def response_values(critic: nn.Module, micro: Batch, *, share_prompts: bool = True) -> Tensor:
    """V(s_t) for each response token of a micro-batch (trimmed width r): (m, r) float32.

    With `share_prompts`, each prompt is computed once for its samples where that pays (as the
    actor's forwards do, `rlcore.models.forward.model_inputs`)."""
    layout = layout_of(critic, model_inputs(critic, micro, share_prompts=share_prompts))
    feed = layout.feed(critic)
    with adapted(critic, layout) as extra:
        values = critic(feed.input_ids, feed.attention_mask, feed.position_ids, **extra)  # (m, s)
    return layout.per_token(values, lambda v, _labels: v)  # the position before each response token


@torch.no_grad()
def compute_values(
    critic: nn.Module, batch: Batch, *, micro_batch_size: int | None = None, share_prompts: bool = True
) -> Tensor:
    """V(s_t) of every response token, 0 where response_mask is 0: (b, t) float32, batch order kept."""
    out = torch.zeros(batch["response_mask"].shape, dtype=torch.float32, device=batch["responses"].device)
    for micro, rows in micro_batches(batch, micro_batch_size=micro_batch_size):
        values = response_values(critic, micro, share_prompts=share_prompts)  # (m, r)
        out[rows, : values.shape[1]] = values
    return torch.where(batch["response_mask"] != 0, out, torch.zeros_like(out))


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(returns - values) / Var(returns) over the response tokens (1 = perfect, 0 = a constant)."""
    return 1.0 - masked_var(returns - values, mask) / (masked_var(returns, mask) + 1e-8)


def critic_micro_loss(
    critic: nn.Module,
    micro: Batch,
    norms: dict[str, Any],
    *,
    value_loss_fn: Callable[..., tuple[Tensor, dict[str, Tensor]]],
    share_prompts: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The critic's micro-batch loss (a `rlcore.step.update.MicroLoss` once the keywords are bound):
    `value_loss_fn(values, old_values, returns, mask, num_tokens=, num_seqs=, horizon=)` with its
    clip and aggregation bound; metrics under `critic/`."""
    values = response_values(critic, micro, share_prompts=share_prompts)  # (m, r), with grad
    r = values.shape[1]
    mask = micro["response_mask"][:, :r]
    loss, metrics = value_loss_fn(
        values, micro["values"][:, :r], micro["returns"][:, :r], mask, **{k: norms[k] for k in NORMS}
    )
    share = (mask != 0).sum() / norms["num_tokens"]
    sums = {
        "critic/vf_loss": loss.detach(),
        "critic/vf_clipfrac": metrics["vf_clipfrac"].detach() * share,
        "critic/vpred_mean": masked_sum(values.detach(), mask) / norms["num_tokens"],
    }
    return loss, sums


def critic_update(
    state: ModelState,
    batch: Batch,
    value_loss_fn: Callable[..., tuple[Tensor, dict[str, Tensor]]],
    plan: UpdatePlan,
    *,
    mesh=None,
    horizon: int,
) -> tuple[ModelState, dict[str, float]]:
    """`plan.ppo_epochs` x mini-batches updates of the critic toward `returns` (`rlcore.step.update.run_updates`).

    Batch fields: the sequence fields, `values` (rollout-time V, the clip anchor), `returns`.
    `value_loss_fn`: e.g. `partial(rlcore.pure.losses.value_loss, clip=0.5, agg="token-mean")`.
    Metrics: critic/vf_loss, critic/vf_clipfrac, critic/vpred_mean, critic/grad_norm (means over
    updates), critic/explained_variance (of the rollout-time values), critic/returns_mean, critic/lr,
    critic/bad_updates.
    """
    loss = partial(critic_micro_loss, value_loss_fn=value_loss_fn, share_prompts=plan.share_prompts)
    state, metrics = run_updates(state, batch, loss, plan, mesh=mesh, horizon=horizon, prefix="critic")
    mask = batch["response_mask"]
    metrics["critic/explained_variance"] = float(explained_variance(batch["values"], batch["returns"], mask))
    metrics["critic/returns_mean"] = float(masked_mean(batch["returns"], mask))
    return state, metrics

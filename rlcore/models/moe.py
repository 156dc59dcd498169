"""Mixture-of-experts policies: their routers, and recording and replaying the experts they choose.

    tap = router_tap(model)                 # None for a dense model; one per module, made once
    with tap.tracing() as trace:            # what every router chose in the forwards inside
        model(input_ids=...)
    trace.experts()                         # (N, L, k) long: tokens x MoE layers x experts per token
    tap.replay = routes                     # (N, L, k): the next forwards route each token there (R3)

Covered (the families whose record has a `MoESpec`, `rlcore.models.families`): Qwen3-MoE, Qwen2-MoE (with
its shared expert), Mixtral, OLMoE and gpt-oss, as
`from_pretrained` builds them in transformers 5: each MoE layer has a `<Family>TopKRouter` that maps
the flattened hidden states (N, h) to (router logits (N, E), gate weights (N, k), experts (N, k)). A
forward hook on every router records its choice, or replaces it: in replay, the experts are the
recorded ones where a record exists (>= 0) and the router's own elsewhere, and the gate weights come
from the router's own logits over them (`rlcore.pure.routing.replay_gates`), renormalised as the
model renormalises. A replay stays in force until the next forward sets another (`set_replay`), so a
backward that recomputes a checkpointed layer routes it the same way; the passes that set one clear it
when they end (`compute_logprobs`, `run_updates`), and the native engine clears it before it samples.

The routes' token order is the forward's own: `input_ids` flattened row by row (`rlcore.models.
forward.ModelInputs.routes` lays the batch's recorded routes out like that, packed rows included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from rlcore.models.families import MoESpec, family_of
from rlcore.pure.routing import (
    load_balancing_loss,
    replay_gates,
    route_agreement,
    router_stats,
    top_experts,
)


def moe_family(model: nn.Module) -> MoESpec | None:
    """The routing of `model` (a causal LM, possibly wrapped) when its family is a mixture of experts
    (`rlcore.models.families`), else None."""
    return family_of(model).moe


def checkpoint_tensors(family: MoESpec, name: str, tensor: Tensor) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) as the family's checkpoints hold it: a fused expert tensor (`...mlp.experts.
    gate_up_proj` (E, 2i, h), `...mlp.experts.down_proj` (E, h, i)) as one 2-D weight per expert and
    projection, the block renamed as the checkpoint names it; anything else as it is. Engines that
    load checkpoint-named weights (vLLM) take these."""
    head, dot, leaf = name.rpartition(".experts.")
    if not dot or leaf not in ("gate_up_proj", "down_proj"):
        yield _checkpoint_block(family, name), tensor
        return
    gate, up, down = family.checkpoint_experts
    for e, weight in enumerate(tensor):
        expert = _checkpoint_block(family, f"{head}.experts.{e}")
        if leaf == "down_proj":
            yield f"{expert}.{down}.weight", weight
        else:
            g, u = weight.chunk(2, dim=0)
            yield f"{expert}.{gate}.weight", g
            yield f"{expert}.{up}.weight", u


def _checkpoint_block(family: MoESpec, name: str) -> str:
    if family.checkpoint_block == "mlp":
        return name
    return name.replace(".mlp.", f".{family.checkpoint_block}.")


def is_moe(model: nn.Module) -> bool:
    """Whether `model` is a mixture of experts rlcore covers."""
    return moe_family(model) is not None


def routers(model: nn.Module) -> list[nn.Module]:
    """The router modules of `model`, in layer order (a dense layer of a mixed model has none)."""
    family = moe_family(model)
    if family is None:
        return []
    return [m for m in model.modules() if type(m).__name__ == family.router_class]


@dataclasses.dataclass
class RouteTrace:
    """What the routers did in the traced forwards, one entry per router call, in call order."""

    logits: list[Tensor] = dataclasses.field(default_factory=list)
    """Router logits (N, E) per call (with grad when the forward has it)."""
    chosen: list[Tensor] = dataclasses.field(default_factory=list)
    """The experts used (N, k) per call (the replayed ones under a replay)."""
    natural: list[Tensor] = dataclasses.field(default_factory=list)
    """The router's own top-k (N, k) per call."""

    def experts(self, layers: int) -> Tensor:
        """(N, L, k) the experts used, for traced forwards over the same N tokens each (`layers` calls
        per forward; several forwards are concatenated along N)."""
        return _by_token(self.chosen, layers)

    def own_experts(self, layers: int) -> Tensor:
        """(N, L, k) the router's own top-k, like `experts`."""
        return _by_token(self.natural, layers)

    def take(self, layers: int) -> Tensor:
        """(N, L, k) the experts used in the traced forwards since the last `take` (calls of one
        forward over N tokens, or several over the same N), which it then forgets."""
        experts = self.experts(layers)
        self.logits.clear()
        self.chosen.clear()
        self.natural.clear()
        return experts

    def stacked_logits(self) -> Tensor:
        """(L, N, E) the logits of one traced forward."""
        return torch.stack(self.logits)


def _by_token(calls: list[Tensor], layers: int) -> Tensor:
    forwards = [torch.stack(calls[i : i + layers], dim=1) for i in range(0, len(calls), layers)]
    return torch.cat(forwards, dim=0)  # (N, L, k)


class RouterTap:
    """Forward hooks on every router of one MoE model: tracing and replay (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        family = moe_family(model)
        if family is None:
            raise ValueError(f"{type(model).__name__} is not a mixture of experts rlcore covers")
        self.routers = routers(model)
        self.layers = len(self.routers)
        self.top_k = int(self.routers[0].top_k)
        self.num_experts = int(self.routers[0].num_experts)
        self.replay: Tensor | None = None
        self.replays = True
        """Whether forwards given recorded routes route by them (R3); False: they are only compared
        (`--algo.router-replay record`)."""
        self._trace: RouteTrace | None = None
        for i, router in enumerate(self.routers):
            normalize = (
                True if family.normalize_attr is None else bool(getattr(router, family.normalize_attr))
            )
            router.register_forward_hook(functools.partial(self._hook, i, normalize, family.gates_over_chosen))

    def set_replay(self, routes: Tensor | None) -> None:
        """Route the following forwards' tokens by `routes` (N, L, k) long (-1: the router's own
        choice), or by the routers alone (None)."""
        self.replay = routes

    @contextlib.contextmanager
    def tracing(self) -> Iterator[RouteTrace]:
        """Record every router call of the forwards inside the block."""
        self._trace = trace = RouteTrace()
        try:
            yield trace
        finally:
            self._trace = None

    def _hook(
        self, layer: int, normalize: bool, over_chosen: bool, module: nn.Module, args: Any, output: Any
    ) -> Any:
        logits, gates, experts = output
        natural = experts
        if self.replay is not None and self.replays:
            recorded = self.replay[:, layer].to(device=experts.device, dtype=torch.long)  # (N, k)
            if recorded.shape != experts.shape:
                raise ValueError(
                    f"router replay: {tuple(recorded.shape)} recorded experts for a forward over "
                    f"{tuple(experts.shape)} (tokens, k) at MoE layer {layer}"
                )
            experts = torch.where(recorded >= 0, recorded, experts)
            gates = replay_gates(logits, experts, normalize=normalize, over_chosen=over_chosen).to(gates.dtype)
            output = (logits, gates, experts)
        if self._trace is not None:
            self._trace.logits.append(logits)
            self._trace.chosen.append(experts.detach())
            self._trace.natural.append(natural.detach())
        return output


_TAP_ATTR = "_rlcore_router_tap"


def router_tap(model: nn.Module) -> RouterTap | None:
    """The `RouterTap` of `model`, or None for a dense model. It is made once, on first use, and kept on
    the model itself (its routers' hooks hold it anyway), so it lives and dies with the model."""
    inner = getattr(model, "_orig_mod", model)  # a torch.compile wrapper shares the module's routers
    tap = inner.__dict__.get(_TAP_ATTR)
    if tap is None and is_moe(inner):
        tap = RouterTap(inner)
        object.__setattr__(inner, _TAP_ATTR, tap)  # a plain attribute, not a submodule or a buffer
    return tap


def own_routes(model: nn.Module, **forward: Any) -> Tensor:
    """(N, L, k) the experts `model`'s routers choose in one forward with keyword inputs `forward`
    (no grad, no replay), e.g. to check a recording. `top_experts` by the traced logits."""
    tap = router_tap(model)
    if tap is None:
        raise ValueError(f"{type(model).__name__} is not a mixture of experts rlcore covers")
    saved, tap.replay = tap.replay, None
    try:
        with torch.no_grad(), tap.tracing() as trace:
            model(**forward)
    finally:
        tap.replay = saved
    return torch.stack([top_experts(x, tap.top_k) for x in trace.logits], dim=1)


@contextlib.contextmanager
def tracing(tap: RouterTap | None) -> Iterator[RouteTrace | None]:
    """`tap.tracing()`, or None for a dense model (no tap)."""
    if tap is None:
        yield None
        return
    with tap.tracing() as trace:
        yield trace


def router_terms(
    tap: RouterTap, trace: RouteTrace, token_kind: Tensor, routes: Tensor | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """(load-balancing loss, metrics) of one traced training forward: the loss over its real tokens
    (`rlcore.pure.routing.load_balancing_loss`, the model's own top-k), and `router/entropy`,
    `router/load_max_over_mean` (over layers: the max; `_avg`: the mean) and `router/aux_loss`; with
    recorded `routes`, `rollout/router_agreement` (the share of response tokens whose own top-k is the
    recorded set, mean over layers) and `rollout/router_agreement_min` (the least agreeing layer)."""
    logits = trace.stacked_logits()  # (L, N, E)
    real = token_kind != 0  # (N,)
    aux = load_balancing_loss(logits, top_k=tap.top_k, mask=real)
    chosen = trace.experts(tap.layers)  # (N, L, k)
    stats = router_stats(logits.detach(), chosen.transpose(0, 1), real)
    metrics = {f"router/{k}": v for k, v in stats.items()} | {"router/aux_loss": aux.detach()}
    if routes is not None:
        agree = route_agreement(trace.own_experts(tap.layers), routes, token_kind == 2)  # (L,)
        metrics |= {"rollout/router_agreement": agree.mean(), "rollout/router_agreement_min": agree.min()}
    return aux, metrics

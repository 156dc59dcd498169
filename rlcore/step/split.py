"""Split placement (--pipeline.placement split): the rollout ranks' loop, and what crosses the roles.

    rollout rank (of N)                               trainer rank (of M; the leader is the first)
    receive the starting weights  <---------------    push the weights (the engine's start)
    for each step t with t <= s + 1 + K:              for each step t = s + 1, ...:
        generate and score with version s,
        send whole prompt groups  ---------------->       receive the batch of step t (waits: trainer idle)
    receive the weights of step s + 1  <----------        learn, push the new weights (after every step)
    (waits: rollout idle) [validate -> leader]            [leader: the validation result], log
    [save the batches sent but not trained]               [save the model and optimizer], same checkpoint

Sends of rollouts are asynchronous (the rollout ranks run ahead, up to K batches, while the trainer
works); everything else is blocking and happens in the same order on both sides, so lag mode is
exactly the algorithm of the colocated run: the batch of step t is generated with version
max(0, t - 1 - K), from the same cursor and seeds (rollout rank r samples as rank r of N colocated
ranks would). Each rollout rank's batch is cut in whole prompt groups, in rank order, into M equal
parts, one per trainer rank (with dynamic sampling every rollout rank first keeps as many groups as
the fewest of them has, as colocated ranks do).

Stream mode (--pipeline.mode stream) changes only when the rollout ranks take a push: the leader
sends it without waiting (`rlcore.step.handles.Outbox`), a rollout rank takes whatever has arrived before each batch
(`Inbox`) and waits only when the next batch would be more than K versions behind; with
--pipeline.partial-rollout it also takes pushes between decode steps of a batch. Which version a
batch gets then depends on timing: fresher samples, no reproducibility.

With --pipeline.push delta (lag mode) a push carries, per tensor, the XOR of its bytes against what the
rollout ranks last received, compressed (`rlcore.dist.delta`): the leader keeps a CPU copy of what it last
pushed, each rollout rank one of what it last received. A rollout rank decodes the whole push and checks
every tensor's checksum before its engine loads anything; if any rank disagrees the leader sends
everything whole (`sync/delta_fallbacks`), so the engine never sees a corrupt tensor.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rlcore.algorithm import Algorithm
from rlcore.data.prompts import pad_token_id
from rlcore.dist.delta import PushCopy, encode_all
from rlcore.dist.reduce import all_reduce_int, reduce_metrics
from rlcore.dist.stream import WeightPush
from rlcore.dist.transfer import (
    broadcast_delta,
    broadcast_weights,
    group_device,
    json_tensor,
    receive_delta,
    receive_weights,
    recv_batch,
    send_batch,
    tensor_json,
)
from rlcore.plan import StepPlan
from rlcore.state import Rollout, TrainState
from rlcore.step.collect import due, generate
from rlcore.step.partial import tagged
from rlcore.step.steps import concat_rollouts
from rlcore.step.weights import push_state

if TYPE_CHECKING:
    from rlcore.step.handles import Handles


def routes(groups: int, rank: int, rollout_ranks: int, trainer_ranks: int) -> list[tuple[int, int]]:
    """For each trainer rank, the range [a, b) of this rollout rank's `groups` prompt groups it gets:
    the rollout ranks' groups in rank order, cut into `trainer_ranks` equal parts (a remainder that does
    not divide is dropped; empty ranges where a part lies elsewhere)."""
    part = rollout_ranks * groups // trainer_ranks
    mine = rank * groups
    out = []
    for j in range(trainer_ranks):
        a, b = max(j * part, mine), min((j + 1) * part, mine + groups)
        out.append((a - mine, b - mine) if a < b else (0, 0))
    return out


# ---------------------------------------------------------------- rollouts: rollout ranks -> trainer ranks


def send_rollout(rollout: Rollout, h: Handles, plan: StepPlan) -> list[Any]:
    """Send this rollout rank's share of `rollout` to every trainer rank (a collective of the rollout
    ranks: they agree on the groups kept and on the step's metrics); returns the pending sends."""
    n, p = plan.rollout.sampling.n, h.placement
    groups = all_reduce_int(len(rollout.batch) // n, h.mesh, op="min")
    info = {
        "step": rollout.step,
        "version": rollout.version,
        "metrics": reduce_metrics(dict(rollout.metrics), h.mesh),
    }
    works = []
    parts = routes(groups, h.dist.rank, h.dist.world_size, len(p.trainer_ranks) // p.peer_size)
    for i, dst in enumerate(p.trainer_ranks):  # tp / sp: the peers of a data-parallel coordinate get its part
        a, b = parts[i // p.peer_size]
        piece = rollout.batch[a * n : b * n].with_meta(rollout=info)
        works += send_batch(piece, dst, group=p.data, async_op=True)
    return works


def receive_rollout(state: TrainState, h: Handles) -> tuple[Rollout, float]:
    """The batch of step state.step + 1 for this trainer rank (its part from every rollout rank), and the
    seconds spent waiting for it."""
    started = time.perf_counter()
    pieces = [recv_batch(src, group=h.placement.data) for src in h.placement.rollout_ranks]
    waited = time.perf_counter() - started
    info = pieces[0].meta["rollout"]
    if info["step"] != state.step + 1:
        raise RuntimeError(
            f"split placement: trainer at step {state.step + 1} received the batch of step {info['step']}"
        )
    kept = [piece for piece in pieces if len(piece)] or pieces[:1]
    batch = concat_rollouts(kept, pad_token_id(h.tokenizer)) if len(kept) > 1 else kept[0]
    batch = dataclasses.replace(batch, meta={k: v for k, v in batch.meta.items() if k != "rollout"})
    rollout = Rollout(step=info["step"], batch=batch.to(h.dist.device), metrics=info["metrics"],
                      version=info["version"])  # fmt: skip
    return rollout, waited


# ---------------------------------------------------------------- weights: trainer ranks -> rollout ranks


def push_weights(
    model: Any,
    h: Handles,
    *,
    step: int,
    version: int,
    bucket_bytes: int,
    stream: bool,
    base: PushCopy | None = None,
) -> dict[str, float]:
    """Tell the rollout ranks that `step` steps are trained and the policy is `version`, with the weights
    of `model` (gathered over the trainer ranks, broadcast by the leader), or without (`model` None: the
    weights did not change, e.g. an empty step). Every trainer rank calls it. In stream mode the leader
    does not wait for the rollout ranks to receive it (`h.outbox` keeps it until they have). With `base`
    (--pipeline.push delta; lag mode) the leader sends deltas against it, the copy of what it pushed last,
    and keeps what it pushes now in it (the other trainer ranks' `base` stays empty)."""
    if base is not None and stream:
        raise ValueError("delta pushes need lag mode: the leader waits for the rollout ranks' checksums")
    p = h.placement
    leads = dist.get_rank() == p.leader
    started = time.perf_counter()
    if leads:  # lag mode: blocks until the rollout ranks take it, which they do when their schedule needs it
        announce = torch.tensor([step, version, int(model is not None)], device=group_device(p.push))
        h.outbox.add([w for w in [dist.broadcast(announce, p.leader, group=p.push, async_op=stream)] if w])
    waited = {"pipeline/push_wait_s": time.perf_counter() - started}
    if model is None:
        return {"sync/bytes": 0.0, "sync/full_bytes": 0.0, "sync/tensors": 0.0} | waited
    state = push_state(model)  # LoRA: the adapter tensors only; the rollout ranks hold the base
    with WeightPush(model, bucket_bytes=bucket_bytes, all_ranks=True, state=state) as push:
        if leads and base is not None:
            return _push_delta(push, h, step=step, base=base) | waited
        if leads:
            h.outbox.add(
                broadcast_weights(model, push, src=p.leader, group=p.push, async_op=stream, state=state)
            )
        else:
            for _ in push:  # the gathers are collectives of the trainer ranks; only the leader sends
                pass
    if base is not None:  # what was sent is the leader's account (the ranks' mean of a key only it has)
        return {"sync/tensors": float(push.tensors)} | waited
    full = float(push.bytes)
    return {"sync/bytes": full, "sync/full_bytes": full, "sync/tensors": float(push.tensors)} | waited


def _push_delta(push: WeightPush, h: Handles, *, step: int, base: PushCopy) -> dict[str, float]:
    """The leader's delta push of `push`'s tensors against `base`, which holds them afterwards."""
    new = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in push}
    started = time.perf_counter()
    records = encode_all(new, base.tensors)
    records = h.hooks.corrupt_delta(step, records)  # test-only (RLCORE_TEST_CORRUPT_DELTA)
    encoded = time.perf_counter() - started
    sent = broadcast_delta(records, new, src=h.placement.leader, group=h.placement.push)
    base.replace(new)
    return {"sync/bytes": float(sent.bytes), "sync/full_bytes": float(sent.full_bytes),
            "sync/delta_fallbacks": float(sent.fallbacks), "sync/tensors": float(push.tensors),
            "sync/encode_s": encoded}  # fmt: skip


class Inbox:
    """A rollout rank's next push announcement, received in the background (stream mode): `arrived`
    says whether the trainer has sent one; `take` waits for it. Post the next only after the push's
    weights are in (the group's operations must run in the trainer's order)."""

    def __init__(self, h: Handles) -> None:
        self._h, self._work, self._buffer = h, None, None

    def post(self) -> None:
        self._buffer = torch.zeros(3, dtype=torch.int64, device=group_device(self._h.placement.push))
        self._work = dist.broadcast(
            self._buffer, self._h.placement.leader, group=self._h.placement.push, async_op=True
        )

    def arrived(self) -> bool:
        return self._work is not None and self._work.is_completed()

    def take(self) -> torch.Tensor:
        assert self._work is not None
        self._work.wait()
        self._work = None
        return self._buffer.cpu()


def receive_push(
    state: TrainState, h: Handles, announce: torch.Tensor | None = None, mirror: PushCopy | None = None
) -> tuple[TrainState, float]:
    """Wait for the trainer's next push (its announcement, unless already received: `announce`) and load
    its weights into the engine, as one update; the state at its step and version, without the batches
    trained by then; and the seconds waited. With `mirror` (--pipeline.push delta) the push is a delta
    against it, what this rank last received: decoded and checked whole (a full push replaces it where
    any rollout rank's checksum disagrees) before the engine loads it, and kept in it."""
    p, started = h.placement, time.perf_counter()
    if announce is None:
        announce = torch.zeros(3, dtype=torch.int64, device=group_device(p.push))
        dist.broadcast(announce, p.leader, group=p.push)
    waited = time.perf_counter() - started
    step, version, has_weights = announce.cpu().tolist()
    if has_weights and mirror is None:
        _load(h, receive_weights(src=p.leader, group=p.push))
    elif has_weights:
        tensors, _ = receive_delta(mirror.tensors, src=p.leader, group=p.push)
        mirror.replace(tensors)
        _load(h, iter(tensors.items()))
    pending = tuple(r for r in state.pending if r.step > step)
    return dataclasses.replace(state, step=step, policy_version=version, pending=pending), waited


def _load(h: Handles, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
    """One update of this rank's engine from all of `stream`."""
    if h.relay is not None:  # a LoRA policy: the adapter lands in this rank's copy, then in the engine
        h.relay.load(h.engine, stream)
    else:
        h.engine.load_weights(stream)
    if sum(1 for _ in stream):  # read the rest, so the broadcasts stay matched; then refuse
        raise RuntimeError("the engine's load_weights left tensors of the push unread")


# ---------------------------------------------------------------- validation: rollout rank 0 -> leader


def send_validation(metrics: dict[str, float], h: Handles) -> None:
    device = group_device(h.placement.val)
    text = json_tensor(metrics).to(device)
    dist.send(torch.tensor([text.numel()], device=device), h.placement.leader, group=h.placement.val)
    dist.send(text, h.placement.leader, group=h.placement.val)


def receive_validation(h: Handles) -> dict[str, float]:
    """The validation metrics rollout rank 0 measured (on the leader; {} on the other trainer ranks)."""
    if dist.get_rank() != h.placement.leader:
        return {}
    device = group_device(h.placement.val)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, 0, group=h.placement.val)
    text = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(text, 0, group=h.placement.val)
    return tensor_json(text)


# ---------------------------------------------------------------- the rollout ranks' loop


def rollout_loop(
    state: TrainState,
    h: Handles,
    algorithm: Algorithm,
    plan: StepPlan,
    validate: Callable[[int], dict[str, float]],
    save: Callable[[TrainState], None],
) -> TrainState:
    """Generate the batches the schedule allows, send them, take the trainer's pushes; validate and save
    where the trainer does. Lag mode: every allowed batch, then wait for the next push (each batch
    is generated with version max(0, t - 1 - K) exactly). Stream mode: one batch at a time, each with the
    newest weights that have arrived (still at most K versions behind), waiting only when K binds.
    `validate(step)` measures the engine's policy and `save(state)` checkpoints it; `state` is the restored
    one after a resume."""
    last = plan.schedule.steps
    inbox = Inbox(h) if plan.schedule.stream else None
    mirror = PushCopy() if plan.schedule.push == "delta" else None  # what this rank last received
    state, _ = receive_push(state, h, mirror=mirror)  # the starting (or restored) weights: a full push
    if inbox is not None and state.step < last:
        inbox.post()
    works = [w for r in state.pending for w in send_rollout(r, h, plan)]  # restored: sent before, not trained
    if state.step == 0:
        _validate(h, plan, 0, validate)
    idle = 0.0
    while True:
        if inbox is not None:
            while state.step < last and inbox.arrived():  # pushes that came while this rank generated
                state = _took(receive_push(state, h, inbox.take(), mirror)[0], h, plan, validate, save, inbox)
        steps = due(state, plan)
        if steps:
            for step in steps[:1] if inbox is not None else steps:  # stream: one batch, then new weights
                extra = {"pipeline/rollout_idle_s": idle}
                if plan.schedule.partial:
                    state, took = _generate_partial(state, h, algorithm, plan, step, extra, inbox)
                else:
                    state, took = generate(state, h, algorithm, plan, step, extra), []
                h.hooks.kill_point(step, "rollout")  # test-only fault injection (RLCORE_TEST_KILL_AT)
                works += send_rollout(state.pending[-1], h, plan)
                idle = 0.0
                for pushed in took:  # pushes taken mid-batch: validate and save now, with the batch sent
                    _took(dataclasses.replace(state, step=pushed), h, plan, validate, save, None)
            continue
        if state.step >= last:
            break
        started = time.perf_counter()
        announce = inbox.take() if inbox is not None else None  # stream: the wait is here
        state, waited = receive_push(state, h, announce, mirror)
        idle += waited + (time.perf_counter() - started if inbox is not None else 0.0)
        works = [w for w in works if not w.is_completed()]
        state = _took(state, h, plan, validate, save, inbox)
    for w in works:
        w.wait()
    return state


def _generate_partial(
    state: TrainState,
    h: Handles,
    algorithm: Algorithm,
    plan: StepPlan,
    step: int,
    extra: dict[str, float],
    inbox: Inbox,
) -> tuple[TrainState, list[int]]:
    """`generate` with every push that arrives between decode steps loaded at once (partial rollouts,
    `rlcore.step.partial.VersionTagged`): each token's `rollout_versions` is the version that
    sampled it. Returns the state (at the last push's step and version) and the steps of the pushes
    taken, whose validation and checkpoint wait for the batch (the trainer waits for them before its
    next push)."""
    now, last = {"state": state}, plan.schedule.steps

    def take() -> None:
        h.hooks.slow_decode()  # test-only (RLCORE_TEST_SLOW_DECODE_S)
        while now["state"].step < last and inbox.arrived():
            now["state"], _ = receive_push(now["state"], h, inbox.take())
            if now["state"].step < last:
                inbox.post()

    engine = tagged(h.engine, version=lambda: now["state"].policy_version, take=take)
    done = generate(state, dataclasses.replace(h, engine=engine), algorithm, plan, step, extra)
    latest = now["state"]
    pending = tuple(r for r in done.pending if r.step > latest.step)
    took = list(range(state.step + 1, latest.step + 1))
    return dataclasses.replace(
        done, step=latest.step, policy_version=latest.policy_version, pending=pending
    ), took


def _took(
    state: TrainState,
    h: Handles,
    plan: StepPlan,
    validate: Callable[[int], dict[str, float]],
    save: Callable[[TrainState], None],
    inbox: Inbox | None,
) -> TrainState:
    """After a push: validate and save where the trainer does, then listen for the next push."""
    _validate(h, plan, state.step, validate)
    if plan.schedule.save_due(state.step):
        save(state)
    if inbox is not None and state.step < plan.schedule.steps:
        inbox.post()
    return state


def _validate(h: Handles, plan: StepPlan, step: int, validate: Callable[[int], dict[str, float]]) -> None:
    if h.dist.rank == 0 and plan.schedule.val_due(step):
        send_validation(validate(step), h)


__all__ = [
    "Inbox", "push_weights", "receive_push", "receive_rollout", "receive_validation", "rollout_loop", "routes",
    "send_rollout", "send_validation",
]  # fmt: skip

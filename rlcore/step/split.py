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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rlcore.algorithm import Algorithm
from rlcore.data.prompts import pad_token_id
from rlcore.dist import push
from rlcore.dist.delta import PushCopy
from rlcore.dist.reduce import all_reduce_int, reduce_metrics
from rlcore.dist.transfer import group_device, json_tensor, recv_batch, send_batch, tensor_json
from rlcore.models.lora import push_state
from rlcore.plan import StepPlan
from rlcore.state import Rollout, TrainState
from rlcore.step.collect import due, generate
from rlcore.step.partial import tagged
from rlcore.step.steps import concat_rollouts
from rlcore.step.weights import into_engine

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
    and keeps what it pushes now in it (the other trainer ranks' `base` stays empty). The protocol:
    `rlcore.dist.push`."""
    p = h.placement
    state = push_state(model) if model is not None else None
    sent = push.send_push(model, step=step, version=version, src=p.leader, group=p.push,
                          bucket_bytes=bucket_bytes, state=state, base=base, async_op=stream,
                          corrupt=lambda records: h.hooks.corrupt_delta(step, records))  # fmt: skip
    if sent.works:  # the leader in stream mode: the sends still in flight
        h.outbox.add(list(sent.works))
    return _push_metrics(sent, leads=dist.get_rank() == p.leader)


def _push_metrics(sent: push.PushSent, *, leads: bool) -> dict[str, float]:
    waited = {"pipeline/push_wait_s": sent.announce_s}
    if not sent.note.changed:
        return {"sync/bytes": 0.0, "sync/full_bytes": 0.0, "sync/tensors": 0.0} | waited
    if sent.note.kind != "delta":
        return {"sync/bytes": float(sent.bytes), "sync/full_bytes": float(sent.full_bytes),
                "sync/tensors": float(sent.tensors)} | waited  # fmt: skip
    if not leads:  # what was sent is the leader's account (the ranks' mean of a key only it has)
        return {"sync/tensors": float(sent.tensors)} | waited
    return {"sync/bytes": float(sent.bytes), "sync/full_bytes": float(sent.full_bytes),
            "sync/delta_fallbacks": float(sent.fallbacks), "sync/tensors": float(sent.tensors),
            "sync/encode_s": sent.encode_s} | waited  # fmt: skip


class Inbox:
    """A rollout rank's next push announcement, received in the background (stream mode): `arrived`
    says whether the trainer has sent one; `take` waits for it. Post the next only after the push's
    weights are in (the group's operations must run in the trainer's order)."""

    def __init__(self, h: Handles) -> None:
        self._h, self._work, self._buffer = h, None, None

    def post(self) -> None:
        self._buffer = push.Announcement.buffer(group_device(self._h.placement.push))
        self._work = dist.broadcast(
            self._buffer, self._h.placement.leader, group=self._h.placement.push, async_op=True
        )

    def arrived(self) -> bool:
        return self._work is not None and self._work.is_completed()

    def take(self) -> push.Announcement:
        assert self._work is not None
        self._work.wait()
        self._work = None
        return push.Announcement.from_tensor(self._buffer)


def receive_push(
    state: TrainState, h: Handles, note: push.Announcement | None = None, mirror: PushCopy | None = None
) -> tuple[TrainState, float]:
    """Wait for the trainer's next push (its announcement, unless already received: `note`) and load
    its weights into the engine, as one update; the state at its step and version, without the batches
    trained by then; and the seconds waited. With `mirror` (--pipeline.push delta) the push is a delta
    against it, what this rank last received: decoded and checked whole (a full push replaces it where
    any rollout rank's checksum disagrees) before the engine loads it, and kept in it."""
    p, started = h.placement, time.perf_counter()
    if note is None:
        note = push.receive_announcement(src=p.leader, group=p.push)
    waited = time.perf_counter() - started
    push.receive_push(note, into_engine(h.engine, h.relay), src=p.leader, group=p.push, mirror=mirror)
    pending = tuple(r for r in state.pending if r.step > note.step)
    return dataclasses.replace(state, step=note.step, policy_version=note.version, pending=pending), waited


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

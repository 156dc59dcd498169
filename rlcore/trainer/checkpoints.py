"""Run checkpoints: model + optimizer (DCP, sharded) and the loop's own state, resumable exactly.

Layout: out_dir/checkpoints/step_<N>/ (complete) — a save writes step_<N>.tmp/ first and renames it
only when everything is on disk, so a crash mid-save leaves the previous checkpoint as the newest.
The TrainState's other fields (step, scheduler, data cursor, KL coefficient, bad-update count, update
count, policy version) are JSON; the DCP files
are read with an allow-list unpickler and `weights_only=True` (`rlcore.dist.safe_dcp`): no code runs.

Under split placement one checkpoint holds both roles: the trainer ranks' model and optimizer (DCP
over them) and JSON, and each rollout rank's batches sent but not trained plus the data cursor (its
`tensors_rank<r>.pt`); it resumes only under the same placement and number of rollout ranks.

A save is not cut short by Ctrl-C or a preemption signal: they take effect once it is complete
(`signals.deferred`), so an interrupt is never mistaken for a disk error. A save that cannot write
(disk full, directory not writable) and a checkpoint that cannot be resumed
from end the run with one `error:` line and exit code 2; a failed save removes its `.tmp` directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.dist.transfer import json_tensor, tensor_json
from rlcore.state import Health, TrainState, rollouts_from_tensors, rollouts_to_tensors
from rlcore.trainer import signals
from rlcore.trainer.errors import StopRun, reason

if TYPE_CHECKING:
    from rlcore.step.handles import Handles

LOAD_ERRORS = (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError)
"""What loading an unusable checkpoint raises (besides DCP's CheckpointException)."""


def _extra(state: TrainState, h: Handles) -> dict[str, Any]:
    """The JSON part of a checkpoint: every TrainState field that is not a tensor (under split placement
    the cursor and the batches generated ahead are the rollout ranks', in their tensor files)."""
    return {
        "step": state.step,
        "scheduler": state.actor.scheduler.state_dict(),
        "kl_coef": state.kl_coef,
        "bad_updates": state.actor.bad_updates,  # a resumed run keeps counting towards --trainer.max-bad-updates
        "actor_updates": state.actor.step,
        "policy_version": state.policy_version,
        "placement": _placement(h),
        "base": h.model_base,
        "health": state.health.to_json(),
        **({} if h.placement.split else _generator_extra(state, h)),
    }


def _generator_extra(state: TrainState, h: Handles) -> dict[str, Any]:
    """What a rank that generates keeps: the data cursor and the steps of its batches generated ahead."""
    return {"data": h.train_ds.cursor_state(state.cursor), "pending_steps": [r.step for r in state.pending]}


def _placement(h: Handles) -> dict[str, Any]:
    """What a resume must match: colocated checkpoints load at any world size; split ones need the same
    rollout ranks (each saved its own batches generated ahead; the trainer ranks may change)."""
    if not h.placement.split:
        return {"placement": "colocate"}
    return {"placement": "split", "rollout_ranks": len(h.placement.rollout_ranks)}


def save(state: TrainState, h: Handles, *, keep_last: int) -> None:
    """checkpoints/step_<state.step>: the TrainState (models and optimizers by DCP, the rest JSON); only
    the newest `keep_last` are kept (0: all)."""
    from rlcore.dist.checkpoint import prune

    root, step = h.out_dir / "checkpoints", state.step
    with signals.deferred(second_sigint=lambda: _abandon(root, step, h.placement.writes)):
        _save(state, h, root, step)
        if h.placement.writes:
            prune(root, keep_last)
            if state.critic is not None:
                prune(root / "critic", keep_last)


def _save(state: TrainState, h: Handles, root: Path, step: int) -> None:
    """`_write`, its errors turned into one StopRun line (the partial `.tmp` directories removed)."""
    try:
        _write(state, h, root)
    except ValueError as e:  # lag mode: a batch generated ahead that JSON cannot carry
        raise StopRun(
            f"cannot write checkpoint {root / f'step_{step}'}: {e}; in lag mode (--pipeline.max-staleness) the "
            "rows' ground_truth / extra_info must be JSON values (strings, numbers, lists, objects)"
        ) from None
    except (OSError, RuntimeError, _checkpoint_exception()) as e:
        for tmp in (root / f"step_{step}.tmp", root / "critic" / f"step_{step}.tmp"):
            shutil.rmtree(tmp, ignore_errors=True)
        raise StopRun(
            f"cannot write checkpoint {root / f'step_{step}'} ({reason(e)}; {_free_space(root)}). "
            f"The previous checkpoint ({newest(root)}) is intact: free disk space or make {root} writable "
            "(or use another --out-dir), then rerun with --resume auto"
        ) from None


def _abandon(root: Path, step: int, writes: bool) -> None:
    """A second Ctrl-C during a checkpoint write: drop the partial step and exit at once."""
    if writes:
        discard_partial(root)
    print(f"interrupted again while writing checkpoint step_{step}; stopped at once, the newest checkpoint is "
          f"{newest(root)}; continue with --resume auto", file=sys.stderr, flush=True)  # fmt: skip
    os._exit(signals.EXIT_INTERRUPTED)


def _write(state: TrainState, h: Handles, root: Path) -> None:
    from rlcore.dist.checkpoint import save_checkpoint

    step, critic, trainers = state.step, state.critic, h.placement.trainers
    if not h.placement.trains:  # a rollout rank: its batches sent but not trained, and the cursor
        own = {"rollout/json": json_tensor(_generator_extra(state, h))}
        tensors = rollouts_to_tensors(state.pending) | own
        save_checkpoint(root, step, None, None, tensors=tensors, dcp_group=trainers,
                        before_commit=lambda: h.hooks.before_commit(step))  # fmt: skip
        return
    if critic is not None:  # saved first, by the trainer ranks: an actor checkpoint at N implies the critic's
        save_checkpoint(root / "critic", step, critic.model, critic.optimizer, group=trainers,
                        extra={"scheduler": critic.scheduler.state_dict(), "updates": critic.step},
                        during_write=lambda: h.hooks.in_save(step, "critic"))  # fmt: skip
    save_checkpoint(
        root,
        step,
        state.actor.model,
        state.actor.optimizer,
        extra=_extra(state, h),
        tensors=rollouts_to_tensors(state.pending),
        before_commit=lambda: h.hooks.before_commit(step),
        during_write=lambda: h.hooks.in_save(step, "policy"),
        dcp_group=trainers,
    )


def _agreed_latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, the same on every rank (a collective): each rank lists
    the directory itself, so ranks on nodes that do not share `--out-dir` (or see a stale listing of a
    network filesystem) would load different steps; they stop with one line instead."""
    from rlcore.dist.checkpoint import latest_checkpoint
    from rlcore.dist.reduce import world_max

    path = latest_checkpoint(root)
    step = int(path.name.removeprefix("step_")) if path is not None else -1
    newest, oldest = world_max([step, -step])
    if newest != -oldest:
        raise StopRun(
            f"--resume auto: the ranks see different newest checkpoints in {root.name}/ (step {newest} on some, "
            f"{-oldest} on others; -1: none): --out-dir must be one directory every node shares (a network "
            "filesystem), not a path on each node's local disk"
        )
    return path


def resume(state: TrainState, h: Handles, spec: str) -> TrainState:
    """The TrainState of the checkpoint `spec` (--resume) names (auto: the newest complete one; none), or
    `state` for a fresh start (whose stale metrics records, if any, are dropped)."""
    from rlcore.dist.checkpoint import COMPLETE

    path = None
    if spec != "none":
        path = _agreed_latest(h.out_dir / "checkpoints") if spec == "auto" else Path(spec)
    if path is None:  # a fresh start: records of an earlier attempt in this directory are stale
        if h.placement.writes:
            _truncate_metrics(h.out_dir / "metrics.jsonl", -1)
        return state
    if not path.is_dir():
        raise StopRun(
            f"--resume {spec}: no checkpoint at {path}; use auto, none, or a checkpoints/step_<N> directory"
        )
    if not (path / COMPLETE).is_file():
        raise StopRun(
            f"--resume {spec}: {path} is not a complete checkpoint (no {COMPLETE} file); give a "
            "checkpoints/step_<N> directory written by a finished save, or auto, or none"
        )
    _check_placement(path, h, spec)
    _check_base(path, h, spec)
    try:
        state = _load(state, h, path) if h.placement.trains else _load_rollout(state, h, path)
    except (*LOAD_ERRORS, _checkpoint_exception()) as e:
        raise StopRun(
            f"--resume {spec}: checkpoint {path} cannot be loaded ({reason(e)}); it was written by another "
            "model/data setup or is damaged: delete it to resume from the one before, or use --resume none"
        ) from None
    if h.placement.writes:
        _truncate_metrics(h.out_dir / "metrics.jsonl", state.step)
    return state


def _check_placement(path: Path, h: Handles, spec: str) -> None:
    """Refuse, on every rank alike (before any collective), a checkpoint of another placement."""
    extra = path / "extra.json"
    saved = json.loads(extra.read_text()).get("placement") if extra.is_file() else None
    if saved is not None and saved != _placement(h):
        said = ", ".join(f"{k} {v}" for k, v in saved.items())
        raise StopRun(
            f"--resume {spec}: {path} was saved with {said}; resume it with the same --pipeline.placement "
            "and --pipeline.rollout-ranks (or use --resume none)"
        )


def _check_base(path: Path, h: Handles, spec: str) -> None:
    """Refuse a checkpoint whose adapters were trained on another base model or with another LoRA shape
    (checkpoints without the record, from before LoRA, are full-weight ones: nothing to check)."""
    extra = path / "extra.json"
    saved = json.loads(extra.read_text()).get("base") if extra.is_file() else None
    if saved is not None and saved != h.model_base:
        said = ", ".join(f"{k} {saved[k]}" for k in h.model_base if k in saved)
        raise StopRun(
            f"--resume {spec}: {path} holds a model trained with {said}; resume it with the same --model.path "
            "and --model.lora-* flags (or use --resume none)"
        )


def _load(state: TrainState, h: Handles, path: Path) -> TrainState:
    from rlcore.dist.checkpoint import load_checkpoint

    trainers = h.placement.trainers
    extra, tensors = load_checkpoint(path, state.actor.model, state.actor.optimizer, dcp_group=trainers)
    pending = rollouts_from_tensors(tensors)
    if [r.step for r in pending] != extra.get("pending_steps", []):
        raise ValueError(
            f"this rank holds the batches of steps {[r.step for r in pending]} generated ahead, the checkpoint "
            f"lists {extra.get('pending_steps')}: resume lag mode with the world size it was saved with"
        )
    state.actor.scheduler.load_state_dict(extra["scheduler"])
    critic = state.critic
    if critic is not None:
        critic_extra, _ = load_checkpoint(path.parent / "critic" / path.name, critic.model, critic.optimizer,
                                          dcp_group=trainers)  # fmt: skip
        critic.scheduler.load_state_dict(critic_extra["scheduler"])
        critic = dataclasses.replace(critic, step=critic_extra.get("updates", extra["step"]))
    step = int(extra["step"])
    actor = dataclasses.replace(
        state.actor, step=extra.get("actor_updates", step), bad_updates=extra.get("bad_updates", 0)
    )
    cursor = h.train_ds.cursor_from_state(extra["data"]) if "data" in extra else state.cursor
    return dataclasses.replace(
        state, actor=actor, critic=critic, step=step, kl_coef=float(extra["kl_coef"]), cursor=cursor,
        policy_version=extra.get("policy_version", step), pending=pending,
        health=Health.from_json(extra["health"]) if "health" in extra else Health(),
    )  # fmt: skip


def _load_rollout(state: TrainState, h: Handles, path: Path) -> TrainState:
    """A rollout rank's part of a split checkpoint: the cursor and the batches it had sent untrained."""
    from rlcore.dist.checkpoint import load_checkpoint

    extra, tensors = load_checkpoint(path, None, None)
    if "rollout/json" not in tensors:
        raise ValueError(f"no rollout state for rank {h.placement.rollout_ranks[h.dist.rank]} in it")
    own, pending = tensor_json(tensors["rollout/json"]), rollouts_from_tensors(tensors)
    if [r.step for r in pending] != own["pending_steps"]:
        raise ValueError(
            f"its batches of steps {[r.step for r in pending]} do not match {own['pending_steps']}"
        )
    return dataclasses.replace(state, step=int(extra["step"]), policy_version=extra["policy_version"],
                               cursor=h.train_ds.cursor_from_state(own["data"]), pending=pending)  # fmt: skip


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records after `step` (written by a run that died before its next checkpoint)."""
    if not path.exists():
        return
    import orjson

    from rlcore.trainer.logger import read_metrics

    kept = [r for r in read_metrics(path) if r["step"] <= step]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in kept))


# ---------------------------------------------------------------- errors


def _checkpoint_exception() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _free_space(root: Path) -> str:
    where = next((d for d in (root, *root.parents) if d.exists()), Path("/"))
    return f"{shutil.disk_usage(where).free / 2**20:.0f} MB free on that disk"


def discard_partial(root: Path) -> None:
    """Remove what a save stopped midway left (`step_<N>.tmp`, the critic's too): never a checkpoint."""
    for tmp in [*root.glob("step_*.tmp"), *root.glob("critic/step_*.tmp")]:
        shutil.rmtree(tmp, ignore_errors=True)


def newest(root: Path) -> str:
    from rlcore.dist.checkpoint import latest_checkpoint

    newest = latest_checkpoint(root)
    return newest.name if newest is not None else "none yet"

"""Run checkpoints: model + optimizer (DCP, sharded) and the loop's own state, resumable exactly.

Layout: out_dir/checkpoints/step_<N>/ (complete) — a save writes step_<N>.tmp/ first and renames it
only when everything is on disk, so a crash mid-save leaves the previous checkpoint as the newest.
The TrainState's other fields (step, scheduler, data cursor, KL coefficient, bad-update count, update
count, policy version) are JSON; the DCP files
are read with an allow-list unpickler and `weights_only=True` (`rlcore.dist.safe_dcp`): no code runs.

A save that cannot write (disk full, directory not writable) and a checkpoint that cannot be resumed
from end the run with one `error:` line and exit code 2; a failed save removes its `.tmp` directory.
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
from pathlib import Path
from typing import Any

from rlcore.state import TrainState, rollouts_from_tensors, rollouts_to_tensors
from rlcore.trainer import faults
from rlcore.trainer.errors import StopRun, reason

LOAD_ERRORS = (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError)
"""What loading an unusable checkpoint raises (besides DCP's CheckpointException)."""


def _extra(state: TrainState, h: Any) -> dict[str, Any]:
    """The JSON part of a checkpoint: every TrainState field that is not a tensor."""
    return {
        "step": state.step,
        "scheduler": state.actor.scheduler.state_dict(),
        "data": h.train_ds.cursor_state(state.cursor),
        "kl_coef": state.kl_coef,
        "bad_updates": state.actor.bad_updates,  # a resumed run keeps counting towards --trainer.max-bad-updates
        "actor_updates": state.actor.step,
        "policy_version": state.policy_version,
        "pending_steps": [r.step for r in state.pending],  # batches generated ahead (lag mode), per rank
    }


def save(state: TrainState, h: Any) -> None:
    """checkpoints/step_<state.step>: the TrainState (models and optimizers by DCP, the rest JSON)."""
    from rlcore.dist.checkpoint import prune

    root, step = h.out_dir / "checkpoints", state.step
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
            f"The previous checkpoint ({_newest(root)}) is intact: free disk space or make {root} writable "
            "(or use another --out-dir), then rerun with --resume auto"
        ) from None
    if h.dist.rank == 0:
        prune(root, h.cfg.trainer.keep_last)
        if state.critic is not None:
            prune(root / "critic", h.cfg.trainer.keep_last)


def _write(state: TrainState, h: Any, root: Path) -> None:
    from rlcore.dist.checkpoint import save_checkpoint

    step, critic = state.step, state.critic
    if critic is not None:  # saved first: an actor checkpoint at step N implies the critic's
        save_checkpoint(root / "critic", step, critic.model, critic.optimizer,
                        extra={"scheduler": critic.scheduler.state_dict(), "updates": critic.step})  # fmt: skip
    save_checkpoint(
        root,
        step,
        state.actor.model,
        state.actor.optimizer,
        extra=_extra(state, h),
        tensors=rollouts_to_tensors(state.pending),
        before_commit=lambda: faults.before_commit(step),
    )


def resume(state: TrainState, h: Any) -> TrainState:
    """The TrainState of the checkpoint --resume names (auto: the newest complete one), or `state` for
    a fresh start (whose stale metrics records, if any, are dropped)."""
    from rlcore.dist.checkpoint import COMPLETE, latest_checkpoint

    spec = h.cfg.resume
    path = None
    if spec != "none":
        path = latest_checkpoint(h.out_dir / "checkpoints") if spec == "auto" else Path(spec)
    if path is None:  # a fresh start: records of an earlier attempt in this directory are stale
        if h.dist.rank == 0:
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
    try:
        state = _load(state, h, path)
    except (*LOAD_ERRORS, _checkpoint_exception()) as e:
        raise StopRun(
            f"--resume {spec}: checkpoint {path} cannot be loaded ({reason(e)}); it was written by another "
            "model/data setup or is damaged: delete it to resume from the one before, or use --resume none"
        ) from None
    if h.dist.rank == 0:
        _truncate_metrics(h.out_dir / "metrics.jsonl", state.step)
    return state


def _load(state: TrainState, h: Any, path: Path) -> TrainState:
    from rlcore.dist.checkpoint import load_checkpoint

    extra, tensors = load_checkpoint(path, state.actor.model, state.actor.optimizer)
    pending = rollouts_from_tensors(tensors)
    if [r.step for r in pending] != extra.get("pending_steps", []):
        raise ValueError(
            f"this rank holds the batches of steps {[r.step for r in pending]} generated ahead, the checkpoint "
            f"lists {extra.get('pending_steps')}: resume lag mode with the world size it was saved with"
        )
    state.actor.scheduler.load_state_dict(extra["scheduler"])
    critic = state.critic
    if critic is not None:
        critic_extra, _ = load_checkpoint(path.parent / "critic" / path.name, critic.model, critic.optimizer)
        critic.scheduler.load_state_dict(critic_extra["scheduler"])
        critic = dataclasses.replace(critic, step=critic_extra.get("updates", extra["step"]))
    step = int(extra["step"])
    actor = dataclasses.replace(
        state.actor, step=extra.get("actor_updates", step), bad_updates=extra.get("bad_updates", 0)
    )
    return dataclasses.replace(
        state, actor=actor, critic=critic, step=step, kl_coef=float(extra["kl_coef"]),
        cursor=h.train_ds.cursor_from_state(extra["data"]), policy_version=extra.get("policy_version", step),
        pending=pending,
    )  # fmt: skip


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


def _newest(root: Path) -> str:
    from rlcore.dist.checkpoint import latest_checkpoint

    newest = latest_checkpoint(root)
    return newest.name if newest is not None else "none yet"

"""Run checkpoints: model + optimizer (DCP, sharded) and the loop's own state, resumable exactly.

Layout: out_dir/checkpoints/step_<N>/ (complete) — a save writes step_<N>.tmp/ first and renames it
only when everything is on disk, so a crash mid-save leaves the previous checkpoint as the newest.
The loop state (step, scheduler, data cursor, KL coefficient, bad-update count) is JSON; the DCP files
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

from rlcore.trainer import faults
from rlcore.trainer.errors import StopRun, reason

LOAD_ERRORS = (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError)
"""What loading an unusable checkpoint raises (besides DCP's CheckpointException)."""


def _extra(p: Any, step: int) -> dict[str, Any]:
    return {
        "step": step,
        "scheduler": p.state.scheduler.state_dict(),
        "data": p.train_ds.state_dict(),
        "kl_coef": p.kl_coef,
        "bad_updates": p.state.bad_updates,  # a resumed run keeps counting towards --trainer.max-bad-updates
    }


def save(p: Any, step: int) -> None:
    from rlcore.dist.checkpoint import prune

    root = p.out_dir / "checkpoints"
    try:
        _write(p, root, step)
    except (OSError, RuntimeError, _checkpoint_exception()) as e:
        for tmp in (root / f"step_{step}.tmp", root / "critic" / f"step_{step}.tmp"):
            shutil.rmtree(tmp, ignore_errors=True)
        raise StopRun(
            f"cannot write checkpoint {root / f'step_{step}'} ({reason(e)}; {_free_space(root)}). "
            f"The previous checkpoint ({_newest(root)}) is intact: free disk space or make {root} writable "
            "(or use another --out-dir), then rerun with --resume auto"
        ) from None
    if p.dist.rank == 0:
        prune(root, p.cfg.trainer.keep_last)
        if p.critic is not None:
            prune(root / "critic", p.cfg.trainer.keep_last)


def _write(p: Any, root: Path, step: int) -> None:
    from rlcore.dist.checkpoint import save_checkpoint

    if p.critic is not None:  # saved first: an actor checkpoint at step N implies the critic's
        save_checkpoint(root / "critic", step, p.critic.model, p.critic.optimizer,
                        extra={"scheduler": p.critic.scheduler.state_dict()})  # fmt: skip
    save_checkpoint(
        root,
        step,
        p.state.model,
        p.state.optimizer,
        extra=_extra(p, step),
        before_commit=lambda: faults.before_commit(step),
    )


def maybe_resume(p: Any) -> int:
    """Load the checkpoint --resume names (auto: the newest complete one, if any); return its step."""
    from rlcore.dist.checkpoint import COMPLETE, latest_checkpoint

    resume = p.cfg.resume
    path = None
    if resume != "none":
        path = latest_checkpoint(p.out_dir / "checkpoints") if resume == "auto" else Path(resume)
    if path is None:  # a fresh start: records of an earlier attempt in this directory are stale
        if p.dist.rank == 0:
            _truncate_metrics(p.out_dir / "metrics.jsonl", -1)
        return 0
    if not path.is_dir():
        raise StopRun(
            f"--resume {resume}: no checkpoint at {path}; use auto, none, or a checkpoints/step_<N> directory"
        )
    if not (path / COMPLETE).is_file():
        raise StopRun(
            f"--resume {resume}: {path} is not a complete checkpoint (no {COMPLETE} file); give a "
            "checkpoints/step_<N> directory written by a finished save, or auto, or none"
        )
    try:
        extra = _load(p, path)
    except (*LOAD_ERRORS, _checkpoint_exception()) as e:
        raise StopRun(
            f"--resume {resume}: checkpoint {path} cannot be loaded ({reason(e)}); it was written by another "
            "model/data setup or is damaged: delete it to resume from the one before, or use --resume none"
        ) from None
    if p.dist.rank == 0:
        _truncate_metrics(p.out_dir / "metrics.jsonl", extra["step"])
    return int(extra["step"])


def _load(p: Any, path: Path) -> dict[str, Any]:
    from rlcore.dist.checkpoint import load_checkpoint

    extra, _ = load_checkpoint(path, p.state.model, p.state.optimizer)
    p.state.scheduler.load_state_dict(extra["scheduler"])
    if p.critic is not None:
        critic_extra, _ = load_checkpoint(
            path.parent / "critic" / path.name, p.critic.model, p.critic.optimizer
        )
        p.critic.scheduler.load_state_dict(critic_extra["scheduler"])
    p.train_ds.load_state_dict(extra["data"])
    p.kl_coef = extra["kl_coef"]
    p.state = dataclasses.replace(
        p.state, step=extra["step"], kl_coef=p.kl_coef, bad_updates=extra.get("bad_updates", 0)
    )
    return extra


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

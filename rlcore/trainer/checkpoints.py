"""Run checkpoints: model + optimizer (DCP, sharded) and the loop's own state, resumable exactly.

Layout: out_dir/checkpoints/step_<N>/ (complete) — a save writes step_<N>.tmp/ first and renames it
only when everything is on disk, so a crash mid-save leaves the previous checkpoint as the newest.
The loop state (step, scheduler, data cursor, KL coefficient) is JSON; nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from configs import ConfigError


def _extra(p: Any, step: int) -> dict[str, Any]:
    return {
        "step": step,
        "scheduler": p.state.scheduler.state_dict(),
        "data": p.train_ds.state_dict(),
        "kl_coef": p.kl_coef,
    }


def save(p: Any, step: int) -> None:
    from rlcore.dist.checkpoint import prune, save_checkpoint

    root = p.out_dir / "checkpoints"
    if p.critic is not None:  # saved first: an actor checkpoint at step N implies the critic's
        save_checkpoint(root / "critic", step, p.critic.model, p.critic.optimizer,
                        extra={"scheduler": p.critic.scheduler.state_dict()})  # fmt: skip
    pause = os.environ.get("RLCORE_TEST_PAUSE_IN_SAVE")  # fault injection for the tests: seconds to stall
    save_checkpoint(
        root,
        step,
        p.state.model,
        p.state.optimizer,
        extra=_extra(p, step),
        before_commit=(lambda: time.sleep(float(pause))) if pause else None,
    )
    if p.dist.rank == 0:
        prune(root, p.cfg.trainer.keep_last)
        if p.critic is not None:
            prune(root / "critic", p.cfg.trainer.keep_last)


def maybe_resume(p: Any) -> int:
    """Load the checkpoint --resume names (auto: the newest complete one, if any); return its step."""
    from rlcore.dist.checkpoint import latest_checkpoint, load_checkpoint

    resume = p.cfg.resume
    path = None
    if resume != "none":
        path = latest_checkpoint(p.out_dir / "checkpoints") if resume == "auto" else Path(resume)
    if path is None:  # a fresh start: records of an earlier attempt in this directory are stale
        if p.dist.rank == 0:
            _truncate_metrics(p.out_dir / "metrics.jsonl", -1)
        return 0
    if not path.is_dir():
        raise ConfigError(f"--resume {resume}: no checkpoint at {path}")
    extra, _ = load_checkpoint(path, p.state.model, p.state.optimizer)
    p.state.scheduler.load_state_dict(extra["scheduler"])
    if p.critic is not None:
        critic_extra, _ = load_checkpoint(
            path.parent / "critic" / path.name, p.critic.model, p.critic.optimizer
        )
        p.critic.scheduler.load_state_dict(critic_extra["scheduler"])
    p.train_ds.load_state_dict(extra["data"])
    p.kl_coef = extra["kl_coef"]
    p.state = dataclasses.replace(p.state, step=extra["step"], kl_coef=p.kl_coef)
    if p.dist.rank == 0:
        _truncate_metrics(p.out_dir / "metrics.jsonl", extra["step"])
    return int(extra["step"])


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records after `step` (written by a run that died before its next checkpoint)."""
    if not path.exists():
        return
    import orjson

    from rlcore.trainer.logger import read_metrics

    kept = [r for r in read_metrics(path) if r["step"] <= step]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in kept))

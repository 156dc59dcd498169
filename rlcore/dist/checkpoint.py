"""Resumable checkpoints: sharded model + optimizer with torch.distributed.checkpoint (DCP), plus extras.

    path = save_checkpoint(run / "checkpoints", step, model, optimizer,
                           extra={"step": step, "scheduler": sched.state_dict(), "cursor": cursor},
                           tensors=rng_state())
    prune(run / "checkpoints", keep_last=2)
    path = latest_checkpoint(run / "checkpoints")          # newest COMPLETE one, or None
    extra, tensors = load_checkpoint(path, model, optimizer); set_rng_state(tensors)

Layout of `step_<N>/`: `dcp/` (every rank's shards of the model and optimizer state, loadable at any
world size, one process included), `extra.json` (the JSON-able extras, written by rank 0),
`tensors_rank<r>.pt` (each rank's tensors, e.g. RNG states: a flat dict of tensors saved with
`torch.save`, loaded with `weights_only=True`: no pickled code), and `COMPLETE`. The DCP files are read
through `rlcore.dist.safe_dcp` (an allow-list unpickler for DCP's index, `weights_only` for its values).
Atomicity: everything is written into `step_<N>.tmp/`; after every rank is done, rank 0 writes
`COMPLETE` and renames the directory to `step_<N>/` (the first rank of `group`, where one is given). A crash leaves at most a `.tmp` directory,
which `latest_checkpoint` ignores and `prune` removes. The ranks agree after each phase (prepare,
write, commit): an error on one rank raises on all of them, so none waits for a rank that gave up.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

from rlcore.dist import safe_dcp
from rlcore.dist.mesh import group_rank

_STEP = re.compile(r"^step_(\d+)$")
COMPLETE = "COMPLETE"


TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)
"""A model saved with its optimizer keeps its trained parameters only (a LoRA model: the adapters; the
frozen base is the base model's files, checked on resume by identity). Loading is not strict about the
frozen ones left out; DCP itself refuses a checkpoint that lacks a trained one."""


def _trained(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` without a frozen parameter that `ignore_frozen_params` keeps under a tied name (a LoRA
    model's lm_head, tied to its frozen embedding)."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}


def _no_dist() -> bool:
    """One process without a process group: DCP then reads/writes everything itself."""
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet_single_process():
    """Silence DCP's 'assuming the intent is to load in a single process' when that is the intent."""
    with warnings.catch_warnings():
        if _no_dist():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


def _together(phase: Callable[[], None], group: Any = None) -> None:
    """Run `phase` on this rank, then wait for every rank of `group` (default: all) and agree on failure
    (a barrier that carries errors): if `phase` raised anywhere, every rank raises, the failing one its
    own error and the others an OSError naming it. Without it, a rank that fails alone (its disk full)
    would leave the others waiting at the next collective forever."""
    error: Exception | None = None
    try:
        phase()
    except Exception as e:  # re-raised below, after the ranks have agreed
        error = e
    if dist.is_available() and dist.is_initialized():
        said: list[tuple[int | None, str] | None] = [None] * dist.get_world_size(group)
        mine = None
        if error is not None:
            code = getattr(error, "errno", None)
            mine = (code, error.strerror) if code else (None, f"{type(error).__name__}: {error}")
        dist.all_gather_object(said, mine, group=group)
        ranks = dist.get_process_group_ranks(group) if group is not None else range(len(said))
        failed = [(r, m) for r, m in zip(ranks, said, strict=True) if m is not None]
        if error is None and failed:
            rank, (code, message) = failed[0]
            raise OSError(code, f"{message} (on rank {rank})") if code else OSError(f"rank {rank}: {message}")
    if error is not None:
        raise error


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer that runs `during_write` once this rank's shard files are written, still inside
    DCP's save (which turns anything raised there, KeyboardInterrupt included, into its own exception)."""

    def __init__(self, path: Path, during_write: Callable[[], None]) -> None:
        super().__init__(path)
        self._during_write = during_write

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        self._during_write()
        return written


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    model: nn.Module | None,
    optimizer: Optimizer | None,
    *,
    extra: Mapping[str, Any] | None = None,
    tensors: Mapping[str, Tensor] | None = None,
    before_commit: Callable[[], None] | None = None,
    during_write: Callable[[], None] | None = None,
    group: Any = None,
    dcp_group: Any = None,
) -> Path:
    """Write `directory/step_<step>/` atomically (every rank of `group` calls this) and return its path.

    `extra` must be JSON-able (step, scheduler state, data cursor, ...); the first rank of `dcp_group`
    writes it. `tensors` is this rank's flat dict of tensors (e.g. `rng_state()`). An existing
    `step_<step>/` is replaced. `before_commit` runs on every rank with its files written to
    `step_<step>.tmp/`, before the ranks agree to commit (fault-injection tests kill the process or fail
    the save there); `during_write` runs on every rank inside DCP's save, once that rank's shard files
    are written and before DCP writes its index (fault-injection tests land an interrupt there).

    `group` (default: every rank) takes part and agrees; its first rank creates and commits the
    directory. `dcp_group` (default: `group`) holds `model` and `optimizer` (the ranks they are sharded
    over); a rank outside it passes `model=None` and contributes only its `tensors` (split placement:
    the rollout ranks' batches generated ahead, beside the trainer ranks' model).
    """
    root = Path(directory)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    dcp_group = group if dcp_group is None else dcp_group
    text = json.dumps(dict(extra or {}), indent=1, sort_keys=True)  # fail early, on every rank
    leads = group_rank(group) == 0

    def prepare() -> None:
        if leads:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

    def write() -> None:
        if model is not None:
            with _quiet_single_process():
                if optimizer is None:
                    state = {"model": get_model_state_dict(model)}
                else:
                    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED)
                    state = {"model": _trained(model, model_sd), "optim": optim_sd}
                writer = _Writer(tmp / "dcp", during_write or (lambda: None))
                dcp.save(state, storage_writer=writer, process_group=dcp_group, no_dist=_no_dist())
            if group_rank(dcp_group) == 0:
                (tmp / "extra.json").write_text(text)
        if tensors:
            torch.save({k: v.detach().cpu() for k, v in tensors.items()}, tmp / f"tensors_rank{group_rank()}.pt")
        if before_commit is not None:
            before_commit()

    def commit() -> None:
        if leads:
            with open(tmp / COMPLETE, "w") as f:
                f.write(json.dumps({"step": step}))
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync_dir(root)

    for phase in (prepare, write, commit):
        _together(phase, group)
    return final


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module | None, optimizer: Optimizer | None, *, dcp_group: Any = None
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Load a complete checkpoint into `model` (and `optimizer`) in place; (extra, this rank's tensors).

    The model and optimizer may be sharded differently from when they were saved (any world size);
    every rank of `dcp_group` (default: all) loads them together, a rank with `model=None` only reads
    the extras and its tensors. Tensors saved by a rank that no longer exists are not returned.
    """
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise ValueError(f"checkpoint {str(path)!r} is not a complete checkpoint (no {COMPLETE} file)")
    if model is not None:
        _load_model(path, model, optimizer, dcp_group)
    extra = json.loads((path / "extra.json").read_text()) if (path / "extra.json").is_file() else {}
    rank_file = path / f"tensors_rank{group_rank()}.pt"
    tensors = torch.load(rank_file, weights_only=True) if rank_file.is_file() else {}
    return extra, tensors


def _load_model(path: Path, model: nn.Module, optimizer: Optimizer | None, group: Any) -> None:
    with _quiet_single_process():
        if optimizer is None:
            state = {"model": get_model_state_dict(model)}
            safe_dcp.load(state, path / "dcp", no_dist=_no_dist(), process_group=group)
            set_model_state_dict(model, state["model"])
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED)
            state = {"model": _trained(model, model_sd), "optim": optim_sd}
            safe_dcp.load(state, path / "dcp", no_dist=_no_dist(), process_group=group)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=TRAINED)  # fmt: skip


def _steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete `step_<N>/` under `directory` (ignores `.tmp` and incomplete ones), or None."""
    complete = [p for _, p in _steps(Path(directory)) if (p / COMPLETE).is_file()]
    return complete[-1] if complete else None


def prune(directory: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints and any leftover `.tmp` (rank 0 only).

    Returns the deleted paths (empty on other ranks). `keep_last <= 0` keeps everything.
    """
    root = Path(directory)
    if group_rank() != 0 or keep_last <= 0 or not root.is_dir():
        return []
    complete = [p for _, p in _steps(root) if (p / COMPLETE).is_file()]
    doomed = complete[:-keep_last]
    doomed += [
        p for p in root.iterdir() if p.is_dir() and p.name.endswith(".tmp") and _STEP.match(p.name[:-4])
    ]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def rng_state() -> dict[str, Tensor]:
    """This process's torch RNG states as tensors (CPU, and every CUDA device when present)."""
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            state[f"torch_cuda_{i}"] = s
    return state


def set_rng_state(state: Mapping[str, Tensor]) -> None:
    """Restore what `rng_state` returned (keys that are absent are left alone)."""
    if "torch_cpu" in state:
        torch.set_rng_state(state["torch_cpu"])
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"torch_cuda_{i}" in state:
                torch.cuda.set_rng_state(state[f"torch_cuda_{i}"], i)

"""The server's operations as values, and the one worker that runs them.

Rank 0 serves HTTP; its worker thread takes the operations in arrival order (the SDK sends a training
client's requests in seq_id order, each after the last was accepted) and runs them one at a time. Under
torchrun it first broadcasts each training operation, and every other rank runs the same one (`follow`),
so FSDP's collectives meet. Sampling runs on rank 0 alone (its engine holds an unsharded copy). An idle
worker broadcasts a no-op every `PING_S` seconds, so the other ranks' waits never reach the process group's
timeout.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rlcore.dist.memory import give_back
from rlcore.rollout.worker import after_last, gather
from rlcore.tinker import split
from rlcore.tinker.errors import UserError
from rlcore.tinker.futures import Futures, Result
from rlcore.tinker.limits import Deadline, check_models
from rlcore.tinker.model import ServeOptions, TrainedModel, state_extra
from rlcore.tinker.names import checked, under
from rlcore.tinker.sampling import SampleOp, run_samples
from rlcore.tinker.wire import ForwardBackward, encode_forward_backward

log = logging.getLogger("rlcore.tinker")
PING_S = 30.0
LINGER_S = 0.01
"""How long the worker waits for more sample requests after each one before it starts a `generate` (the SDK
sends a batch of them together; `rlcore.rollout.worker.gather`)."""


@dataclasses.dataclass(frozen=True)
class CreateModel:
    model_id: str
    base_model: str
    lora_rank: int


@dataclasses.dataclass(frozen=True)
class FwdBwd:
    request: ForwardBackward


@dataclasses.dataclass(frozen=True)
class OptimStep:
    model_id: str
    adam: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class SaveState:
    model_id: str
    name: str


@dataclasses.dataclass(frozen=True)
class LoadState:
    model_id: str
    path: str
    """tinker://<model>/weights/<name>"""
    optimizer: bool
    create: bool
    """Create `model_id` from the state first (`create_training_client_from_state`)."""


@dataclasses.dataclass(frozen=True)
class SaveForSampler:
    model_id: str
    sampler_id: str
    name: str | None


@dataclasses.dataclass(frozen=True)
class Ping:
    """Keeps the other ranks' wait short of the process group's timeout."""


@dataclasses.dataclass(frozen=True)
class Stop:
    """Ends `follow` on every rank."""


@dataclasses.dataclass(frozen=True)
class Sampler:
    """A sampling session: the model and the weight version it samples with."""

    model_id: str
    version: int
    path: str | None


class TinkerModels:
    """What every rank holds: the models by id (and, on rank 0, the sampling sessions: the newest
    --max-sampling-sessions of them)."""

    def __init__(self, options: ServeOptions, placement: Any) -> None:
        self.options, self.placement = options, placement
        self.models: dict[str, TrainedModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self.sampler_paths: dict[str, Sampler] = {}
        self._lock = threading.Lock()

    def add_sampler(self, sampler_id: str, sampler: Sampler) -> None:
        """Keep a sampling session (and its path's), forgetting the oldest past --max-sampling-sessions."""
        with self._lock:
            for kept, key in ((self.samplers, sampler_id), (self.sampler_paths, sampler.path)):
                if key is None:
                    continue
                kept[key] = sampler
                while len(kept) > self.options.limits.max_sampling_sessions:
                    del kept[next(iter(kept))]

    def model(self, model_id: str) -> TrainedModel:
        if model_id not in self.models:
            raise UserError(f"unknown model_id {model_id!r}: create a training client first (this server has "
                            f"{', '.join(self.models) or 'none'})")  # fmt: skip
        return self.models[model_id]

    def run(self, op: Any) -> Result | None:
        """Run a training operation on this rank: its result (rank 0's is the one answered). Under split
        placement an operation on the trained model alone runs on the trainer ranks, and the trainer leader
        hands its result (or its failure) to rank 0 (`rlcore.tinker.split`). What it freed goes back to the
        kernel after it (`rlcore.dist.memory.give_back`)."""
        try:
            return self._run(op)
        finally:
            give_back()

    def _run(self, op: Any) -> Result | None:
        handler = _HANDLERS[type(op)]
        if not self.placement.split or not isinstance(op, _TRAINERS_ONLY):
            return handler(self, op)
        if not self.placement.trains:
            return split.receive_result(self.placement) if dist.get_rank() == 0 else None
        try:
            result = handler(self, op)
        except Exception as e:
            result = _failure(e)
        split.send_result(result, self.placement)
        return result

    def state_dir(self, path: str) -> Path:
        """The directory of a tinker:// path, under the work directory (nothing outside it is read)."""
        parts = path.removeprefix("tinker://").split("/")
        if not path.startswith("tinker://") or len(parts) != 3 or parts[1] not in ("weights", "sampler_weights"):
            raise UserError(f"path {path!r}: expected tinker://<model_id>/weights/<name>, as save_state returns")
        checked(parts[0], f"path {path!r}: model id")
        return under(self.options.workdir, parts[0], parts[1], checked(parts[2], f"path {path!r}: checkpoint name"))

    def sample(self, ops: list[SampleOp]) -> list[bytes]:
        """Rank 0: the requests of one sampler version, batched (`rlcore.tinker.sampling`)."""
        sampler = self.samplers[ops[0].sampler_id]
        model = self.model(sampler.model_id)
        if model.engine_version != sampler.version:
            raise UserError(f"sampler {ops[0].sampler_id} holds version {sampler.version} of {sampler.model_id}, whose "
                            f"engine now holds version {model.engine_version}; save_weights_for_sampler again")  # fmt: skip
        return run_samples(model.engine, model.pad_id, ops, Deadline.start(self.options.limits))


def _create(s: TinkerModels, op: CreateModel) -> Result:
    if op.model_id not in s.models:
        check_models(len(s.models), s.options.limits)
        s.models[op.model_id] = TrainedModel(op.model_id, op.base_model, op.lora_rank, s.options, s.placement)
    return Result(json={"model_id": op.model_id, "type": "create_model"})


def _fwdbwd(s: TinkerModels, op: FwdBwd) -> Result:
    r = op.request
    rows, metrics = s.model(r.model_id).forward_backward(r.data, r.loss_fn, r.config, forward_only=r.forward_only,
                                                         deadline=Deadline.start(s.options.limits))  # fmt: skip
    return Result(proto=encode_forward_backward([{"logprobs": lp} for lp in rows], metrics))


def _optim(s: TinkerModels, op: OptimStep) -> Result:
    return Result(json={"metrics": s.model(op.model_id).optim_step(op.adam), "type": "optim_step"})


def _save(s: TinkerModels, op: SaveState) -> Result:
    return Result(json={"path": s.model(op.model_id).save("weights", op.name), "type": "save_weights"})


def _load(s: TinkerModels, op: LoadState) -> Result:
    directory = s.state_dir(op.path)
    if op.create and op.model_id not in s.models:
        check_models(len(s.models), s.options.limits)
        extra = state_extra(directory)
        s.models[op.model_id] = TrainedModel(op.model_id, extra["base_model"], extra["lora_rank"], s.options,
                                             s.placement)  # fmt: skip
    s.model(op.model_id).load(directory, optimizer=op.optimizer)
    return Result(json={"path": op.path, "model_id": op.model_id, "type": "load_weights"})


def _for_sampler(s: TinkerModels, op: SaveForSampler) -> Result:
    model = s.model(op.model_id)
    version = model.push()
    path = model.save("sampler_weights", op.name) if op.name is not None else None
    sampler = Sampler(model_id=op.model_id, version=version, path=path)
    s.add_sampler(op.sampler_id, sampler)
    return Result(json={"path": path, "sampling_session_id": op.sampler_id, "type": "save_weights_for_sampler"})


def _nothing(s: TinkerModels, op: Any) -> None:
    return None


_HANDLERS: dict[type, Callable[[TinkerModels, Any], Result | None]] = {
    CreateModel: _create, FwdBwd: _fwdbwd, OptimStep: _optim, SaveState: _save, LoadState: _load,
    SaveForSampler: _for_sampler, Ping: _nothing, Stop: _nothing,
}  # fmt: skip
"""Each training operation's handler (every rank runs it)."""


_TRAINERS_ONLY = (FwdBwd, OptimStep)
"""Under split placement: the operations only the trainer ranks run."""


def _broadcast(op: Any) -> Any:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [op]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return op


def _run_everywhere(served: TinkerModels, op: Any) -> Result | None:
    return served.run(_broadcast(op))


def follow(served: TinkerModels) -> None:
    """Ranks other than 0: run every operation rank 0 broadcasts, until it stops."""
    while True:
        op = _broadcast(None)
        if isinstance(op, Stop):
            return
        try:
            served.run(op)
        except UserError:
            pass  # rank 0 raised the same error and answered it
        except Exception:
            log.error("rank operation failed:\n%s", traceback.format_exc())


class Worker:
    """Rank 0's one thread that runs every operation in arrival order (module docstring)."""

    def __init__(self, served: TinkerModels, futures: Futures) -> None:
        self.served, self.futures = served, futures
        self._queue: queue.Queue = queue.Queue()
        self._held: list = []  # an operation taken from the queue while gathering samples: it runs next
        self._thread = threading.Thread(target=self._loop, name="rlcore-tinker-worker", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, op: Any) -> None:
        self._queue.put((request_id, op))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            try:
                item = self._held.pop() if self._held else self._queue.get(timeout=PING_S)
            except queue.Empty:
                _broadcast(Ping())
                continue
            if item is None:
                _broadcast(Stop())
                return
            request_id, op = item
            if isinstance(op, SampleOp):
                items, held = gather(self._queue, item, after_last(LINGER_S), _is_sample)
                if held is not None:
                    self._held.append(held)  # it runs right after these samples, before anything queued behind it
                self._samples(items)
            else:
                self._finish(request_id, functools.partial(_run_everywhere, self.served, op))

    def _samples(self, items: list[tuple[str, SampleOp]]) -> None:
        by_sampler: dict[str, list[tuple[str, SampleOp]]] = {}
        for item in items:
            by_sampler.setdefault(item[1].sampler_id, []).append(item)
        for group in by_sampler.values():
            ids = [request_id for request_id, _ in group]
            try:
                bodies = self.served.sample([op for _, op in group])
            except Exception as e:
                for request_id in ids:
                    self.futures.finish(request_id, _failure(e))
                continue
            for request_id, body in zip(ids, bodies, strict=True):
                self.futures.finish(request_id, Result(proto=body))

    def _finish(self, request_id: str, run: Callable[[], Result | None]) -> None:
        try:
            result = run()
        except Exception as e:
            result = _failure(e)
        self.futures.finish(request_id, result or Result(json={}))


def _is_sample(item: tuple[str, Any] | None) -> bool:
    return item is not None and isinstance(item[1], SampleOp)


def _failure(e: Exception) -> Result:
    if isinstance(e, UserError):
        return Result(error=str(e), category="user")
    log.error("request failed:\n%s", traceback.format_exc())
    return Result(error=f"server error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", category="server")

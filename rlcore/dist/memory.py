"""The process's memory on Linux: freed memory given back, each phase's peak, the allocator's slack.

    return_freed_memory("keep")           # once at start-up (--trainer.freed-memory)
    with phase_peak("update"): ...        # `rlcore.step.phases.phase` does this for every phase; under
                                          # "trim" its end gives the freed memory back (`give_back`)
    take_phase_peaks()                    # {"perf/mem/update_peak_mb": 4350.0, ...} since the last call
    allocator_slack_mb()                  # freed bytes glibc holds but has not given back

Why: glibc serves a block of more than 128 KiB by mapping it, but raises that threshold to the size of each
mapped block freed (up to 32 MiB), so after the first step a trainer's tensors of up to 32 MiB come from
the heap, and the heap keeps what they free. The modes (`FreedMemory`), measured side by side on
SmolLM2-135M GRPO (8 x 8 samples, 48 tokens, 2 threads; full fine-tuning / LoRA 16;
experiments/README.md, "Freed memory: keep, trim or unmap, side by side"):
- "keep" (the default): glibc's own behaviour. Steps 42.1 / 42.1 s; 2.9 GiB resident between phases,
  update peak 4.5 GiB.
- "trim": glibc reuses freed blocks within a phase; each phase's end gives every free page back
  (`malloc_trim`), which the next phase faults in again. 2.1 GiB between phases; steps 45.5 / 49.2 s.
- "unmap": blocks of `MMAP_THRESHOLD` or more are mapped, and unmapped when freed: the lowest update peak
  (4.2 GiB), but every large tensor faults in fresh pages. Steps 52.0 / 49.0 s.

Each phase's peak is the kernel's high-water mark of resident memory (VmHWM), reset at every phase's
entry (`/proc/self/clear_refs`), so nested phases each get their own peak and the outer one keeps the
inner's. The resets also reset getrusage's `ru_maxrss`, so the process's peak is `peak_mb`. Off Linux
every function does nothing and reports nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import re
from collections.abc import Iterator
from typing import Literal

import torch

FreedMemory = Literal["trim", "unmap", "keep"]
"""How freed memory goes back to the kernel (module docstring; --trainer.freed-memory)."""
MMAP_THRESHOLD = 2**20
"""Blocks of at least this many bytes are mapped, and unmapped when freed."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)

_mode: list[FreedMemory] = ["keep"]  # what return_freed_memory set
_open: list[str] = []  # the phases entered and not yet left, outermost first
_peaks: dict[str, int] = {}  # KiB, since the last take_phase_peaks
_lifetime = [0]  # KiB: the process's peak, which the resets hide from getrusage's ru_maxrss
_before_models: list[float] = []  # MiB resident when the run started, before any model loaded


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, looked up once (`find_library` runs ldconfig); None elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") else None


def return_freed_memory(mode: FreedMemory) -> bool:
    """Set how freed memory goes back to the kernel (module docstring); False off glibc (nothing set)."""
    libc = _libc()
    if libc is None:
        return False
    _mode[0] = mode
    if mode != "unmap":
        return True
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD))


def give_back() -> None:
    """Under "trim": every whole free page of glibc's heaps back to the kernel (`malloc_trim(0)`)."""
    libc = _libc() if _mode[0] == "trim" else None
    if libc is not None:
        libc.malloc_trim(0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def allocator_slack_mb() -> float | None:
    """MiB that glibc's heaps hold free (`mallinfo2().fordblks`, every arena); None off glibc 2.33+."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2().fordblks / 2**20


def _status_kib(field: str) -> int | None:
    """A field of /proc/self/status in KiB (VmHWM: the high-water mark, VmRSS: resident now)."""
    try:
        with open("/proc/self/status") as f:
            found = re.search(rf"^{field}:\s+(\d+)", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) if found else None


def resident_mb() -> float | None:
    """The process's resident memory now, MiB (None off Linux)."""
    kib = _status_kib("VmRSS")
    return kib / 1024 if kib is not None else None


def note_process() -> None:
    """Note the resident memory now as the process's own (`process_mb`): call it just before the models load."""
    now = resident_mb()
    if now is not None:
        _before_models[:] = [now]


def process_mb() -> dict[str, float]:
    """`perf/mem/process_mb`: the resident memory before any model loaded (Python, torch, the data)."""
    return {"perf/mem/process_mb": _before_models[0]} if _before_models else {}


def _reset_high_water() -> None:
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _credit(kib: int | None) -> None:
    """Every open phase has seen a peak of at least `kib`."""
    if kib is not None:
        _lifetime[0] = max(_lifetime[0], kib)
        for name in _open:
            _peaks[name] = max(_peaks.get(name, 0), kib)


@contextlib.contextmanager
def phase_peak(name: str) -> Iterator[None]:
    """Record the block's peak resident memory as `name`'s (module docstring)."""
    _credit(_status_kib("VmHWM"))  # the outer phases keep what they reached before the reset
    _open.append(name)
    _reset_high_water()
    try:
        yield
    finally:
        _credit(_status_kib("VmHWM"))
        _open.pop()
        give_back()


def peak_mb() -> float | None:
    """The process's peak resident memory so far, MiB (None off Linux)."""
    _credit(_status_kib("VmHWM"))
    return _lifetime[0] / 1024 if _lifetime[0] else None


def state_mb(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """What the trained model holds on this rank, MiB: `perf/mem/weights_mb` (every parameter),
    `perf/mem/gradients_mb` (the trained ones' gradients, alive during the update only) and
    `perf/mem/optimizer_mb` (the optimizer's state tensors)."""
    params = [getattr(p, "_local_tensor", p) for p in model.parameters()]  # a DTensor's shard
    trained = [getattr(p, "_local_tensor", p) for p in model.parameters() if p.requires_grad]
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    states = [getattr(t, "_local_tensor", t) for t in state]
    return {f"perf/mem/{k}_mb": sum(t.numel() * t.element_size() for t in ts) / 2**20
            for k, ts in (("weights", params), ("gradients", trained), ("optimizer", states))}  # fmt: skip


def take_phase_peaks() -> dict[str, float]:
    """`perf/mem/<phase>_peak_mb` of every phase entered since the last call (MiB), then forget them."""
    _credit(_status_kib("VmHWM"))  # phases still open count up to now
    out = {f"perf/mem/{name}_peak_mb": kib / 1024 for name, kib in _peaks.items()}
    _peaks.clear()
    return out


def gpu_free_mb() -> float | None:
    """MiB free on this process's CUDA device (any allocator's memory counts as used); None without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.mem_get_info()[0] / 2**20

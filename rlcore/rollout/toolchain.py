"""Whether torch.compile can build its C++ kernels on CPU in this installation (vLLM on CPU builds them too).

torch's inductor (2.13) hands the compiler torch's own include and library directories without quoting
them, and vLLM on CPU puts torch's libgomp in the space-separated LD_PRELOAD: with torch installed under a
path holding a space (a checkout in `my runs/`, its `.venv` inside), every CPU build fails to link.
The trainer refuses such runs before any model loads, with this one line, instead of failing mid-rollout.
"""

from __future__ import annotations

from pathlib import Path

import torch

TORCH_DIR = Path(torch.__file__).resolve().parent


def cpu_compile_problem(torch_dir: Path | None = None) -> str | None:
    """Why torch.compile cannot build CPU kernels here (with torch in `torch_dir`, default: where it is), or None."""
    torch_dir = TORCH_DIR if torch_dir is None else torch_dir
    if not any(c.isspace() for c in str(torch_dir)):
        return None
    return (
        f"torch is installed under {str(torch_dir)!r}, a path with a space, and torch.compile's C++ build on "
        "CPU (which vLLM on CPU uses too) cannot link there (a torch limitation): create the virtual "
        "environment under a path without spaces"
    )

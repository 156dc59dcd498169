"""Which traceback frames in a child's stderr are ours: a frame whose file lies inside this checkout's
`rlcore/` package or is its `train.py`, decided by path from the project root (never by the text
"rlcore", which is also the default name of the folder `git clone` makes, venv included)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_PACKAGE, _ENTRY = os.path.realpath(ROOT / "rlcore"), os.path.realpath(ROOT / "train.py")
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line \d+', re.M)  # Python's and faulthandler's frames


def is_ours(path: str) -> bool:
    """Whether `path` (as a traceback prints it) is a file of the package or the entry point."""
    real = os.path.realpath(path)
    return real == _ENTRY or real.startswith(_PACKAGE + os.sep)


def our_frames(stderr: str) -> list[str]:
    """The files of the frames in `stderr` that are ours (empty: no traceback went through our code)."""
    return [m["path"] for m in _FRAME.finditer(stderr) if is_ours(m["path"])]

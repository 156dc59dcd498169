"""tyro's parse errors as one line, for every rlcore command line (train.py and the servers')."""

from __future__ import annotations

import re


def condense(message: str, prog: str = "python train.py") -> str:
    """tyro's boxed error as one line: what is wrong, and the closest flag when it suggests one."""
    lines = [line.strip() for line in message.splitlines()]
    rules = [i for i, line in enumerate(lines) if line and set(line) == {"-"}]
    body = lines[rules[0] + 1 : rules[1]] if len(rules) >= 2 else lines
    text = " ".join(line for line in body if line and "Perhaps you meant" not in line)
    text = re.sub(r"\s+", " ", text).strip() or "invalid command line"
    if "Perhaps you meant:" in lines:
        hint = lines[lines.index("Perhaps you meant:") + 1].split()[0]
        text += f"; did you mean {hint}?"
    return f"{text} (see {prog} --help)"

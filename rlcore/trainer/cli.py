"""Command line: presets as the first word, every config field a typed flag (tyro)."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Sequence

import tyro

from configs import PRESETS, Config, ConfigError


class UserError(ValueError):
    """Bad input from the user: printed as one line, exit code 2, no traceback."""


def parse(argv: Sequence[str]) -> Config:
    """The Config of `argv`; no arguments (or flags only) means the `grpo` preset."""
    args = list(argv)
    if not args or (args[0].startswith("-") and args[0] not in ("-h", "--help")):
        args = ["grpo", *args]
    if not args[0].startswith("-") and args[0] not in PRESETS:
        raise UserError(f"unknown preset {args[0]!r}; choose one of {', '.join(PRESETS)} (or see --help)")
    if "-h" in args or "--help" in args:
        return _tyro(args)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            return _tyro(args)
    except SystemExit:
        raise UserError(condense(captured.getvalue())) from None
    except ConfigError as e:
        raise UserError(str(e)) from None


def _tyro(args: list[str]) -> Config:
    return tyro.extras.overridable_config_cli(
        PRESETS, args=args, prog="train.py", description="rlcore: RL post-training of language models."
    )


def condense(message: str) -> str:
    """tyro's boxed error as one line: what is wrong, and the closest flag when it suggests one."""
    lines = [line.strip() for line in message.splitlines()]
    rules = [i for i, line in enumerate(lines) if line and set(line) == {"-"}]
    body = lines[rules[0] + 1 : rules[1]] if len(rules) >= 2 else lines
    text = " ".join(line for line in body if line and "Perhaps you meant" not in line)
    text = re.sub(r"\s+", " ", text).strip() or "invalid command line"
    if "Perhaps you meant:" in lines:
        hint = lines[lines.index("Perhaps you meant:") + 1].split()[0]
        text += f"; did you mean {hint}?"
    return f"{text} (see python train.py --help)"

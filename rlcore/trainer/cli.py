"""Command line: presets as the first word, every config field a typed flag (tyro)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Sequence

import tyro

from configs import PRESETS, Config, ConfigError
from rlcore.config.messages import condense


class CommandLineError(ValueError):
    """Bad input from the user: printed as one line, exit code 2, no traceback."""


DEPRECATED: dict[str, str] = {
    "--critic.warmup-steps": "--critic.lr-warmup-steps",
    "reinforce_pp": "reinforce-pp",
}
"""Old spellings still accepted, each rewritten to its new one before tyro parses (with one warning line
on stderr): flags (`--flag value`, `--flag=value`, underscores or hyphens) and presets (the first word)."""


def parse(argv: Sequence[str]) -> Config:
    """The Config of `argv`; no arguments (or flags only) means the `grpo` preset."""
    args = renamed(argv)
    if not args or (args[0].startswith("-") and args[0] not in ("-h", "--help")):
        args = ["grpo", *args]
    if not args[0].startswith("-") and args[0] not in PRESETS:
        raise CommandLineError(f"unknown preset {args[0]!r}; choose one of {', '.join(PRESETS)} (or see --help)")
    if "-h" in args or "--help" in args:
        return _tyro(args)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            return _tyro(args)
    except SystemExit:
        raise CommandLineError(condense(captured.getvalue())) from None
    except ConfigError as e:
        raise CommandLineError(str(e)) from None


def renamed(argv: Sequence[str]) -> list[str]:
    """`argv` with each DEPRECATED spelling replaced by its new one, and one warning line on stderr per old
    spelling used (from the first rank only, under torchrun)."""
    args: list[str] = []
    warned: list[str] = []
    for i, arg in enumerate(argv):
        old = _old_spelling(arg, first=i == 0)
        if old is None:
            args.append(arg)
            continue
        _, eq, value = arg.partition("=") if old.startswith("--") else (arg, "", "")
        args.append(DEPRECATED[old] + eq + value)
        if old not in warned and os.environ.get("RANK", "0") == "0":
            what = old if old.startswith("--") else f"the preset {old}"
            print(f"warning: {what} is deprecated; use {DEPRECATED[old]}", file=sys.stderr)
        warned.append(old)
    return args


def _old_spelling(arg: str, *, first: bool) -> str | None:
    """The DEPRECATED key that `arg` spells (a flag with or without =VALUE, in hyphens or underscores as tyro
    takes both; a preset only as the first word, never a flag's value), or None."""
    if arg.startswith("--"):
        key = arg.partition("=")[0].replace("_", "-")
    elif first:
        key = arg
    else:
        return None
    return key if key in DEPRECATED else None


def _tyro(args: list[str]) -> Config:
    return tyro.extras.overridable_config_cli(
        PRESETS, args=args, prog="train.py", description="rlcore: RL post-training of language models."
    )

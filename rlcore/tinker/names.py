"""Every name a client sends that becomes part of a path (session ids, model ids, save names, the parts of a
`tinker://` path) is checked against one grammar here, and every path made from them must stay under the work
directory once resolved (symlinks followed), so no request reads or writes outside `--workdir`. A base model
that is a local path must lie under one of the roots the server was started with (`--model-roots`); without
them only built-in models and hub ids load."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from rlcore.tinker.errors import UserError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9:._-]{0,127}")
"""A name: a letter or digit, then letters, digits, ':', '.', '_', '-' (at most 128; no '/', so one path part)."""


def checked(name: object, what: str) -> str:
    """`name` if it is a NAME, else a UserError naming `what` and the grammar."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise UserError(f"{what} {name!r}: use a letter or digit, then letters, digits, ':', '.', '_' and '-' "
                        "(at most 128 characters, no '/')")  # fmt: skip
    return name


def model_id(session: object, seq: object) -> str:
    """The id of a session's `seq`-th model as the SDK derives it (`<session>:train:<seq>`), checked."""
    checked(session, "session_id")
    try:
        number = int(seq)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise UserError(f"model_seq_id {seq!r}: expected an integer") from None
    return checked(f"{session}:train:{number}", "model id")


def under(workdir: Path, *parts: str) -> Path:
    """workdir/parts... once resolved (symlinks followed); a UserError if that leaves the work directory."""
    root = workdir.resolve()
    path = root.joinpath(*parts).resolve()
    if not path.is_relative_to(root):
        raise UserError(f"{'/'.join(parts)} resolves to {path}, outside the work directory {root}: remove the "
                        "link that leads there, or start the server with another --workdir")  # fmt: skip
    return path


def check_base_model(base_model: str, roots: Sequence[Path]) -> None:
    """A UserError unless `base_model` is a built-in model, a hub id (`org/name`, no such local path), or a
    local path under one of `roots` (resolved, symlinks followed)."""
    from rlcore.models.hub import HUB_ID
    from rlcore.models.policy import BUILTIN_PREFIX

    if base_model.startswith(BUILTIN_PREFIX):
        return
    local = Path(base_model).expanduser()
    if HUB_ID.fullmatch(base_model) and "/" in base_model and not local.exists():
        return
    resolved = local.resolve()
    if any(resolved.is_relative_to(root.resolve()) for root in roots):
        return
    served = ", ".join(str(r) for r in roots) or "none"
    raise UserError(f"base_model {base_model!r} is a local path outside the served model roots ({served}): start "
                    "the server with --model-roots naming a directory that holds it, or use a hub id (org/name) "
                    "or a builtin: model")  # fmt: skip

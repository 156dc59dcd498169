"""Loading a user's reward function from a file: `--reward.custom path/to/file.py:function_name`.

The function has verl's signature and is called with keywords, exactly as verl's reward managers
call a `custom_reward_function`, so an existing verl reward file works unchanged:

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

The file is imported from its path with `importlib` (its directory is not put on `sys.path`); it
is registered in `sys.modules` under a name derived from its absolute path, so loading the same
file twice reuses the module. Every problem is one `RewardSpecError` line naming the file, the
function and the fix.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

RewardFn = Callable[..., Any]
"""`compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`."""

SIGNATURE = ("data_source", "solution_str", "ground_truth", "extra_info")
FLAG = "--reward.custom"


class RewardSpecError(ValueError):
    """A reward specification (custom file, unknown data_source) that cannot be used; one clear line."""


def split_spec(spec: str, *, flag: str = FLAG, error: type[ValueError] = RewardSpecError,
               form: str = "function_name", example: str = "my_reward.py:compute_score") -> tuple[Path, str]:  # fmt: skip
    """(absolute path, name) of `path/to/file.py:<form>`; else `error`, one line naming `flag` and `example`."""
    path, sep, name = str(spec).rpartition(":")
    if not sep or not path or not name.isidentifier():
        raise error(f"{flag} {spec!r}: expected 'path/to/file.py:{form}', e.g. '{example}'")
    return Path(path).expanduser().resolve(), name


def existing_file(path: Path, spec: str, *, flag: str = FLAG, error: type[ValueError] = RewardSpecError) -> Path:
    """`path` where it is a file; else `error`, one line naming `flag` and how to give the path."""
    if not path.is_file():
        raise error(f"{flag} {spec!r}: file {path} not found; give a path relative to the working directory "
                    "or an absolute path")  # fmt: skip
    return path


def load_custom(spec: str) -> RewardFn:
    """The function named by `spec` ('path/to/file.py:function_name'), imported from the file."""
    path, name = split_spec(spec)
    module = import_file(FLAG, spec, existing_file(path, spec))
    if not hasattr(module, name):
        defined = sorted(
            n
            for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise RewardSpecError(
            f"{FLAG} {spec!r}: {path.name} has no function {name!r} (functions defined there: "
            f"{', '.join(defined) or 'none'}); write 'path:function_name' with one of them"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardSpecError(
            f"{FLAG} {spec!r}: {name!r} in {path.name} is a {type(fn).__name__}, not a function; "
            "point at a function with the signature "
            "compute_score(data_source, solution_str, ground_truth, extra_info=None)"
        )
    check_signature(fn, f"{FLAG} {spec!r}")
    return fn


def check_signature(fn: RewardFn, where: str) -> None:
    """Raise `RewardSpecError` unless `fn` can be called with verl's four keywords."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have no signature; trust them
        return
    try:
        signature.bind(**dict.fromkeys(SIGNATURE))
    except TypeError as e:
        raise RewardSpecError(
            f"{where}: {getattr(fn, '__name__', fn)!s}{signature} cannot be called as "
            f"fn(data_source=, solution_str=, ground_truth=, extra_info=) ({e}); use verl's parameter names"
        ) from None


def import_file(flag: str, spec: str, path: Path, error: type[ValueError] = RewardSpecError) -> Any:
    """The module of the Python file `path` (imported once per path); a failure raises `error`, one line
    naming `flag`."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"rlcore_user_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{flag} {spec!r}: {path} cannot be imported as a Python file; use a .py file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickle look their module up here
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # a syntax error or anything the file raises at import
        del sys.modules[module_name]
        detail = " ".join(f"{type(e).__name__}: {e}".split())
        raise error(f"{flag} {spec!r}: importing {path} failed: {detail}") from None
    return module

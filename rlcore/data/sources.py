"""Data sources named on the command line: files, `builtin:<task>` generated tasks, or reasoning-gym's
tasks (`reasoning_gym:<task>?options`, rlcore.data.reasoning_gym)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

from rlcore.data import agent_tasks, reasoning_gym, shapes, tasks
from rlcore.data.rows import DataError, Row, read_rows, row_from_dict

BUILTIN = "builtin:"
GENERATORS: dict[str, Callable[..., list[dict]]] = {
    **{name: functools.partial(tasks.generate_rows, name) for name in tasks.TASKS},
    agent_tasks.NAME: agent_tasks.generate_rows,  # multi-turn: train it with --rollout.max-turns > 1
    shapes.NAME: shapes.generate_rows,  # images: train it with a vision-language model (builtin:tiny-vl)
}
"""Built-in tasks by name: `generator(split, n, seed=...)` -> verl-format rows."""


def read_sources(
    sources: Sequence[str],
    *,
    split: str,
    builtin_size: int,
    seed: int,
    prompt_optional: bool = False,
    answer_format: str = "tag",
) -> list[Row]:
    """Rows of every source, in order: files through `read_rows` (`prompt_optional` as there),
    `builtin:<task>` generated for `split`, `reasoning_gym:` tasks (`answer_format` where the source
    does not name one)."""
    if not sources:
        raise DataError("no data sources given")
    rows: list[Row] = []
    for source in sources:
        if source.startswith(BUILTIN):
            task = source.removeprefix(BUILTIN)
            if task not in GENERATORS:
                raise DataError(f"{source}: unknown built-in task; choose one of {sorted(GENERATORS)}")
            generated = GENERATORS[task](split, builtin_size, seed=seed)
            rows += [row_from_dict(r, f"{source} row {i}") for i, r in enumerate(generated)]
        elif source.startswith(reasoning_gym.PREFIX):
            generated = reasoning_gym.generate_rows(source, split, builtin_size, seed, answer=answer_format)
            rows += [row_from_dict(r, f"{source} row {i}") for i, r in enumerate(generated)]
        else:
            rows += read_rows(source, prompt_optional=prompt_optional)
    return rows


def is_generated(source: str) -> bool:
    """A task generated here (builtin:<task>, reasoning_gym:<task>), whose val split holds its own rows."""
    return source.startswith((BUILTIN, reasoning_gym.PREFIX))


def check_sources_exist(sources: Sequence[str], flag: str) -> str | None:
    """A one-line problem with `sources` (a missing file, an unknown task), or None. No file is read."""
    for source in sources:
        if source.startswith(BUILTIN):
            if source.removeprefix(BUILTIN) not in GENERATORS:
                return f"{flag} {source}: unknown built-in task; choose one of {sorted(GENERATORS)}"
        elif source.startswith(reasoning_gym.PREFIX):
            problem = reasoning_gym.check_source(source)
            if problem is not None:
                return f"{flag} {problem}"
        elif not Path(source).is_file():
            return f"{flag} {source}: file not found; give parquet/jsonl files or builtin:<task>"
    return None

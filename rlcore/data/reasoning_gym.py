"""reasoning-gym tasks as data sources: procedurally generated problems, each scored by its own verifier.

    --data.train-files reasoning_gym:chain_sum?size=5000&seed=1&max_terms=3
    --data.train-files "reasoning_gym:chain_sum*2+basic_arithmetic?size=3000&chain_sum.max_terms=3"

A source names one task or a weighted mixture (`task*weight` joined by `+`; the size is shared in
proportion to the weights). Options after `?`: `size` (rows; default --data.builtin-train-size /
-val-size), `seed` (default --trainer.seed for the train split and that + 1 for the val split, so the
two differ), `answer` (below), and the task's own config fields (`max_terms=3`; in a mixture
`task.field=value`). Values are Python literals (`3`, `0.5`, `True`, `(2, 4)`) or plain strings. A task
or an option reasoning-gym does not know is one `DataError` line before any model loads.

Rows are verl's format: `data_source` `reasoning_gym/<task>`, the prompt a system message (how to give
the answer) and the task's question, `reward_model.ground_truth` the task's answer, and in
`extra_info` the entry's place (`task`, `config`, `index`) and `answer_format`. The scorer rebuilds that
entry from reasoning-gym (`create_dataset(task, **config)[index]`: generation is deterministic for a
seed) and calls the task's own `score_answer` on the answer extracted from the response.

**Answer extraction** (the source's `answer=`, else `--data.answer-format`, default `tag`):

| answer | the prompt asks for | extracted |
|---|---|---|
| `tag` | `<answer>...</answer>` (reasoning-gym's default system prompt) | the last `<answer>` tag's content, stripped (reasoning-gym's `extract_answer`); no tag: no answer (score 0) |
| `boxed` | `\\boxed{...}` around the final answer | the last `\\boxed{}`'s content |
| `raw` | the answer alone | the whole response, stripped |
| `last` | a response that ends with the final answer | the last number in the response (`-1,234.5` -> `-1234.5`; none: no answer): numeric tasks, and small models that do not keep to a format |
"""

from __future__ import annotations

import ast
import difflib
import functools
import re
from typing import Any
from urllib.parse import parse_qsl

from rlcore.data.rows import DataError

PREFIX = "reasoning_gym:"
DATA_SOURCE = "reasoning_gym/"
"""Rows' data_source is `reasoning_gym/<task>`."""
RESERVED = ("size", "seed", "answer")

SYSTEM = {
    "tag": "Given a problem, think it through step by step, then give the final answer in the form "
    "<answer>answer here</answer>. Put only the final answer inside the tags.",
    "boxed": "Given a problem, think it through step by step, then put the final answer alone in \\boxed{}.",
    "raw": "Answer with the final answer only, nothing else.",
    "last": "Solve the problem. End your response with the final answer.",
}
"""The system message of each answer format: what the extraction below expects."""


def _parse_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse(source: str) -> tuple[dict[str, float], dict[str, Any], dict[str, dict[str, Any]]]:
    """`reasoning_gym:...` -> (task -> weight, the reserved options, task -> its config options); a
    DataError line for bad syntax, a task or an option reasoning-gym does not know."""
    body = source.removeprefix(PREFIX)
    names, _, query = body.partition("?")
    weights: dict[str, float] = {}
    for part in names.split("+"):
        name, _, weight = part.strip().partition("*")
        try:
            weights[name] = float(weight) if weight else 1.0
        except ValueError:
            raise DataError(f"{source}: weight {weight!r} of {name} is not a number (write task*2)") from None
        if weights[name] <= 0:
            raise DataError(f"{source}: weight of {name} must be > 0")
    registry = _registry()
    for name in weights:
        if name not in registry:
            close = difflib.get_close_matches(name, registry, n=3)
            hint = f"did you mean {', '.join(close)}?" if close else f"e.g. {', '.join(sorted(registry)[:5])}"
            raise DataError(
                f"{source}: reasoning-gym has no task {name!r} ({hint} all {len(registry)}: "
                "python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))')"
            )
    reserved: dict[str, Any] = {}
    options: dict[str, dict[str, Any]] = {name: {} for name in weights}
    for key, text in parse_qsl(query, keep_blank_values=True):
        task, dot, field = key.rpartition(".") if "." in key else ("", "", key)
        if not dot and key in RESERVED:
            reserved[key] = _parse_value(text)
            continue
        targets = [task] if dot else list(weights)
        if (dot and task not in weights) or (not dot and len(weights) > 1):
            raise DataError(
                f"{source}: option {key!r}: in a mixture write <task>.<field>=value for a task of it"
            )
        for target in targets:
            options[target][field] = _parse_value(text)
    _check(source, reserved, options, registry)
    return weights, reserved, options


def _check(source: str, reserved: dict[str, Any], options: dict[str, dict[str, Any]], registry: dict) -> None:
    import dataclasses

    if reserved.get("answer", "tag") not in SYSTEM:
        raise DataError(f"{source}: answer={reserved['answer']!r}; choose one of {sorted(SYSTEM)}")
    for key in ("size", "seed"):
        if key in reserved and (
            not isinstance(reserved[key], int) or reserved[key] < (1 if key == "size" else 0)
        ):
            raise DataError(
                f"{source}: {key}={reserved[key]!r} must be an integer >= {1 if key == 'size' else 0}"
            )
    for task, fields in options.items():
        known = {f.name for f in dataclasses.fields(registry[task][1])} - {"size", "seed"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise DataError(f"{source}: {task} has no option {unknown[0]!r}; its options are {sorted(known)}")
        try:
            _dataset(task, _frozen({**fields, "size": 1, "seed": 0}))
        except Exception as e:  # the task's config checks its values
            raise DataError(f"{source}: {task} refuses {fields}: {type(e).__name__}: {e}") from None


def generate_rows(
    source: str, split: str, default_size: int, seed: int, *, answer: str = "tag"
) -> list[dict]:
    """The rows of `source` for `split`, deterministic for its seed; `answer` is the answer format where
    the source names none (--data.answer-format)."""
    weights, reserved, options = parse(source)
    size = reserved.get("size", default_size)
    seed = reserved.get("seed", seed if split == "train" else seed + 1)
    answer = reserved.get("answer", answer)
    rows: list[dict] = []
    for task, n in zip(weights, _shares(size, list(weights.values())), strict=True):
        config = {**options[task], "size": n, "seed": seed}
        dataset = _dataset(task, _frozen(config))
        for index in range(n):
            rows.append(_row(task, dataset[index], config, index, answer, split))
    return rows


def _shares(size: int, weights: list[float]) -> list[int]:
    """`size` split in proportion to `weights` (largest remainders; every task at least 1 row)."""
    total = sum(weights)
    exact = [size * w / total for w in weights]
    shares = [max(1, int(x)) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    for i in order[: max(0, size - sum(shares))]:
        shares[i] += 1
    return shares


def _row(task: str, entry: dict, config: dict, index: int, answer: str, split: str) -> dict:
    return {
        "data_source": DATA_SOURCE + task,
        "prompt": [
            {"role": "system", "content": SYSTEM[answer]},
            {"role": "user", "content": entry["question"]},
        ],
        "ability": "reasoning",
        "reward_model": {"ground_truth": str(entry["answer"]), "style": "rule"},
        "extra_info": {
            "task": task,
            "config": config,
            "index": index,
            "answer_format": answer,
            "split": split,
        },
    }


_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
"""A number as written: a minus unless it follows a digit (`5-3` ends in 3), digits or thousands
groups with commas, decimals."""


def extract(response: str, answer_format: str) -> str | None:
    """The answer in `response` per `answer_format` (see the module docstring); None if there is none."""
    if answer_format == "raw":
        return response.strip()
    if answer_format == "boxed":
        from rlcore.data.answers import last_boxed, unbox

        boxed = last_boxed(response)
        try:
            return unbox(boxed) if boxed is not None else None
        except ValueError:  # an \fbox{}: not the format asked for
            return None
    if answer_format == "last":
        numbers = _NUMBER.findall(response)
        return numbers[-1].replace(",", "") if numbers else None
    found = re.findall(r"<answer>\s?(.*?)\s?</answer>", response, flags=re.DOTALL)
    return found[-1].strip() if found else None


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """reasoning-gym's own `score_answer` of the task, on the answer extracted from the response."""
    info = extra_info or {}
    dataset = _dataset(info["task"], _frozen(info["config"]))
    entry = dataset[int(info["index"])]
    answer = extract(solution_str, info.get("answer_format", "tag"))
    return float(dataset.score_answer(answer=answer, entry=entry))


def check_source(source: str) -> str | None:
    """A one-line problem with a `reasoning_gym:` source, or None (no rows are generated)."""
    try:
        parse(source)
    except DataError as e:
        return str(e)
    return None


@functools.cache
def _registry() -> dict[str, Any]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise DataError(
            "reasoning_gym: sources need the reasoning-gym package; pip install reasoning-gym"
        ) from None
    return dict(DATASETS)


def _frozen(config: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, _hashable(v)) for k, v in config.items()))


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list | tuple) else value


@functools.lru_cache(maxsize=64)
def _dataset(task: str, config: tuple[tuple[str, Any], ...]) -> Any:
    """reasoning-gym's dataset of `task` with `config` (generation is deterministic: cached per process)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, **dict(config))

"""Reading prompt rows in verl's format from parquet and jsonl files, validated on load.

A row is a dict (a parquet record or a JSON object) with

    data_source   str                       which reward function scores it (required)
    prompt        list of {"role", "content"} chat messages, or a plain string (required; with
                  --rollout.env it may be left out: the first observation is then the first user turn)
    ability       str                       free-form tag (optional)
    reward_model  {"ground_truth": ..., "style": ...}   (optional; ground_truth may be any value)
    extra_info    dict                      passed to the reward function (optional)
    images        list of images            one per `<image>` placeholder in the prompt (optional;
                                            rlcore.data.images: {"bytes"}, {"path"}, {"base64"}, a path)

so the files verl's `examples/data_preprocess/*.py` write load unchanged. Every problem is one
`DataError` line naming the file, the row (parquet: 0-based `row N`; jsonl: 1-based `line N`)
and the field. Nothing is skipped silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from rlcore.data.errors import DataError
from rlcore.data.images import check_images, check_placeholders

SUFFIXES = (".parquet", ".jsonl", ".json")


Prompt = list[dict[str, str]] | str


@dataclasses.dataclass(frozen=True)
class Row:
    """One validated prompt row."""

    data_source: str
    """Key that selects the reward function (verl's `data_source`)."""
    prompt: Prompt
    """Chat messages (`role`, `content`, and any other non-null keys) or a plain string."""
    ground_truth: Any = None
    """`reward_model.ground_truth`; None when the row has none."""
    extra_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    """`extra_info`, passed to the reward function."""
    ability: str | None = None
    """verl's `ability` tag."""
    origin: str = "<memory>"
    """Where the row came from (`file row N` / `file line N`), for error messages."""
    images: tuple[Any, ...] = ()
    """The row's images, undecoded (`rlcore.data.images`), one per `<image>` placeholder of the prompt."""


def row_from_dict(record: Any, origin: str, *, prompt_optional: bool = False) -> Row:
    """Validate one record (a dict in verl's row format) and build a `Row`; raise `DataError` naming `origin`.
    `prompt_optional` (an environment's rows, whose first observation can be the first user turn): a
    missing, null, "" or [] prompt is the empty prompt ""."""
    if not isinstance(record, Mapping):
        raise DataError(f"{origin}: row is {_kind(record)}, expected an object with a 'prompt' field")
    if prompt_optional and record.get("prompt") in (None, "", []):
        prompt: Prompt = ""
    elif "prompt" not in record or record["prompt"] is None:
        raise DataError(f"{origin}: missing field 'prompt'")
    else:
        prompt = _check_prompt(record["prompt"], origin)
    data_source = record.get("data_source")
    if data_source is None:
        raise DataError(f"{origin}: missing field 'data_source'")
    if not isinstance(data_source, str):
        raise DataError(f"{origin}: field 'data_source' is {_kind(data_source)}, expected str")
    reward_model = record.get("reward_model")
    if reward_model is not None and not isinstance(reward_model, Mapping):
        raise DataError(f"{origin}: field 'reward_model' is {_kind(reward_model)}, expected an object")
    extra_info = record.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, Mapping):
        raise DataError(f"{origin}: field 'extra_info' is {_kind(extra_info)}, expected an object")
    ability = record.get("ability")
    if ability is not None and not isinstance(ability, str):
        raise DataError(f"{origin}: field 'ability' is {_kind(ability)}, expected str")
    images = check_images(record.get("images"), origin)
    if images:
        check_placeholders(prompt, images, origin)
    return Row(
        data_source=data_source,
        prompt=prompt,
        ground_truth=(reward_model or {}).get("ground_truth"),
        extra_info=dict(extra_info or {}),
        ability=ability,
        origin=origin,
        images=images,
    )


def _check_prompt(prompt: Any, origin: str) -> Prompt:
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{origin}: field 'prompt' is an empty string")
        return prompt
    if not isinstance(prompt, list | tuple):
        raise DataError(
            f"{origin}: field 'prompt' is {_kind(prompt)}, expected a list of messages or a string"
        )
    if not prompt:
        raise DataError(f"{origin}: field 'prompt' is an empty list of messages")
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            raise DataError(f"{origin}: field 'prompt[{i}]' is {_kind(message)}, expected a message object")
        for key in ("role", "content"):
            if message.get(key) is None:
                raise DataError(f"{origin}: field 'prompt[{i}]' has no '{key}'")
            if not isinstance(message[key], str):
                raise DataError(f"{origin}: field 'prompt[{i}].{key}' is {_kind(message[key])}, expected str")
        messages.append({k: v for k, v in message.items() if v is not None})
    return messages


def _kind(value: Any) -> str:
    """'an object', 'a list', 'a string', 'null', 'an int', ... for error messages."""
    names = {dict: "object", list: "list", str: "string", type(None): "null"}
    name = names.get(type(value), type(value).__name__)
    return name if name == "null" else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


# -- files ---------------------------------------------------------------------------------------


def read_rows(paths: str | Path | Sequence[str | Path], *, prompt_optional: bool = False) -> list[Row]:
    """All rows of the given parquet / jsonl / json files, in order, validated (`row_from_dict`)."""
    if isinstance(paths, str | Path):
        paths = [paths]
    if not paths:
        raise DataError("no data files given")
    return [row for path in paths for row in _read_file(Path(path), prompt_optional)]


def _read_file(path: Path, prompt_optional: bool) -> Iterator[Row]:
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if path.is_dir():
        raise DataError(f"{path}: is a directory, expected a {'/'.join(SUFFIXES)} file")
    if path.suffix not in SUFFIXES:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}, expected {'/'.join(SUFFIXES)}")
    records = _read_parquet(path) if path.suffix == ".parquet" else _read_json(path)
    for origin, record in records:
        yield row_from_dict(record, origin, prompt_optional=prompt_optional)


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    try:
        records = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read parquet file ({_first_line(e)})") from None
    return [(f"{path} row {i}", record) for i, record in enumerate(records)]


def _read_json(path: Path) -> list[tuple[str, Any]]:
    """JSON lines (`.jsonl`, or `.json` starting with an object) or a `.json` array of rows."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read file ({_first_line(e)})") from None
    if path.suffix == ".json" and data.lstrip().startswith(b"["):
        try:
            records = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON ({_first_line(e)})") from None
        return [(f"{path} row {i}", record) for i, record in enumerate(records)]
    out = []
    for n, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue  # blank lines separate nothing and hold no row
        try:
            out.append((f"{path} line {n}", orjson.loads(line)))
        except orjson.JSONDecodeError as e:
            raise DataError(f"{path} line {n}: invalid JSON ({_first_line(e)})") from None
    return out


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__

"""Images in prompt rows, in verl's multimodal format.

A row may carry an `images` column: a list with one entry per image, each `{"bytes": <encoded image>}`
(what Hugging Face `datasets` and verl's geo3k preprocessing write to parquet), `{"path": "file.png"}`,
a plain path string, or in jsonl `{"base64": "..."}`. The prompt marks where each image goes with an
`<image>` placeholder in its messages' text, in order; rendering turns each message into parts
(`{"type": "image"}` / `{"type": "text", "text": ...}`), which the chat templates of vision-language
models understand.

Problems (an image that cannot be read or decoded, a missing file, a count of images that is not the
count of placeholders) are one `DataError` line naming the row and the image.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlcore.data.errors import DataError

PLACEHOLDER = "<image>"


def check_images(images: Any, origin: str) -> tuple[Any, ...]:
    """The row's `images` value as a tuple of specs, with each spec's kind checked (not decoded yet)."""
    if images is None:
        return ()
    if not isinstance(images, list | tuple):
        raise DataError(f"{origin}: field 'images' is a {type(images).__name__}, expected a list of images")
    for i, spec in enumerate(images):
        ok = isinstance(spec, str | bytes) or (
            isinstance(spec, Mapping) and any(spec.get(k) is not None for k in ("bytes", "path", "base64"))
        )
        if not ok:
            raise DataError(f"{origin}: field 'images[{i}]' is not an image (give {{'bytes': ...}}, "
                            "{'path': ...}, {'base64': ...} or a path)")  # fmt: skip
    return tuple(images)


def decode_image(spec: Any, origin: str, index: int) -> Any:
    """A PIL RGB image from one spec (a relative path is read from the working directory); a `DataError`
    naming the row and the image when it cannot be read."""
    from PIL import Image, UnidentifiedImageError

    where = f"{origin}: field 'images[{index}]'"
    if isinstance(spec, Image.Image):  # an environment's observation may hand over a PIL image
        return spec.convert("RGB")
    try:
        if isinstance(spec, Mapping) and spec.get("bytes") is not None:
            source: Any = io.BytesIO(spec["bytes"])
        elif isinstance(spec, Mapping) and spec.get("base64") is not None:
            source = io.BytesIO(base64.b64decode(spec["base64"], validate=True))
        elif isinstance(spec, bytes):
            source = io.BytesIO(spec)
        else:
            path = Path(spec["path"] if isinstance(spec, Mapping) else spec)
            if not path.is_file():
                raise DataError(f"{where}: image file {path} not found")
            source = path
        with Image.open(source) as image:
            return image.convert("RGB")
    except DataError:
        raise
    except UnidentifiedImageError:
        raise DataError(f"{where}: cannot decode the image (not an image format PIL reads)") from None
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"{where}: cannot decode the image ({type(e).__name__}: {e})") from None


def placeholder_count(prompt: Any) -> int:
    """How many `<image>` placeholders a prompt (a string or chat messages) holds."""
    if isinstance(prompt, str):
        return prompt.count(PLACEHOLDER)
    return sum(m["content"].count(PLACEHOLDER) for m in prompt)


def check_placeholders(prompt: Any, images: Sequence[Any], origin: str) -> None:
    """A `DataError` when the prompt's placeholders and the row's images differ in number."""
    count = placeholder_count(prompt)
    if count != len(images):
        raise DataError(f"{origin}: field 'images' holds {len(images)} images but the prompt has {count} "
                        f"{PLACEHOLDER} placeholders; give one placeholder per image")  # fmt: skip


def with_image_parts(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose `<image>` placeholders become image parts: content as a list of `{"type": "image"}`
    and `{"type": "text", "text": ...}` (messages without a placeholder keep their string)."""
    out = []
    for message in messages:
        content = message["content"]
        if PLACEHOLDER not in content:
            out.append(dict(message))
            continue
        parts: list[dict[str, Any]] = []
        for i, text in enumerate(content.split(PLACEHOLDER)):
            if i:
                parts.append({"type": "image"})
            if text:
                parts.append({"type": "text", "text": text})
        out.append({**message, "content": parts})
    return out

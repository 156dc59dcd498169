"""Answers boxed in LaTeX: the last `\\boxed{...}` of a response and its content, as MATH's rules and the
reasoning-gym tasks asked for `boxed` answers read them."""

from __future__ import annotations


def last_boxed(text: str) -> str | None:
    """The last `\\boxed{...}` (braces balanced) or `\\boxed x` (to the next `$`) of `text`, else the
    last `\\fbox{...}`; None if there is none."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    span = last_box_span(text)
    return None if span is None else text[span[0] : span[1] + 1]


def last_box_span(text: str) -> tuple[int, int] | None:
    """(where, closing brace) of the last `\\boxed` (else `\\fbox`) whose braces close; None if none."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    if start < 0:
        return None
    end = closing_brace(text, start)
    return None if end is None else (start, end)


def closing_brace(text: str, start: int) -> int | None:
    """The index of the `}` that brings the brace depth counted from `start` back to 0 (verl's scan)."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if text[i] == "}" and depth == 0:
            return i
    return None


def unbox(boxed: str) -> str:
    """The content of `\\boxed x` or `\\boxed{x}`; ValueError for anything else (an `\\fbox{}`)."""
    if "\\boxed " in boxed:
        if not boxed.startswith("\\boxed "):
            raise ValueError(f"not a box: {boxed!r}")
        return boxed[len("\\boxed ") :]
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise ValueError(f"not a box: {boxed!r}")
    return boxed[len("\\boxed{") : -1]

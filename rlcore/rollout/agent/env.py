"""Text environments with the gymnasium API, loaded from `--rollout.env path/to/file.py:ClassName`.

    class Guess:                                   # or a gymnasium.Env subclass with Text spaces
        def reset(self, *, seed=None, options=None):
            row = options["row"]                    # data_source, prompt, ground_truth, extra_info
            return "Guess a digit.", {}             # (observation, info)
        def step(self, action):                     # the model's turn, as text
            return "higher", 0.0, False, False, {}  # (observation, reward, terminated, truncated, info)

The agent loop (`rlcore.rollout.agent.loop`) builds one instance per sample with no arguments, resets it
with the sample's row and a seed shared by the samples of one prompt (so a group plays the same
instance of the task), and steps it with the text of each model turn. An observation is a string
(the next user message) or a chat message dict / list of message dicts (e.g. `{"role": "tool", ...}`);
for a vision-language policy a message's content may be parts, `{"type": "image", "image": ...}` (a PIL
image, encoded bytes, a path or verl's `{"bytes": ...}`) among `{"type": "text", "text": ...}`.
`close()` is called when the episode ends, if the class has one. `load_env` checks the file, the
class and the two signatures at start-up, so a bad spec is one line before any model loads.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

from rlcore.rewards.custom import existing_file, import_file, split_spec

ENV_FLAG = "--rollout.env"

Message = dict[str, Any]


class EnvSpecError(ValueError):
    """An environment or tools file that cannot be used; one line naming the flag and the fix."""


class EnvOutputError(ValueError):
    """An environment returned something the loop cannot use (it ends that episode as an env error)."""


@dataclass(frozen=True)
class EnvStep:
    """One `step` result, checked."""

    messages: list[Message]
    reward: float
    terminated: bool
    truncated: bool


def load_env(spec: str) -> type:
    """The environment class named by `spec` ('path/to/file.py:ClassName'), checked (see module doc)."""
    path, name = split_spec(spec, flag=ENV_FLAG, error=EnvSpecError, form="ClassName", example="my_env.py:MyEnv")
    module = import_file(ENV_FLAG, spec, existing_file(path, spec, flag=ENV_FLAG, error=EnvSpecError), EnvSpecError)
    classes = sorted(n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_"))
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        what = "nothing" if cls is None else f"a {type(cls).__name__}"
        raise EnvSpecError(f"{ENV_FLAG} {spec!r}: {name!r} in {path.name} is {what}, not a class (classes "
                           f"there: {', '.join(classes) or 'none'})")  # fmt: skip
    _check_callable(spec, cls, "__init__", "ClassName()", lambda s: s.bind())
    _check_callable(spec, cls, "reset", "reset(*, seed=None, options=None)",
                    lambda s: s.bind(None, seed=None, options=None))  # fmt: skip
    _check_callable(spec, cls, "step", "step(action)", lambda s: s.bind(None, "action"))
    return cls


def _check_callable(spec: str, cls: type, method: str, usage: str, bind: Any) -> None:
    fn = cls if method == "__init__" else getattr(cls, method, None)
    if fn is None or not callable(fn):
        raise EnvSpecError(f"{ENV_FLAG} {spec!r}: {cls.__name__} has no method {method}; the gymnasium API "
                           "needs reset(*, seed=None, options=None) and step(action)")  # fmt: skip
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a C-implemented method: trust it
        return
    try:
        bind(signature)
    except TypeError as e:
        init = method == "__init__"
        shown = f"{cls.__name__}{signature}" if init else f"{method}{signature}"
        fix = (
            "the loop builds one instance per sample with no arguments"
            if init
            else "use gymnasium's signature"
        )
        raise EnvSpecError(f"{ENV_FLAG} {spec!r}: {shown} cannot be called as {usage} ({e}); {fix}") from None


def as_messages(observation: Any) -> list[Message]:
    """An observation as chat messages: a string is one user message; a message dict or a list of them
    is kept; "" or None is no message."""
    if observation is None or observation == "":
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    items = [observation] if isinstance(observation, dict) else observation
    if not isinstance(items, list | tuple) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and _content_ok(m.get("content"))
        for m in items
    ):
        raise EnvOutputError(f"observation {observation!r:.80}: expected a string, or chat message dicts "
                             "with a 'role' string and a 'content' string or list of parts ({'type': 'text', "
                             "'text': ...} / {'type': 'image', 'image': ...})")  # fmt: skip
    return [dict(m) for m in items]


def _content_ok(content: Any) -> bool:
    """A message's content: a string, or parts of text and images (a vision-language policy's)."""
    if isinstance(content, str):
        return True
    return isinstance(content, list | tuple) and all(
        isinstance(part, dict)
        and ((part.get("type") == "text" and isinstance(part.get("text"), str))
             or (part.get("type") == "image" and part.get("image") is not None))
        for part in content
    )  # fmt: skip


def checked_reset(result: Any) -> list[Message]:
    """The first observation's messages from `reset`'s `(observation, info)`."""
    if not isinstance(result, tuple | list) or len(result) != 2:
        raise EnvOutputError(f"reset returned {result!r:.80}: expected (observation, info)")
    return as_messages(result[0])


def checked_step(result: Any) -> EnvStep:
    """`step`'s `(observation, reward, terminated, truncated, info)`, checked."""
    if not isinstance(result, tuple | list) or len(result) != 5:
        raise EnvOutputError(f"step returned {result!r:.80}: expected (observation, reward, terminated, "
                             "truncated, info)")  # fmt: skip
    observation, reward, terminated, truncated, _ = result
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise EnvOutputError(f"step returned reward {reward!r:.40}: expected a number") from None
    if not math.isfinite(reward):
        raise EnvOutputError(f"step returned reward {reward!r}: expected a finite number")
    return EnvStep(as_messages(observation), reward, bool(terminated), bool(truncated))

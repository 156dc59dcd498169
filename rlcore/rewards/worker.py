"""Calling a reward function safely, in this process or in a reward worker process.

`call_reward` turns whatever the function does into an outcome tuple: `("ok", score, extras)` or
`("error", traceback_text)`. `serve` is the main loop of a worker process (see `pool.py`): it puts
itself in its own process group (so the parent can kill it together with anything it started),
dies with the trainer, loads the reward function once, says `("ready", pid)`, then answers one
task at a time until its pipe closes.
"""

from __future__ import annotations

import math
import numbers
import os
import signal
import threading
import traceback
from multiprocessing import parent_process
from multiprocessing.connection import Connection, wait
from typing import Any

from rlcore.rewards.custom import RewardFn
from rlcore.rewards.dispatch import resolve_reward_fn

Outcome = tuple[Any, ...]
"""`("ok", score: float, extras: dict[str, float])`, `("error", traceback: str)` or `("timeout", seconds)`."""


def call_reward(
    fn: RewardFn, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any
) -> Outcome:
    """Call `fn` with verl's keywords; any exception, or a result that is not a finite number or a dict
    with a finite 'score', becomes `("error", traceback)`."""
    try:
        result = fn(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
        )
        score, extras = normalize(result)
    except (Exception, SystemExit):  # sys.exit() in a reward function must not end the run
        return ("error", traceback.format_exc())
    return ("ok", score, extras)


def normalize(result: Any) -> tuple[float, dict[str, float]]:
    """(score, numeric extras) of a reward function's return value; non-numeric extras are dropped."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"the reward dict has no 'score' key (keys: {sorted(map(str, result))})")
        extras = {str(k): float(v) for k, v in result.items() if k != "score" and _is_number(v)}
        result = result["score"]
    else:
        extras = {}
    if not _is_number(result):
        raise TypeError(
            f"the reward function returned a {type(result).__name__}; expected a number or a dict with 'score'"
        )
    score = float(result)
    if not math.isfinite(score):
        raise ValueError(f"the reward function returned a non-finite score {score}")
    return score, extras


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) or (
        not isinstance(value, str | bytes) and hasattr(value, "__float__") and getattr(value, "ndim", 0) == 0
    )


def serve(
    conn: Connection, custom: str | None, data_sources: tuple[str, ...], math_verifier: str = "verl"
) -> None:
    """Main loop of a reward worker process (the target of `multiprocessing.Process`)."""
    os.setpgrp()  # the parent kills the whole group: this worker and whatever its reward function started
    threading.Thread(target=_die_with_parent, daemon=True).start()
    try:
        fn = resolve_reward_fn(data_sources, custom, math_verifier)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the scorer closed the pipe
            return
        conn.send(call_reward(fn, *task))


def _die_with_parent() -> None:
    parent = parent_process()
    if parent is not None:
        wait([parent.sentinel])
        os.killpg(0, signal.SIGKILL)  # the trainer is gone: take the group down, even mid-reward

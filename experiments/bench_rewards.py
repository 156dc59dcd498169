"""Rule-based rewards: rlcore's built-in table against verl 0.9.1's own functions, same responses, one process.

    .venv/bin/python experiments/bench_rewards.py [--count 400]

For each data_source family, the same responses (the random mix of `tests/rewards/test_verl_own_functions.py`:
boxes, `Answer:` lines, fractions, units, `\\pi`, percentages, tuples, noise) are scored one after the other,
as verl's NaiveRewardManager scores them in its driver: first by verl's `default_compute_score`, imported
from the downloaded wheel (`.venv/wheels/verl-0.9.1-py3-none-any.whl`), then by rlcore's,
alternating rounds so that load on this shared machine hits both. Printed per family: responses per second
of each, the ratio (rlcore / verl) and whether every score agreed. No FLOP floor: this is string and sympy
work, no matmul.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlcore.rewards.dispatch import default_compute_score
from tests.rewards.test_verl_own_functions import _math_responses, _responses, unpack_verl


def load_verl(root: Path) -> types.ModuleType:
    """verl's `verl.utils.reward_score`, from the wheel unpacked under `root`."""
    unpack_verl(root)
    return importlib.import_module("verl.utils.reward_score")


FAMILIES = {"gsm8k": "openai/gsm8k", "MATH": "HuggingFaceH4/MATH-500", "math_dapo": "math_dapo",
            "numina (prime_math)": "numina_olympiads", "geometry3k": "hiyouga/geometry3k"}  # fmt: skip
"""family -> data_source; each side scores it through its own `default_compute_score`."""


def score_of(result) -> float:
    return result["score"] if isinstance(result, dict) else result


def timed(fn, cases) -> tuple[float, list[float]]:
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # verl prints now and then
        scores = [fn(r, t) for r, t in cases]
    return time.perf_counter() - start, scores


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        verl = load_verl(Path(tmp))
        cases = _math_responses(args.count // 2, seed=31) + _responses(args.count - args.count // 2, seed=32)
        print(f"{len(cases)} responses per family, {args.rounds} rounds each side, alternating")
        print(f"{'family':22s} {'verl resp/s':>12s} {'rlcore resp/s':>14s} {'ratio':>7s}  scores")
        for family, source in FAMILIES.items():
            verl_fn = lambda r, t, s=source: score_of(verl.default_compute_score(s, r, t))  # noqa: E731
            ours_fn = lambda r, t, s=source: score_of(default_compute_score(s, r, t))  # noqa: E731
            timed(ours_fn, cases[:20]), timed(verl_fn, cases[:20])  # imports, caches
            verl_s = ours_s = 0.0
            for _ in range(args.rounds):
                seconds, want = timed(verl_fn, cases)
                verl_s += seconds
                seconds, got = timed(ours_fn, cases)
                ours_s += seconds
            agree = (
                "all equal"
                if want == got
                else f"{sum(a != b for a, b in zip(want, got, strict=True))} differ"
            )
            n = len(cases) * args.rounds
            print(f"{family:22s} {n / verl_s:12.0f} {n / ours_s:14.0f} {verl_s / ours_s:6.2f}x  {agree}")


if __name__ == "__main__":
    main()

"""rlcore's built-in rewards against verl 0.9.1's own functions (issue 22), response for response.

verl is not installed (its dependencies would pin this environment): the README's set-up downloads its
wheel (`pip download --no-deps verl==0.9.1 -d .venv/wheels`), and this test executes the four
stdlib-only modules behind the data sources compared (`gsm8k.py`, `math_reward.py`, `math_dapo.py`,
`search_r1_like_qa_em.py`) straight from it. Compared: the hand-written parity cases, and a few
thousand responses assembled at random from the pieces model answers are made of (boxes, `Answer:`
lines, fractions, units, signs, `$`, spaces, newlines), for every data_source family.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import sys
import types
import zipfile
from pathlib import Path

import pytest

from rlcore.rewards.dispatch import default_compute_score
from tests.rewards.test_verl_parity import DAPO_CASES, MATH, MATH_CASES, SEARCH_CASES

WHEEL = Path(sys.prefix) / "wheels" / "verl-0.9.1-py3-none-any.whl"
MODULES = ("gsm8k", "math_reward", "math_dapo", "search_r1_like_qa_em")


@pytest.fixture(scope="module")
def verl() -> dict[str, types.ModuleType]:
    if not WHEEL.is_file():
        if os.environ.get("RLCORE_REQUIRE_VERL") == "1":
            pytest.fail(f"{WHEEL} is missing: pip download --no-deps verl==0.9.1 -d {WHEEL.parent}")
        pytest.skip(f"verl's wheel is not downloaded ({WHEEL})")
    out = {}
    with zipfile.ZipFile(WHEEL) as wheel:
        for name in MODULES:
            module = types.ModuleType(f"verl_{name}")
            source = wheel.read(f"verl/utils/reward_score/{name}.py").decode()
            exec(compile(source, f"verl/utils/reward_score/{name}.py", "exec"), module.__dict__)
            out[name] = module
    return out


def _quiet(fn, *args):
    """verl's functions print now and then (a sampled 1 in 64, caught exceptions): keep the log clean."""
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


NOISE = ["\\boxed{", "}", "{", "Answer:", " ", "\n", "$", "\\frac", "\\sqrt", "3", "-", ",", "=", "#### ",
         "\\fbox{", "\\boxed ", "<answer>", "</answer>", "the ", ".", "so", "\\text{ m}", "\\!"]  # fmt: skip
VARIANTS = {
    "\\frac{1}{2}": ["\\frac{1}{2}", "0.5", "\\dfrac12", "1/2", "\\frac12", ".5", "2/4", "\\tfrac{1}{2}"],
    "12": ["12", "12.0", "x = 12", "12 units", "12^\\circ", " 12 ", "12\\%", "k=12", "\\text{12}"],
    "1000": ["1000", "1,000", "1{,}000", "1000 dollars", "\\$1000", "1 000"],
    "-3": ["-3", "- 3", "3", "-3.", "(-3)"],
    "(1,2)": ["(1,2)", "\\left( 1, 2 \\right)", "(1, 2)", "1,2"],
    "10": ["10\\text{ cm}", "10", "10 cm", "10\\text{ cm}\\text{ m}", "\\mathrm{10}"],
    "\\sqrt{3}": ["\\sqrt3", "\\sqrt{3}", "\\sqrt 3", "\\sqrt", "3^{1/2}"],
    "Paris": ["Paris", "paris.", "The Paris", "Paris, France"],
}
WRAPPERS = ["\\boxed{%s}", "Answer: %s", "answer:%s", "#### %s", "<answer>%s</answer>", "\\boxed %s$", "\\fbox{%s}",
            "%s", "Answer: $%s$", "$\\boxed{%s}$."]  # fmt: skip


def _responses(count: int, seed: int) -> list[tuple[str, str]]:
    """(response, ground truth): a wrapped variant (equivalent or near) of the truth amid random noise."""
    rng = random.Random(seed)

    def noise() -> str:
        return "".join(rng.choice(NOISE) for _ in range(rng.randint(0, 4)))

    out = []
    for _ in range(count):
        truth = rng.choice(list(VARIANTS))
        answer = rng.choice(VARIANTS[truth])
        out.append((noise() + rng.choice(WRAPPERS) % answer + noise() * rng.randint(0, 1), truth))
    return out


def test_math_sets_equal_verl_math_reward(verl):
    cases = [(r, t) for r, t, _ in MATH_CASES] + _responses(3000, seed=1)
    for response, truth in cases:
        want = float(_quiet(verl["math_reward"].compute_score, response, truth))
        assert default_compute_score(MATH, response, truth) == want, (response, truth)


def test_dapo_sources_equal_verl_math_dapo(verl):
    cases = [(r, t) for r, t, _ in DAPO_CASES] + _responses(3000, seed=2)
    for response, truth in cases:
        want = _quiet(verl["math_dapo"].compute_score, response, truth)
        for source in ("math_dapo", "aime2025"):
            assert default_compute_score(source, response, truth) == want, (response, truth)


def test_gsm8k_equals_verl_gsm8k(verl):
    for response, truth in _responses(3000, seed=3):
        want = float(_quiet(verl["gsm8k"].compute_score, response, truth))
        assert default_compute_score("openai/gsm8k", response, truth) == want, (response, truth)


def test_search_r1_equals_verl_exact_match(verl):
    rng = random.Random(4)
    cases = [(r, {"target": t}) for r, t, _ in SEARCH_CASES]
    cases += [
        (r, {"target": rng.choice([["Paris"], "paris", ["The Paris", "Rome"]])})
        for r, _ in _responses(2000, 5)
    ]
    for response, truth in cases:
        want = float(_quiet(verl["search_r1_like_qa_em"].compute_score, response, truth))
        assert default_compute_score("searchR1_nq", response, truth) == want, (response, truth)

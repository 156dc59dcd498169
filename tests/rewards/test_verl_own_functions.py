"""rlcore's built-in rewards against verl 0.9.1's own functions (issue 22), response for response.

verl is not installed (its dependencies would pin this environment): the README's set-up downloads its
wheel (`pip download --no-deps verl==0.9.1 -d .venv/wheels`), and this test executes the four
stdlib-only modules behind the data sources compared (`gsm8k.py`, `math_reward.py`, `math_dapo.py`,
`search_r1_like_qa_em.py`) straight from it, and imports `prime_math` and `geo3k.py` from the wheel's
`verl/` unpacked (with its own `py_functional` time limits; sympy, pylatexenc and mathruler are
installed). Compared: the hand-written parity cases, and a few thousand responses assembled at random
from the pieces model answers are made of (boxes, `Answer:` lines, fractions, units, signs, `$`,
spaces, newlines, `\\pi`, percentages, tuples, intervals), for every data_source family.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import random
import sys
import types
import zipfile
from pathlib import Path

import pytest

from rlcore.rewards.dispatch import default_compute_score
from tests.rewards.test_verl_parity import (
    DAPO_CASES,
    GEO,
    GEO_CASES,
    MATH,
    MATH_CASES,
    NUMINA,
    NUMINA_CASES,
    SEARCH_CASES,
)

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


def unpack_verl(root: Path) -> None:
    """Make `verl.utils.reward_score.*` importable from the wheel's `verl/` unpacked under `root`, its top
    `__init__`s (which pull in ray and omegaconf) replaced by empty packages."""
    with zipfile.ZipFile(WHEEL) as wheel:
        wheel.extractall(root, [n for n in wheel.namelist() if n.startswith("verl/")])
    for name in ("verl", "verl.utils"):
        package = types.ModuleType(name)
        package.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = package


@pytest.fixture(scope="module")
def verl_package(tmp_path_factory, verl) -> dict[str, types.ModuleType]:
    """verl's `prime_math` and `geo3k`, imported from the unpacked wheel (`unpack_verl`)."""
    if os.environ.get("RLCORE_REQUIRE_VERL") != "1":
        pytest.importorskip("mathruler")
    saved = {name: sys.modules.get(name) for name in ("verl", "verl.utils")}
    unpack_verl(tmp_path_factory.mktemp("verl"))
    try:
        yield {
            name: importlib.import_module(f"verl.utils.reward_score.{name}")
            for name in ("prime_math", "geo3k")
        }
    finally:
        for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
            del sys.modules[name]
        sys.modules.update({k: v for k, v in saved.items() if v is not None})


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


MATH_VARIANTS = {
    "6.28": ["2\\pi", "6.28", "2 \\pi", "\\pi \\cdot 2", "6.2832", "2\\pi r"],
    "\\frac{\\pi}{2}": ["\\frac{\\pi}{2}", "\\pi/2", "1.5708", "\\dfrac{\\pi}2", "90^\\circ"],
    "0.25": ["25\\%", "25%", "0.25", "\\frac14", "1/4", "2/8", "25 percent"],
    "(1, 3]": ["(1, 3]", "(1,3]", "Interval.Lopen(1, 3)", "[1, 3]", "(1, 3)", "x \\in (1, 3]"],
    "(2, -1)": ["(2, -1)", "(2,-1)", "Point(2, -1)", "x=2, y=-1", "2, -1", "[2, -1]"],
    "x^2+1": ["x^2+1", "1+x^2", "x^{2}+1", "x**2 + 1", "(x+i)(x-i)", "x^2 + 1 = 0"],
    "1010_2": ["1010_2", "10", "1010", "a_2"],
    "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}": ["[1, 2]", "[[1], [2]]", "Matrix([[1], [2]])", "(1, 2)"],
    "7\\frac{3}{4}": ["7 3/4", "7\\frac34", "31/4", "7.75", "\\frac{31}{4}"],
    "5": ["5", "x = 5", "5.0", "5 cm", "five", "\\text{5}", "\\$5", "5 million", "-5"],
}
PRIME_WRAPPERS = ["The answer is %s", "x = %s", "%s is the answer.", "Answer: %s", "\\boxed{%s}", "so we get %s",
                  "$\\boxed{%s}$. ", "<think>a</think> \\boxed{%s}", "%s", "therefore %s. So"]  # fmt: skip


def _math_responses(count: int, seed: int) -> list[tuple[str, str]]:
    """(response, truth): a wrapped form (equivalent, near or wrong) of a math answer amid noise."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        truth = rng.choice(list(MATH_VARIANTS))
        answer = rng.choice(MATH_VARIANTS[truth])
        noise = "".join(rng.choice(NOISE) for _ in range(rng.randint(0, 2)))
        out.append((noise + rng.choice(PRIME_WRAPPERS) % answer, truth))
    return out


def test_numina_sources_equal_verl_prime_math(verl_package):
    cases = [(r, t) for r, t, _ in NUMINA_CASES] + _math_responses(250, seed=6) + _responses(80, seed=7)
    for response, truth in cases:
        want = float(_quiet(verl_package["prime_math"].compute_score, response, truth)[0])
        assert default_compute_score(NUMINA, response, truth) == want, (response, truth)


def test_geometry3k_equals_verl_geo3k(verl_package):
    cases = [(r, t) for r, t, _ in GEO_CASES] + _math_responses(600, seed=8) + _responses(200, seed=9)
    for response, truth in cases:
        want = _quiet(verl_package["geo3k"].compute_score, response, truth)
        assert default_compute_score(GEO, response, truth) == want, (response, truth)

"""The built-in multi-turn task `calc`: multiply two 3-digit numbers, with the calculator tool.

    rows = generate_rows("train", 1000, seed=0)       # verl-format rows, data_source "builtin/calc"
    rollouts = run_agent(engine, prompts, sampling, tokenizer)   # rlcore.rollout.agent.loop
    compute_score("builtin/calc", response_text, "287663")       # 1.0

A prompt is the user message `347*829`; the ground truth is the product. A character-level model
cannot multiply 3-digit numbers in its head, but it can learn to write
`<tool>calculator: 347*829</tool>`, read `<result>287663</result>` and copy the number before EOS.

Reward (`compute_score`, verl's signature), on the decoded response (observations included):
    1.0  the final answer, i.e. the text after the last `</result>` (the whole response if there is
         none), stripped, equals the product;
    0.1  otherwise, if the response holds at least one successful tool observation (a `<result>`
         that is not an error): credit for using the tool;
    0.0  otherwise.
Splits are disjoint, as for `rlcore.data.tasks`: a problem is in 'val' iff crc32(prompt) % 10 == 0.
"""

from __future__ import annotations

import random

from rlcore.data.tasks import draw_rows

RESULT_OPEN, RESULT_CLOSE = (
    "<result>",
    "</result>",
)  # as in rlcore.rollout.agent.tools (data does not import rollout)

NAME = "calc"
DATA_SOURCE = f"builtin/{NAME}"
TOOL_CREDIT = 0.1
"""Score of a wrong final answer after at least one successful tool call."""


def make_problem(rng: random.Random) -> tuple[str, str]:
    """(prompt text `a*b`, product) with a, b uniform in [100, 999]."""
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return f"{a}*{b}", str(a * b)


def generate_rows(split: str, n: int, *, seed: int = 0) -> list[dict]:
    """`n` verl-format rows of `calc` for `split`, the same for the same (split, n, seed)."""

    def draw(rng: random.Random) -> tuple[str, dict]:
        prompt, truth = make_problem(rng)
        return prompt, {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": prompt}],
            "ability": "tool",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"tools": ["calculator"]},
        }

    return draw_rows(NAME, split, n, seed, draw)


def final_answer(solution_str: str) -> str:
    """The text after the last `</result>` (the whole text if there is none), stripped."""
    return solution_str.rpartition(RESULT_CLOSE)[2].strip()


def used_tool(solution_str: str) -> bool:
    """Whether some observation in the response is a result rather than an error."""
    pieces = solution_str.split(RESULT_OPEN)[1:]
    return any(RESULT_CLOSE in p and not p.startswith("error:") for p in pieces)


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """verl-signature reward of `calc` (see the module docstring): 1, 0.1 for tool use, else 0."""
    if data_source != DATA_SOURCE:
        raise ValueError(f"calc reward got data_source {data_source!r}, expected {DATA_SOURCE!r}")
    if final_answer(solution_str) == str(ground_truth):
        return 1.0
    return TOOL_CREDIT if used_tool(solution_str) else 0.0

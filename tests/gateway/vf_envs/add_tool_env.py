"""A verifiers multi-turn tool environment: `37+45` with an `add` tool; the rubric's reward is 1.0 when the
final answer is the sum, else 0.0."""

import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def correct(parser, completion, answer) -> float:
    return float((parser.parse_answer(completion) or "").strip() == answer)


def load_environment(**kwargs) -> vf.Environment:
    rows = [{"question": "37+45", "answer": "82"}]
    rubric = vf.Rubric(funcs=[correct])
    return vf.ToolEnv(dataset=lambda: Dataset.from_list(rows), tools=[add], max_turns=3, rubric=rubric,
                      system_prompt="Use the add tool.", **kwargs)  # fmt: skip

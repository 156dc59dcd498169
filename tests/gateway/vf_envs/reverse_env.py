"""A verifiers single-turn environment: reverse the digits of `reverse 40213`; the rubric's reward is 1.0
for the exact answer, else 0.0, and a metric counts the digits it got in place."""

import verifiers as vf
from datasets import Dataset


def exact(parser, completion, answer) -> float:
    return float((parser.parse_answer(completion) or "").strip() == answer)


def digits_in_place(parser, completion, answer) -> float:
    said = (parser.parse_answer(completion) or "").strip()
    return float(sum(a == b for a, b in zip(said, answer, strict=False)))


def load_environment(**kwargs) -> vf.Environment:
    rubric = vf.Rubric(funcs=[exact])
    rubric.add_metric(digits_in_place)  # weight 0: logged, not rewarded
    rows = [{"question": "reverse 123", "answer": "321"}, {"question": "reverse 4087", "answer": "7804"}]
    return vf.SingleTurnEnv(dataset=lambda: Dataset.from_list(rows), rubric=rubric, **kwargs)

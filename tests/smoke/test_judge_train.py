"""Generative judges through train.py (issue 38): the real SmolLM2-135M-Instruct judges a toy task.

The template asks whether the policy's answer to `builtin:reverse` equals the reference, "yes or no";
the judge samples its verdicts (temperature 1: yes, no, and some text that is neither), so the
verdicts are checkable against the scores: a "yes" first scores 1, a "no" first 0, anything else the
failure score (-1), counted in `reward/judge_failures`. Every sample of a step is in samples.jsonl
(`--log.samples 16` = 4 prompts x 4) with the judge's words.
"""

from __future__ import annotations

import json
import re

from rlcore.trainer.logger import read_metrics
from tests.real_model import smollm2_gguf
from tests.smoke.test_lag import kill_and_resume
from tests.smoke.test_train import SMALL, ok, train

TEMPLATE = """Question: {prompt}
Proposed answer: {response}
Correct answer: {ground_truth}
Is the proposed answer the same as the correct answer? Answer yes or no.
"""


def judge_args(tmp_path) -> list[str]:
    template = tmp_path / "judge.txt"
    template.write_text(TEMPLATE)
    return ["--reward.judge", str(smollm2_gguf()), "--reward.judge-template", str(template),
            "--reward.judge-parser", "yes_no", "--reward.judge-max-tokens", "6", "--reward.judge-temperature", "1",
            "--reward.failure-score", "-1", "--log.samples", "16", "--trainer.val-every", "0"]  # fmt: skip


def verdict_score(text: str) -> float:
    """What the verdict says, read here independently: the first word that is yes or no, else -1."""
    for word in re.findall(r"[a-z]+", text.lower()):
        if word in ("yes", "no"):
            return float(word == "yes")
    return -1.0


def test_the_real_model_judges_and_its_scores_are_its_verdicts(tmp_path) -> None:
    ok(
        train(
            "grpo", *SMALL, *judge_args(tmp_path), "--trainer.steps", "3", out=tmp_path / "run", timeout=600
        )
    )
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 16
    for s in samples:
        assert s["score"] == verdict_score(s["judge"]), s
    said = {verdict_score(s["judge"]) for s in samples}
    assert said == {1.0, 0.0, -1.0}, said  # yes, no and unreadable verdicts all occurred
    for r in read_metrics(tmp_path / "run" / "metrics.jsonl"):
        mine = [s for s in samples if s["step"] == r["step"]]
        assert r["reward/judge_failures"] == sum(verdict_score(s["judge"]) == -1 for s in mine)
        assert r["reward/judge_mean"] == sum(s["score"] for s in mine) / 16
        assert r["reward/judge_s"] > 0


def test_a_judged_run_killed_and_resumed_equals_the_uninterrupted_one(tmp_path) -> None:
    """The judge samples (temperature 1), seeded by the run's seed and its requests: the resumed run's
    verdicts, and so its scores and updates, are the uninterrupted run's."""
    args = ["grpo", *SMALL, *judge_args(tmp_path), "--trainer.steps", "4", "--trainer.save-every", "1"]
    kill_and_resume(args, tmp_path)
    a, b = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("reference", "killed"))
    assert [r["reward/judge_failures"] for r in b] == [r["reward/judge_failures"] for r in a]


def test_a_judge_scores_its_sources_beside_rule_rewards(tmp_path) -> None:
    """`--reward.judge-sources my/judged`: those rows (no reward function exists for them) are judged, here
    by builtin:tiny-reverse, whose digits no parser reads (each scores the failure score, 0.5); the
    built-in reverse rows keep their rule reward; validation judges too."""
    rows = tmp_path / "mixed.jsonl"
    rows.write_text("".join(json.dumps({"data_source": "my/judged", "prompt": f"reverse {i}{i + 1}"}) + "\n"
                            for i in range(8)))  # fmt: skip
    files = ["--data.train-files", "builtin:reverse", str(rows), "--data.val-files", str(rows)]
    ok(train("grpo", *SMALL, *files, "--reward.judge", "builtin:tiny-reverse", "--reward.judge-sources", "my/judged",
             "--reward.failure-score", "0.5", "--log.samples", "16", "--trainer.steps", "2", "--trainer.val-every", "2",
             out=tmp_path / "run"))  # fmt: skip
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    judged = [s for s in samples if s["data_source"] == "my/judged"]
    ruled = [s for s in samples if s["data_source"] == "builtin/reverse"]
    assert judged and ruled
    assert all("judge" in s and s["score"] == 0.5 for s in judged)
    assert all("judge" not in s and 0.0 <= s["score"] <= 1.0 for s in ruled)  # (reverse: partial credit)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert records[0]["val/reward_mean"] == 0.5  # validation's rows are all judged
    for r in records[1:]:  # (a step that drew no judged row logs no judge metrics)
        judged_now = sum(s["data_source"] == "my/judged" for s in samples if s["step"] == r["step"])
        assert r.get("reward/judge_failures", 0.0) == judged_now


def test_a_vllm_judge_beside_a_vllm_rollout_engine_says_what_the_native_judge_says(tmp_path) -> None:
    """The judge's own vLLM in the process that holds the rollout engine's vLLM (builtin:small): greedy,
    its verdicts on the same samples are the native judge's, word for word."""
    from tests.rollout.test_vllm_engine import require_vllm

    require_vllm()
    args = [arg for arg in judge_args(tmp_path) if arg not in ("--reward.judge-temperature", "1")]  # greedy
    common = [
        "grpo",
        *SMALL,
        *args,
        "--model.path",
        "builtin:small",
        "--rollout.engine",
        "vllm",
        "--trainer.steps",
        "2",
    ]
    for engine in ("native", "vllm"):
        ok(train(*common, "--reward.judge-engine", engine, out=tmp_path / engine, timeout=600))
    native, vllm = ([json.loads(line)["judge"] for line in (tmp_path / e / "samples.jsonl").read_text().splitlines()]
                    for e in ("native", "vllm"))  # fmt: skip
    assert len(native) == 32 and vllm == native


def test_split_placement_judges_on_the_rollout_rank(tmp_path) -> None:
    """1 rollout + 1 trainer rank at K = 0 with a judge (builtin:tiny-reverse, sampling, a hook parser):
    the judge lives with the rollout rank's scorer, and the run equals the colocated one, metric for
    metric (the judge's too) and bit for bit in the final weights."""
    from tests.smoke.test_split import assert_same_metrics, assert_same_weights, colocated, split
    from tests.smoke.test_split import ok as ok_run

    hook = tmp_path / "parse.py"
    hook.write_text("def first_digit(text):\n    return float(text[0]) / 9 if text[:1].isdigit() else None\n")
    args = ["--reward.judge", "builtin:tiny-reverse", "--reward.judge-parser", f"{hook}:first_digit",
            "--reward.judge-temperature", "1", "--trainer.steps", "3", "--trainer.val-every", "0"]  # fmt: skip
    ok_run(colocated(*args, out=tmp_path / "colocated"))
    ok_run(split(*args, out=tmp_path / "split"))
    assert read_metrics(tmp_path / "split" / "metrics.jsonl")[0]["reward/judge_mean"] > 0
    assert_same_metrics(tmp_path / "colocated", tmp_path / "split")
    assert_same_weights(tmp_path / "colocated", tmp_path / "split")

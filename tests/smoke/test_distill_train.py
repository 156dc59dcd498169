"""On-policy distillation through train.py (issue 38): a frozen teacher scores the student's samples.

The built-in models share one character tokenizer: `tiny-reverse` (warm-started on `reverse`) teaches,
`tiny-calc` (warm-started on another task: it knows the format, not this task) learns. A teacher equal to
the policy is a probe of alignment: its log-probs must equal the policy's token for token (KL exactly 0,
no update moves a weight), however the passes are cut into micro-batches, packed or sharded.
"""

from __future__ import annotations

import statistics

import torch
from safetensors.torch import load_file

from rlcore.models.policy import WEIGHTS_DIR
from rlcore.trainer.logger import read_metrics
from tests.smoke.test_lag import kill_and_resume
from tests.smoke.test_train import SMALL, ok, train

TEACHER = ["--algo.teacher", "builtin:tiny-reverse"]
LEARNS = ["distill", *SMALL, *TEACHER, "--model.path", "builtin:tiny-calc", "--data.batch-size", "8",
          "--optim.lr", "1e-3"]  # fmt: skip


def column(out, key: str) -> list[float]:
    return [r[key] for r in read_metrics(out / "metrics.jsonl") if key in r]


def test_the_student_moves_toward_the_teacher(tmp_path) -> None:
    """12 steps of pure distillation (`--algo.adv-estimator none`): the reverse KL to the teacher falls and
    the task reward rises, with no reward in the advantages; so do they on held-out prompts (validation's
    samples at temperature 1, scored by the teacher: val/teacher/*)."""
    ok(train(*LEARNS, "--trainer.steps", "12", "--trainer.val-every", "12", "--data.builtin-val-size", "32",
             out=tmp_path))  # fmt: skip
    held_out = column(tmp_path, "val/teacher/reverse_kl")
    assert len(held_out) == 2 and held_out[1] < held_out[0] - 0.5, held_out
    assert column(tmp_path, "val/pass@k")[1] > column(tmp_path, "val/pass@k")[0]
    kl, reward = column(tmp_path, "teacher/reverse_kl"), column(tmp_path, "train/reward_mean")
    assert len(kl) == 12 and all(k > 0 for k in kl)
    assert statistics.mean(kl[-4:]) < statistics.mean(kl[:4]) - 0.5, kl
    assert statistics.mean(reward[-4:]) > statistics.mean(reward[:4]) + 0.05, reward
    assert all(m >= k for m, k in zip(column(tmp_path, "teacher/reverse_kl_max"), kl, strict=True))
    assert all(0 < u < 1 for u in column(tmp_path, "teacher/unlikely_frac"))


def test_a_teacher_equal_to_the_policy_is_aligned_token_for_token(tmp_path) -> None:
    """Teacher = policy: every token's KL is 0 (max 0), so no advantage and no weight moves; the passes
    are cut into micro-batches of 3 rows (not a divisor of the 16 samples) and packed by prompt."""
    ok(train("distill", *SMALL, *TEACHER, "--trainer.steps", "2", "--trainer.val-every", "0",
             "--algo.micro-batch-size", "3", out=tmp_path))  # fmt: skip
    assert column(tmp_path, "teacher/reverse_kl_max") == [0.0, 0.0]
    assert column(tmp_path, "actor/shared_prompt_frac")[0] > 0  # the passes packed the prompts
    start = load_file(WEIGHTS_DIR / "tiny-reverse" / "model.safetensors")
    final = load_file(tmp_path / "final" / "model.safetensors")
    assert all(torch.equal(final[name], start[name]) for name in start)


def test_distillation_mixes_with_a_task_and_a_kl_loss_on_lora(tmp_path) -> None:
    """GRPO's task advantages plus half the teacher's term, a KL loss to the reference (with LoRA the
    policy with its adapter off: not the teacher), on LoRA adapters: the teacher's pass and the
    reference's both run, and the KL to the reference starts at 0 while the teacher's does not."""
    ok(train("grpo", *SMALL, "--algo.teacher", "builtin:tiny", "--algo.teacher-coef", "0.5",
             "--algo.use-kl-loss", "--model.lora-rank", "4", "--trainer.steps", "2", "--trainer.val-every", "0",
             out=tmp_path))  # fmt: skip
    first = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert first["actor/kl_loss"] == 0.0 and first["teacher/reverse_kl"] > 1.0
    assert (tmp_path / "final" / "adapter").is_dir()


def test_a_distillation_run_killed_and_resumed_equals_the_uninterrupted_one(tmp_path) -> None:
    kill_and_resume([*LEARNS, "--trainer.steps", "4", "--trainer.save-every", "1", "--trainer.val-every", "0"],
                    tmp_path)  # fmt: skip


def test_split_placement_distills_on_the_trainer_rank(tmp_path) -> None:
    """1 rollout + 1 trainer rank at K = 0, the teacher on the trainer rank only: the colocated run, metric
    for metric (the teacher's too) and bit for bit in the final weights."""
    from tests.smoke.test_split import assert_same_metrics, assert_same_weights, colocated, split
    from tests.smoke.test_split import ok as ok_run

    args = [
        *TEACHER,
        "--algo.teacher-clip",
        "5",
        "--model.path",
        "builtin:tiny-calc",
        "--trainer.steps",
        "3",
        "--trainer.val-every",
        "0",
    ]  # (split: the rollout rank validates, without the teacher: no val/teacher/*)
    ok_run(colocated(*args, out=tmp_path / "colocated"))
    ok_run(split(*args, out=tmp_path / "split"))
    assert column(tmp_path / "split", "teacher/reverse_kl")
    assert_same_metrics(tmp_path / "colocated", tmp_path / "split")
    assert_same_weights(tmp_path / "colocated", tmp_path / "split")


def test_two_ranks_shard_the_teacher_and_stay_aligned(tmp_path) -> None:
    """Under torchrun (2 gloo ranks) the teacher is FSDP2-sharded like the policy: a teacher equal to the
    policy still gives KL 0 on every token of both ranks (the max is reduced over ranks) and moves no
    weight; a different teacher trains, and scores validation's samples on both ranks alike."""
    from tests.smoke.test_torchrun import ARGS, torchrun

    proc = torchrun("distill", *ARGS, *TEACHER, "--trainer.steps", "2", "--out-dir", str(tmp_path / "same"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert column(tmp_path / "same", "teacher/reverse_kl_max") == [0.0, 0.0]
    start = load_file(WEIGHTS_DIR / "tiny-reverse" / "model.safetensors")
    final = load_file(tmp_path / "same" / "final" / "model.safetensors")
    assert all(torch.equal(final[name], start[name]) for name in start)
    proc = torchrun("distill", *ARGS, "--algo.teacher", "builtin:tiny", "--trainer.steps", "2",
                    "--trainer.val-every", "2", "--data.builtin-val-size", "8", "--out-dir", str(tmp_path / "other"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(k > 1.0 for k in column(tmp_path / "other", "teacher/reverse_kl"))
    assert (
        len(column(tmp_path / "other", "val/teacher/reverse_kl")) == 2
    )  # each rank's sharded teacher scored


def test_the_real_model_teaches_its_pruned_self_and_refuses_another_vocabulary(tmp_path) -> None:
    """SmolLM2-135M-Instruct (its GGUF file) teaches itself cut to its first 6 of 30 layers (the same
    tokenizer, saved beside it): one step trains with the 49,152-token vocabulary; a student with another
    tokenizer (the built-in character one) is refused in one line before any weights load."""
    from rlcore.models.policy import load_model, load_tokenizer
    from tests.real_model import smollm2_gguf

    gguf = smollm2_gguf()
    student = load_model(str(gguf))
    student.model.layers = student.model.layers[:6]
    student.config.num_hidden_layers = 6
    if getattr(student.config, "layer_types", None):
        student.config.layer_types = student.config.layer_types[:6]
    student.save_pretrained(tmp_path / "student")
    load_tokenizer(str(gguf)).save_pretrained(tmp_path / "student")
    task = ["--data.train-files", "reasoning_gym:chain_sum?max_terms=2&max_digits=1&answer=last",
            "--data.builtin-train-size", "8", "--data.batch-size", "2", "--rollout.n", "2", "--rollout.max-tokens", "16",
            "--trainer.steps", "1", "--trainer.val-every", "0", "--log.no-progress", "--optim.lr", "3e-5"]  # fmt: skip
    ok(train("distill", "--model.path", str(tmp_path / "student"), "--algo.teacher", str(gguf), *task,
             out=tmp_path / "run", timeout=600))  # fmt: skip
    first = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert first["teacher/reverse_kl"] > 0.1 and first["actor/grad_norm"] > 0
    proc = train(
        "distill", "--model.path", "builtin:tiny", "--algo.teacher", str(gguf), *task, out=tmp_path / "bad"
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: --algo.teacher {gguf}: its vocabulary differs"), (
        lines
    )

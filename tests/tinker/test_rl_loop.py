"""docs/tinker.md's Tinker loop, written the way the Tinker cookbook writes RL (sample -> reward -> advantages ->
forward_backward with importance_sampling -> optim_step), run with the real SDK against a real server, learns the
default task as `python train.py` does: the greedy validation of both, run here side by side on the same 128
validation rows, ends within 0.03 (train.py's default run: 0.233 -> 0.993). examples/tinker_rl.py runs too."""

from __future__ import annotations

import importlib.util
import re

from rlcore.data.tasks import generate_rows
from rlcore.trainer.logger import read_metrics
from tests.smoke.test_train import ok, train
from tests.tinker.server import ROOT, Recorded, running


def readme_loop() -> str:
    text = (ROOT / "docs" / "tinker.md").read_text()
    return re.search(r"<!-- tinker-loop -->\n```python\n(.*?)```", text, re.DOTALL).group(1)


def example():
    spec = importlib.util.spec_from_file_location("tinker_rl", ROOT / "examples" / "tinker_rl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_loop_learns_the_default_task_as_train_py_does(tmp_path, monkeypatch):
    loop = example()
    with running(tmp_path / "server") as url:
        monkeypatch.setenv("TINKER_BASE_URL", url)
        monkeypatch.setenv("TINKER_API_KEY", "tml-rlcore-tests")
        monkeypatch.setattr("tinker.ServiceClient", Recorded)  # closed with the server
        names: dict = {}
        exec(compile(readme_loop(), "docs/tinker.md", "exec"), names)
        sampler = names["training"].save_weights_and_get_sampling_client().result()
        after = loop.validate(sampler, names["tokenizer"], generate_rows("reverse", "val", 128), 12)
        before, _, seconds = loop.main(2, val_rows=128)  # the example: a fresh model, 2 steps
    assert len(seconds) == 2
    ok(train("--log.no-progress", out=tmp_path / "train"))
    vals = [r["val/reward_mean"] for r in read_metrics(tmp_path / "train" / "metrics.jsonl") if "val/reward_mean" in r]
    assert abs(before - vals[0]) < 1e-6  # the same model, rows and greedy decoding: the same starting score
    assert abs(after - vals[-1]) <= 0.03 and after > 0.9, (before, after, vals)

"""A run built from the library's specs alone (examples/library_step.py): the policy (`rlcore.models.build`),
its AdamW state (`rlcore.step.optim`) and the native engine (`rlcore.rollout.build`), then two whole
`train_step`s with Handles, an Algorithm and a StepPlan written out. No Config anywhere, and neither the
example nor the builders import `configs` or the trainer."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlcore.dist.mesh import DistInfo
from rlcore.dist.placement import place
from rlcore.models.build import build_policy
from rlcore.models.specs import ModelSpec, SpecError

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, SAMPLES, TOKENS = 4, 4, 8


def example():
    spec = importlib.util.spec_from_file_location("library_step", ROOT / "examples" / "library_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_train_steps_of_a_policy_optimizer_and_engine_built_from_specs(tmp_path):
    """examples/library_step.py: two GRPO steps, with a stage of its own, from specs alone."""
    library_step = example()
    state, metrics = library_step.main(2, tmp_path)
    assert state.step == 2 and state.actor.step == 2 and state.policy_version == 2
    assert all(math.isfinite(m["actor/pg_loss"]) for m in metrics), metrics
    assert state.actor.optimizer.param_groups[0]["lr"] == 1e-2  # the spec's rate, constant
    fresh = build_policy(library_step.MODEL, place(DistInfo(rank=0, world_size=1, local_rank=0,
                                                            device=torch.device("cpu")))).state_dict()  # fmt: skip
    changed = [k for k, v in state.actor.model.state_dict().items() if not torch.equal(v, fresh[k])]
    assert changed, "two updates left every weight as it was"


def test_a_spec_with_no_model_behind_it_names_its_path():
    with pytest.raises(SpecError, match="builtin:nothing") as caught:
        build_policy(ModelSpec(path="builtin:nothing"), place(DistInfo(rank=0, world_size=1, local_rank=0,
                                                                       device=torch.device("cpu"))))  # fmt: skip
    assert caught.value.field == "path"


def test_the_lora_spec_gives_the_adapter_keywords():
    spec = ModelSpec(path="builtin:tiny", lora_rank=4, lora_alpha=8.0, lora_targets=("q_proj",))
    assert spec.lora() == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ("q_proj",)}
    assert dataclasses.replace(spec, lora_rank=0).lora() is None


def test_the_builders_and_the_tinker_model_import_neither_the_config_nor_the_trainer():
    script = ("import sys; sys.path.insert(0, 'examples'); import library_step, rlcore.models.build, "
              "rlcore.rollout.build, rlcore.step.optim, rlcore.step.train_step, rlcore.tinker.model; "
              "print(sorted(m for m in sys.modules if m == 'configs' or "
              "m.startswith(('rlcore.trainer', 'rlcore.config.'))))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]

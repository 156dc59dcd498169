"""A run built from the library's specs alone: the policy (`rlcore.models.build`), its AdamW state
(`rlcore.step.optim`) and the native engine (`rlcore.rollout.build`), then two whole `train_step`s with
Handles, an Algorithm and a StepPlan written out here. No Config anywhere, and the builders import neither
`configs` nor the trainer."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from rlcore.algorithm import Algorithm
from rlcore.batch import Batch
from rlcore.data.dataset import PromptDataset
from rlcore.data.rows import row_from_dict
from rlcore.data.tasks import generate_rows
from rlcore.dist.mesh import DistInfo
from rlcore.dist.placement import place
from rlcore.models.build import build_policy, load_tokenizer_of
from rlcore.models.specs import EngineSpec, ModelSpec, SpecError
from rlcore.plan import ForwardPlan, RolloutPlan, Schedule, StepPlan, UpdatePlan
from rlcore.pure.advantages import ESTIMATORS
from rlcore.pure.losses import POLICY_LOSSES
from rlcore.rewards.pool import RewardScorer
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.build import build_engine
from rlcore.rollout.native.engine import NativeEngine
from rlcore.state import TrainState
from rlcore.step.handles import Handles
from rlcore.step.optim import OptimizerSpec, model_state
from rlcore.step.train_step import train_step
from rlcore.step.transport import Colocated

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, SAMPLES, TOKENS = 4, 4, 8


class Discard:
    """A metrics and samples sink that keeps nothing."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def begin(self, step: int) -> None: ...
    def close(self) -> None: ...
    def write(self, step: int, batch: Batch, *, validation: bool = False) -> None: ...


def test_two_train_steps_of_a_policy_optimizer_and_engine_built_from_specs(tmp_path):
    spec = ModelSpec(path="builtin:tiny", seed=0)
    placement = place(DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    tokenizer = load_tokenizer_of(spec)
    model = build_policy(spec, placement)
    actor = model_state(model, OptimizerSpec(lr=1e-2), total_updates=2)
    engine = build_engine(spec, EngineSpec(kind="native"), model, tokenizer, placement.local)
    assert isinstance(engine, NativeEngine) and engine.module is model  # one process: it samples the policy
    rows = [row_from_dict(r, f"row {i}") for i, r in enumerate(generate_rows("reverse", "train", 8, seed=0))]
    scorer = RewardScorer(data_sources=["builtin/reverse"])
    handles = Handles(out_dir=tmp_path, placement=placement, dist=placement.local, mesh=placement.mesh,
                      tokenizer=tokenizer, train_ds=PromptDataset(rows, tokenizer, seed=0), val_ds=None,
                      scorer=scorer, engine=engine, ref_model=None, logger=Discard(), samples=Discard(),
                      transport=Colocated())  # fmt: skip
    algorithm = Algorithm(advantage_fn=ESTIMATORS["grpo"], loss_agg="token-mean", on_policy=True,
                          policy_loss_fn=partial(POLICY_LOSSES["ppo_clip"], agg="token-mean"))  # fmt: skip
    plan = StepPlan(forward=ForwardPlan(micro_batch_size=16), actor=UpdatePlan(micro_batch_size=16),
                    critic=UpdatePlan(), horizon=TOKENS, batch_size=PROMPTS, seed=0,
                    rollout=RolloutPlan(sampling=SamplingParams(n=SAMPLES, max_tokens=TOKENS)),
                    schedule=Schedule(steps=2, sync_bucket_bytes=EngineSpec().bucket_bytes))  # fmt: skip
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = TrainState(actor=actor)
    try:
        for _ in range(2):
            state, metrics = train_step(state, handles, algorithm, plan)
            assert math.isfinite(metrics["actor/pg_loss"]), metrics
    finally:
        scorer.close()
    assert state.step == 2 and state.actor.step == 2 and state.policy_version == 2
    assert state.actor.optimizer.param_groups[0]["lr"] == 1e-2  # the spec's rate, constant
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
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
    script = ("import sys, rlcore.models.build, rlcore.rollout.build, rlcore.step.optim, rlcore.step.train_step, "
              "rlcore.tinker.model; print(sorted(m for m in sys.modules if m == 'configs' or "
              "m.startswith(('rlcore.trainer', 'rlcore.config.'))))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]

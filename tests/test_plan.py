"""A StepPlan and handles built by hand, without `configs` (issue 33): two GRPO steps of the built-in
model composed from the library's steps and the shell's `learn`, then two more through the whole
`train_step` (rollout, rewards, learning, the push into the engine, through the colocated transport),
in a process that never imports the config module (nothing under the step reads a config)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import dataclasses, sys
from functools import partial

import torch

from rlcore.algorithm import Algorithm
from rlcore.data.dataset import PromptDataset
from rlcore.data.rows import row_from_dict
from rlcore.data.tasks import generate_rows
from rlcore.dist.mesh import DistInfo
from rlcore.models import load_policy
from rlcore.plan import ForwardPlan, StepPlan
from rlcore.pure.advantages import ESTIMATORS
from rlcore.pure.losses import POLICY_LOSSES
from rlcore.rewards.pool import RewardScorer
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.native.engine import NativeEngine
from rlcore.state import TrainState
from rlcore.step.steps import rollout_step, score_step
from rlcore.step.faults import Hooks
from rlcore.step.learn import learn
from rlcore.plan import UpdatePlan
from rlcore.state import ModelState
from rlcore.step.update import build_optimizer, build_scheduler


@dataclasses.dataclass(frozen=True)
class Handles:  # what `learn` uses: this process, no mesh, no reference model
    dist: DistInfo = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    mesh: None = None
    ref_model: None = None
    hooks: Hooks = Hooks()  # no test faults


torch.manual_seed(0)
model, tokenizer = load_policy("builtin:tiny-reverse")
rows = [row_from_dict(r, f"row {i}") for i, r in enumerate(generate_rows("reverse", "train", 8, seed=0))]
prompts = PromptDataset(rows, tokenizer, seed=0)
algorithm = Algorithm(advantage_fn=ESTIMATORS["grpo"], policy_loss_fn=partial(POLICY_LOSSES["ppo_clip"], agg="token-mean"),
                      loss_agg="token-mean", on_policy=True)
plan = StepPlan(forward=ForwardPlan(temperature=1.0, micro_batch_size=16), actor=UpdatePlan(micro_batch_size=16),
                critic=UpdatePlan(), horizon=8, batch_size=4, seed=0)
optimizer = build_optimizer(model, lr=1e-3)
state = TrainState(actor=ModelState(model=model, optimizer=optimizer,
                                    scheduler=build_scheduler(optimizer, total_updates=2)))
engine, scorer = NativeEngine(model, tokenizer), RewardScorer(data_sources=["builtin/reverse"])
before = {k: v.clone() for k, v in model.state_dict().items()}
for step in (1, 2):
    drawn, cursor = prompts.take(state.cursor, plan.batch_size)
    batch, _ = rollout_step(engine, drawn, SamplingParams(n=4, max_tokens=plan.horizon, seed=step))
    batch, _ = score_step(scorer, batch, tokenizer=tokenizer)
    state, metrics, batch = learn(dataclasses.replace(state, cursor=cursor), Handles(), algorithm, plan, batch)
    state = dataclasses.replace(state, step=step)
    assert torch.isfinite(torch.as_tensor(metrics["actor/pg_loss"])), metrics
    assert batch["advantages"].abs().sum() > 0  # the groups had a signal to learn from
scorer.close()
changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
assert changed and state.step == 2 and state.actor.step == 2, (changed, state.step, state.actor.step)
assert "configs" not in sys.modules, "a step module imported the config"

# the whole step: real Handles (typed, no config), the colocated transport, a plan with its rollout part
from pathlib import Path
import tempfile
from rlcore.dist.mesh import DistInfo as Info
from rlcore.dist.placement import place
from rlcore.plan import RolloutPlan, Schedule
from rlcore.step.handles import Handles as RunHandles
from rlcore.trainer.logger import MetricsLogger
from rlcore.trainer.samples import SampleWriter
from rlcore.step.train_step import train_step
from rlcore.step.transport import Colocated

out = Path(tempfile.mkdtemp())
placement = place(Info(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
scorer = RewardScorer(data_sources=["builtin/reverse"])
handles = RunHandles(out_dir=out, placement=placement, dist=placement.local, mesh=placement.mesh,
                     tokenizer=tokenizer, train_ds=prompts, val_ds=None, scorer=scorer, engine=engine,
                     ref_model=None, logger=MetricsLogger(out, total_steps=4, enabled=False),
                     samples=SampleWriter(out, tokenizer, k=0), transport=Colocated())
plan = dataclasses.replace(plan, rollout=RolloutPlan(sampling=SamplingParams(n=4, max_tokens=plan.horizon)),
                           schedule=Schedule(steps=4, sync_bucket_bytes=2**20))
before = {k: v.clone() for k, v in model.state_dict().items()}
expect = prompts.take(prompts.take(state.cursor, 4)[1], 4)[1]  # two more batches of 4 prompts
for _ in (3, 4):
    state, metrics = train_step(state, handles, algorithm, plan)
    assert torch.isfinite(torch.as_tensor(metrics["actor/pg_loss"])), metrics
    assert metrics["sync/bytes"] == 0.0  # the native engine samples from the trained module itself
scorer.close()
changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
assert changed and state.step == 4 and state.actor.step == 4 and state.policy_version == 2, (state.step, state.actor.step)
assert state.cursor == expect, (state.cursor, expect)
assert "configs" not in sys.modules, "a step module imported the config"
print("ok", len(changed))
"""


def test_two_grpo_steps_from_a_plan_built_by_hand_never_import_the_config():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]

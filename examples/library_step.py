"""The library without the trainer: a policy, its AdamW state and a native engine built from specs, then GRPO
steps through `train_step`, with a stage of your own in the learn chain (scores clipped to [-1, 1]):

    .venv/bin/python examples/library_step.py            # 2 steps on the built-in reverse task, a few seconds

No Config, no command line: what train.py binds from flags is written out here.
"""

import dataclasses
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

from rlcore.algorithm import Algorithm, Stage
from rlcore.data.dataset import PromptDataset
from rlcore.data.rows import row_from_dict
from rlcore.data.tasks import generate_rows
from rlcore.dist.mesh import DistInfo
from rlcore.dist.placement import place
from rlcore.models.build import build_policy, load_tokenizer_of
from rlcore.models.specs import EngineSpec, ModelSpec
from rlcore.plan import ForwardPlan, RolloutPlan, Schedule, StepPlan, UpdatePlan
from rlcore.pure.advantages import ESTIMATORS
from rlcore.pure.losses import POLICY_LOSSES
from rlcore.rewards.pool import RewardScorer
from rlcore.rollout import SamplingParams
from rlcore.rollout.build import build_engine
from rlcore.state import TrainState
from rlcore.step.handles import Handles
from rlcore.step.optim import OptimizerSpec, model_state
from rlcore.step.stages import Ctx, stages_of, with_stage
from rlcore.step.train_step import train_step
from rlcore.step.transport import Colocated

MODEL = ModelSpec(path="builtin:tiny", seed=0)
PROMPTS, SAMPLES, TOKENS = 4, 4, 8


class Discard:
    """Metrics and samples go nowhere (train.py writes metrics.jsonl and samples.jsonl)."""

    def log(self, step, metrics): ...
    def begin(self, step): ...
    def close(self): ...
    def write(self, step, batch, *, validation=False): ...


def clip_scores(ctx: Ctx) -> Ctx:
    scores = ctx.batch["token_scores"].clamp(-1.0, 1.0)
    return ctx.with_(batch=ctx.batch.with_(token_scores=scores, overwrite=True))


def main(steps: int = 2, out_dir: Path | None = None) -> tuple[TrainState, list[dict[str, float]]]:
    placement = place(DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    tokenizer, policy = load_tokenizer_of(MODEL), build_policy(MODEL, placement)
    engine = build_engine(MODEL, EngineSpec(kind="native"), policy, tokenizer, placement.local)
    rows = [row_from_dict(r, f"row {i}") for i, r in enumerate(generate_rows("reverse", "train", 64, seed=0))]
    scorer = RewardScorer(data_sources=["builtin/reverse"])
    h = Handles(out_dir=out_dir or Path(tempfile.mkdtemp()), placement=placement, dist=placement.local,
                mesh=placement.mesh, tokenizer=tokenizer, train_ds=PromptDataset(rows, tokenizer, seed=0), val_ds=None,
                scorer=scorer, engine=engine, ref_model=None, logger=Discard(), samples=Discard(),
                transport=Colocated())  # fmt: skip
    plan = StepPlan(forward=ForwardPlan(micro_batch_size=16), actor=UpdatePlan(micro_batch_size=16),
                    critic=UpdatePlan(), horizon=TOKENS, batch_size=PROMPTS, seed=0,
                    rollout=RolloutPlan(sampling=SamplingParams(n=SAMPLES, max_tokens=TOKENS)),
                    schedule=Schedule(steps=steps, sync_bucket_bytes=EngineSpec().bucket_bytes))  # fmt: skip
    grpo = Algorithm(advantage_fn=ESTIMATORS["grpo"], loss_agg="token-mean", on_policy=True,
                     policy_loss_fn=partial(POLICY_LOSSES["ppo_clip"], agg="token-mean"))  # fmt: skip
    clip = Stage("clip_scores", frozenset({"token_scores"}), frozenset({"token_scores"}), clip_scores)
    grpo = with_stage(dataclasses.replace(grpo, stages=stages_of(grpo, plan)), clip, before="advantages")
    state, seen = TrainState(actor=model_state(policy, OptimizerSpec(lr=1e-2), total_updates=steps)), []
    try:
        for _ in range(steps):
            state, metrics = train_step(state, h, grpo, plan)
            seen.append(metrics)
            reward, norm = metrics["train/reward_mean"], metrics["actor/grad_norm"]
            print(f"step {state.step}: reward {reward:.3f}, gradient norm {norm:.3f}")
    finally:
        scorer.close()
    return state, seen


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)

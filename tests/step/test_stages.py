"""The learn chain (rlcore.step.stages): the stages each algorithm binds, the need check, a stage of one's own."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from rlcore.algorithm import Algorithm, Stage
from rlcore.batch import Batch
from rlcore.config.defaults import resolve
from rlcore.plan import ForwardPlan, StepPlan, UpdatePlan
from rlcore.pure.advantages import ESTIMATORS
from rlcore.pure.losses import POLICY_LOSSES
from rlcore.state import TrainState
from rlcore.step.faults import Hooks
from rlcore.step.learn import learn
from rlcore.step.stages import Ctx, check_chain, given, rollout_old_logprobs, stages_of, with_stage
from rlcore.trainer.algorithm import bind
from rlcore.trainer.cli import parse

PLAN = StepPlan(forward=ForwardPlan(), actor=UpdatePlan(), critic=UpdatePlan(), horizon=4, batch_size=3)


def bound(*argv: str) -> Algorithm:
    algorithm, _ = bind(resolve(parse(list(argv))))
    return algorithm


def names(algorithm: Algorithm) -> list[str]:
    return [s.name for s in algorithm.stages]


def test_grpo_is_on_policy_advantages_then_the_update():
    # one update per step, no KL: the update's own forward gives the old log-probs, so no pass of its own
    assert names(bound("grpo")) == ["advantages", "actor_update"]


def test_ppo_has_the_critic_values_before_the_advantages_and_its_update_before_the_actor():
    algorithm = bound("ppo")
    assert names(algorithm) == ["values", "advantages", "critic_update", "actor_update"]
    assert "values" in algorithm.stages[1].needs  # GAE reads V(s_t)


def test_distillation_scores_with_the_teacher_after_the_old_logprobs():
    algorithm = bound("grpo", "--algo.teacher", "builtin:tiny-reverse")
    assert names(algorithm) == ["old_logprobs", "teacher_logprobs", "advantages", "actor_update"]
    assert {"old_logprobs", "teacher_logprobs"} <= algorithm.stages[2].needs


def test_bypass_takes_the_rollout_logprobs_as_the_old_ones():
    algorithm = bound("grpo", "--algo.bypass")
    assert names(algorithm) == ["old_logprobs", "advantages", "actor_update"]
    assert algorithm.stages[0].run is rollout_old_logprobs
    assert algorithm.stages[0].needs == {"rollout_logprobs"}


def test_a_rollout_correction_runs_between_the_old_logprobs_and_the_advantages():
    algorithm = bound("grpo", "--algo.rollout-is", "token")
    assert names(algorithm) == ["old_logprobs", "correction", "advantages", "actor_update"]
    assert algorithm.stages[1].makes == {"response_mask", "is_weights"}  # IS weights: decoupled PPO
    assert "is_weights" in algorithm.stages[3].needs


def test_an_adaptive_kl_reads_the_reference_and_moves_the_coefficient_last():
    algorithm = bound("grpo", "--algo.kl-coef", "0.1", "--algo.kl-ctrl", "adaptive")
    assert names(algorithm) == ["old_logprobs", "ref_logprobs", "advantages", "actor_update", "kl_controller"]


def test_a_need_no_stage_makes_is_refused_in_one_line():
    algorithm = bound("grpo")
    wants_values = Stage("mine", needs=frozenset({"values"}), makes=frozenset(), run=lambda ctx: ctx)
    with pytest.raises(ValueError) as e:
        with_stage(algorithm, wants_values, before="advantages")
    assert str(e.value) == (
        "learn stage 'mine' needs values: neither the rollout, the state nor an earlier stage (none) makes it"
    )
    late = check_chain([*algorithm.stages, wants_values], given(algorithm) | {"values"})  # given: accepted
    assert [s.name for s in late][-1] == "mine"


def test_a_stage_after_the_critic_warm_up_does_not_run():
    ran: list[str] = []

    def record(name: str, *, done: bool = False) -> Stage:
        def run(ctx: Ctx) -> Ctx:
            ran.append(name)
            return ctx.with_(done=done)

        return Stage(name, frozenset(), frozenset(), run)

    algorithm = dataclasses.replace(ALGORITHM, stages=(record("a"), record("b", done=True), record("c")))
    learn(TrainState(actor=None), Passes(), algorithm, PLAN, BATCH)
    assert ran == ["a", "b"]


@dataclasses.dataclass(frozen=True)
class Passes:  # what the advantages stage uses of the handles: no test faults
    hooks: Hooks = dataclasses.field(default_factory=Hooks)


ALGORITHM = Algorithm(
    advantage_fn=partial(ESTIMATORS["grpo"], norm_by_std=False),
    policy_loss_fn=partial(POLICY_LOSSES["ppo_clip"], agg="token-mean"),
    on_policy=True,
)
BATCH = Batch.from_dict({
    "token_scores": torch.tensor([[0.0, 3.0], [0.0, 0.0], [0.0, -1.0]], dtype=torch.float64),
    "response_mask": torch.ones(3, 2),
    "uid": ["p", "p", "p"],  # one prompt's three samples
})  # fmt: skip


def clip_scores(ctx: Ctx) -> Ctx:
    scores = ctx.batch["token_scores"].clamp(-1.0, 1.0)
    return ctx.with_(batch=ctx.batch.with_(token_scores=scores, overwrite=True))


def test_a_stage_of_ones_own_runs_where_it_is_inserted():
    mine = Stage("clip_scores", needs=frozenset({"token_scores"}), makes=frozenset({"token_scores"}),
                 run=clip_scores)  # fmt: skip
    algorithm = dataclasses.replace(ALGORITHM, stages=stages_of(ALGORITHM, PLAN))
    algorithm = with_stage(algorithm, mine, before="advantages")
    assert names(algorithm) == ["clip_scores", "advantages", "actor_update"]
    algorithm = dataclasses.replace(algorithm, stages=algorithm.stages[:2])  # up to the advantages (no model)
    _, _, batch = learn(TrainState(actor=None), Passes(), algorithm, PLAN, BATCH)
    # scores 3, 0, -1 clipped to 1, 0, -1: the group's mean is 0, so A = s - 0 (unclipped: 7/3, -2/3, -5/3)
    expected = torch.tensor([[1.0, 1.0], [0.0, 0.0], [-1.0, -1.0]], dtype=torch.float64)
    torch.testing.assert_close(batch["advantages"], expected, rtol=0, atol=1e-12)

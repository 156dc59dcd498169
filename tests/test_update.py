"""rlcore.step.update in one process: update_step against a loss assembled by hand from rlcore.pure.

The reference runs the whole batch through the model once (no micro-batches, no trimming), builds
the loss from `rlcore.pure` (policy loss + KL loss - entropy bonus), backpropagates, and takes the
same AdamW step on a copy of the model. update_step (4-row micro-batches) must give the same
metrics and weights. float64 model; eps 1e-3 so that Adam's first step is proportional to the
gradient (with eps -> 0 it is lr * sign(g), blind to the gradient's scale).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from configs import AlgoConfig, OptimConfig
from rlcore.dist import apply_activation_checkpointing
from rlcore.models import load_policy
from rlcore.pure.kl import kl_estimate
from rlcore.pure.losses import POLICY_LOSSES, aggregate, entropy
from rlcore.pure.masks import masked_mean
from rlcore.step.update import SAVED_KEY, lr_factor
from tests.configured import new_state, update
from tests.dist.rollouts import fake_rollout, with_logprobs

HORIZON = 12
OPTIM = OptimConfig(lr=1e-2, eps=1e-3, grad_clip=0.0)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    model, _ = load_policy("builtin:tiny", dtype=torch.float64)
    batch = with_logprobs(model, fake_rollout(3, 4, max_prompt=6, max_response=HORIZON, seed=4))
    batch = batch.with_(advantages=batch["advantages"].double(), overwrite=True)
    return model, batch


def _state(model, optim=OPTIM, total=10):
    return new_state(model, optim, total)


def _hand_loss(model, batch, algo: AlgoConfig, temperature: float):
    """(loss, pieces) for the whole batch in one untrimmed forward, from rlcore.pure only."""
    ids = torch.cat([batch["input_ids"], batch["responses"]], dim=1)
    attn = torch.cat([batch["attention_mask"], batch["response_attention"].long()], dim=1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    p = batch["input_ids"].shape[1]
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, p - 1 : -1] / temperature
    logprob = torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None])[..., 0]  # (b, t)
    mask = batch["response_mask"]
    old = batch["old_logprobs"]
    is_weights = torch.exp(old - batch["rollout_logprobs"]).clamp(max=algo.tis_cap)
    pg_loss, pg_metrics = POLICY_LOSSES[algo.policy_loss](
        logprob, old, batch["advantages"], mask, agg=algo.loss_agg, clip_low=algo.clip_low,
        clip_high=algo.clip_high, is_weights=is_weights, horizon=HORIZON,
    )  # fmt: skip
    kl_loss = aggregate(
        kl_estimate(logprob, batch["ref_logprobs"], algo.kl_loss_kind), mask, algo.loss_agg, horizon=HORIZON
    )
    ent = entropy(logits)  # (b, t)
    ent_loss = aggregate(ent, mask, algo.loss_agg, horizon=HORIZON)
    loss = pg_loss + algo.kl_loss_coef * kl_loss - algo.entropy_coef * ent_loss
    return loss, {
        "actor/pg_loss": pg_loss,
        "actor/kl_loss": kl_loss,
        "actor/entropy": masked_mean(ent, mask),
        **{f"actor/{k}": v for k, v in pg_metrics.items()},
    }


@pytest.mark.parametrize(
    ("policy_loss", "loss_agg"),
    [("ppo_clip", "token-mean"), ("ppo_clip", "seq-mean-token-mean"), ("gspo", "token-mean")],
)
def test_update_equals_hand_assembled_loss(setup, policy_loss, loss_agg):
    base, batch = setup
    algo = AlgoConfig(
        policy_loss=policy_loss, loss_agg=loss_agg, micro_batch_size=4, use_kl_loss=True,
        kl_loss_coef=0.1, entropy_coef=0.01, tis_cap=1.5,
    )  # fmt: skip
    temperature = 0.9
    model = copy.deepcopy(base)
    state, metrics = update(_state(model), batch, algo, OPTIM, horizon=HORIZON, temperature=temperature)

    ref = copy.deepcopy(base)
    loss, pieces = _hand_loss(ref, batch, algo, temperature)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad**2).sum() for p in ref.parameters()))
    opt = torch.optim.AdamW(ref.parameters(), lr=OPTIM.lr, eps=OPTIM.eps, weight_decay=OPTIM.weight_decay)
    opt.step()

    assert metrics["actor/grad_norm"] == pytest.approx(float(grad_norm), abs=1e-6, rel=0)
    for key, value in pieces.items():
        assert metrics[key] == pytest.approx(float(value.detach()), abs=1e-6, rel=0), key
    assert metrics["actor/lr"] == OPTIM.lr and metrics["actor/bad_updates"] == 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
    assert state.step == 1


def test_dynamic_batching_and_mini_batches_match_one_update_per_mini_batch(setup):
    """Two mini-batches of 2 prompts x 4 rows... (3 prompts: 2 + 1) give the updates of two calls."""
    base, batch = setup
    algo = AlgoConfig(mini_batch_size=2, max_tokens_per_micro_batch=30)
    model = copy.deepcopy(base)
    state, metrics = update(_state(model), batch, algo, OPTIM, horizon=HORIZON)
    assert state.scheduler.last_epoch == 2  # two optimizer updates
    ref = copy.deepcopy(base)
    ref_state = _state(ref)
    one = dataclasses.replace(algo, mini_batch_size=None)
    ref_state, m1 = update(ref_state, batch[:8], one, OPTIM, horizon=HORIZON)  # prompts u0, u1
    ref_state, m2 = update(ref_state, batch[8:], one, OPTIM, horizon=HORIZON)  # prompt u2
    assert metrics["actor/pg_loss"] == pytest.approx(
        (m1["actor/pg_loss"] + m2["actor/pg_loss"]) / 2, abs=1e-9
    )
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-9, rtol=0)


def test_nan_advantage_skips_the_step_and_counts_it(setup):
    base, batch = setup
    model = copy.deepcopy(base)
    adv = batch["advantages"].clone()
    kept = (batch["response_mask"] != 0).nonzero()[0]
    adv[kept[0], kept[1]] = float("nan")  # on a token that counts
    state = _state(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new, metrics = update(state, batch.with_(advantages=adv, overwrite=True), AlgoConfig(), OPTIM, horizon=12)
    assert metrics["actor/bad_updates"] == 1.0 and new.bad_updates == 1
    assert math.isnan(metrics["actor/pg_loss"])  # no good update to average
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not state.optimizer.state and all(p.grad is None for p in model.parameters())
    # a NaN where the mask is 0 is never read: that update steps, and the bad streak resets
    masked_adv = batch["advantages"].clone()
    masked_adv[batch["response_mask"] == 0] = float("nan")
    new, metrics = update(
        new, batch.with_(advantages=masked_adv, overwrite=True), AlgoConfig(), OPTIM, horizon=12
    )
    assert (
        metrics["actor/bad_updates"] == 0.0
        and new.bad_updates == 0
        and math.isfinite(metrics["actor/pg_loss"])
    )
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_state_is_replaced_not_mutated(setup):
    base, batch = setup
    state = _state(copy.deepcopy(base))
    new, _ = update(state, batch, AlgoConfig(), OPTIM, horizon=HORIZON)
    assert new is not state and state.step == 0 and new.step == 1
    assert new.model is state.model and new.optimizer is state.optimizer  # handles carried over
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.step = 5  # type: ignore[misc]


def test_missing_fields_and_bad_mini_batch_size_are_clear_errors(setup):
    base, batch = setup
    state = _state(copy.deepcopy(base))
    with pytest.raises(ValueError, match=r"ref_logprobs.*--algo.use-kl-loss"):
        update(state, batch.select("input_ids", "attention_mask", "responses", "response_attention",
                                        "response_mask", "old_logprobs", "advantages"),
                    AlgoConfig(use_kl_loss=True), OPTIM, horizon=HORIZON)  # fmt: skip
    with pytest.raises(ValueError, match="mini-batch-size 0"):
        update(state, batch, AlgoConfig(mini_batch_size=0), OPTIM, horizon=HORIZON)


def test_learning_rate_schedule_by_hand():
    warm = dict(warmup=4, total=14, min_ratio=0.1)
    assert [lr_factor(u, schedule="constant", **warm) for u in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # cosine after warm-up: progress (u - 4) / 10; halfway (u = 9): 0.1 + 0.9 * (1 + cos(pi / 2)) / 2
    assert lr_factor(9, schedule="cosine", **warm) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(4, schedule="cosine", **warm) == pytest.approx(1.0)
    assert lr_factor(14, schedule="cosine", **warm) == pytest.approx(0.1)
    assert lr_factor(99, schedule="cosine", **warm) == pytest.approx(0.1)  # stays at the floor
    model = torch.nn.Linear(2, 2)
    optim = OptimConfig(lr=0.2, warmup_steps=2)
    state = new_state(model, optim, 10)
    opt, sched = state.optimizer, state.scheduler
    lrs = []
    for _ in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.1, 0.2, 0.2])
    import json

    json.dumps(sched.state_dict())  # JSON-able, for the checkpoint's extra state


def test_activation_checkpointing_changes_nothing_but_memory(setup):
    base, batch = setup
    algo = AlgoConfig(micro_batch_size=6, entropy_coef=0.01)
    plain, checkpointed = copy.deepcopy(base), apply_activation_checkpointing(copy.deepcopy(base))
    _, m1 = update(_state(plain), batch, algo, OPTIM, horizon=HORIZON)
    _, m2 = update(_state(checkpointed), batch, algo, OPTIM, horizon=HORIZON)
    assert checkpointed.model.layers[0].gradient_checkpointing and not checkpointed.training
    saved = m1.pop(SAVED_KEY), m2.pop(SAVED_KEY)  # the memory the micro-batches saved for backward
    assert m1 == pytest.approx(m2, abs=1e-12)
    assert 0 < saved[1] < saved[0] / 4, saved
    for p, q in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=0)


def test_on_policy_update_without_old_logprobs_equals_the_one_with_them(setup):
    """One update per step: the update's own detached log-probs stand in for old_logprobs (the separate
    no-grad pass the trainer skips), with the same weights and metrics, and it reports the rollout gap."""
    base, batch = setup
    from rlcore.models.forward import compute_logprobs

    exact, _ = compute_logprobs(base, batch)  # the current policy's log-probs: ratio 1
    with_old = batch.with_(old_logprobs=exact.double(), overwrite=True)
    algo = AlgoConfig(micro_batch_size=4)
    a, ma = update(_state(copy.deepcopy(base)), with_old, algo, OPTIM, horizon=HORIZON)
    no_old = batch.select(*(k for k in batch.keys() if k != "old_logprobs"))  # noqa: SIM118
    b, mb = update(_state(copy.deepcopy(base)), no_old, algo, OPTIM, horizon=HORIZON)
    # the log-probs are float32 (token_logprobs): two passes differ in the last bits, no more
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac"):
        assert mb[key] == pytest.approx(ma[key], abs=1e-6), key
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0)
    mask = batch["response_mask"].bool()
    gap = (exact.double() - batch["rollout_logprobs"]).abs()[mask]
    assert mb["rollout/logprob_diff_mean"] == pytest.approx(float(gap.mean()), abs=1e-6)
    assert mb["rollout/logprob_diff_max"] == pytest.approx(float(gap.max()), abs=1e-6)
    with pytest.raises(ValueError, match="on-policy"):  # two epochs need the old policy's log-probs
        update(_state(copy.deepcopy(base)), no_old, AlgoConfig(ppo_epochs=2),
                    OPTIM, horizon=HORIZON)  # fmt: skip


def test_clip_cov_draws_new_tokens_every_step_and_the_same_on_a_rerun(setup, monkeypatch):
    """clip_cov samples which tokens to clip from the generator update_step gives it: seeded from
    (seed, step), so step 2 draws other keys than step 1 (before issue 15: Generator(0) every call),
    and a rerun of a step (a resume) draws the same."""
    import functools

    base, batch = setup
    real = POLICY_LOSSES["clip_cov"]
    draws: list[torch.Tensor] = []

    @functools.wraps(real)
    def recording(*args, generator=None, **kwargs):
        probe = torch.Generator(device=generator.device)
        probe.set_state(generator.get_state())
        draws.append(torch.rand(16, generator=probe, dtype=torch.float64))  # the keys clip_cov draws first
        return real(*args, generator=generator, **kwargs)

    monkeypatch.setitem(POLICY_LOSSES, "clip_cov", recording)
    algo = AlgoConfig(policy_loss="clip_cov")
    state = _state(copy.deepcopy(base))
    state, _ = update(state, batch, algo, OPTIM, horizon=HORIZON, seed=3)
    update(state, batch, algo, OPTIM, horizon=HORIZON, seed=3)
    update(dataclasses.replace(state, step=0), batch, algo, OPTIM, horizon=HORIZON, seed=3)
    first, second, rerun = draws
    assert not torch.equal(first, second)
    assert torch.equal(first, rerun)


def test_decoupled_is_weights_from_the_correction_step_scale_the_loss(setup):
    """correction_step's is_weights reach the policy loss: with every weight 2 the token-mean loss and
    its gradient double (the same update as tis_cap with weights of 2)."""
    from rlcore.step.steps import correction_step

    base, batch = setup
    shifted = batch.with_(rollout_logprobs=batch["old_logprobs"] - math.log(2.0), overwrite=True)
    corrected, metrics = correction_step(shifted, is_level="token", is_cap=5.0)
    assert metrics["rollout_corr/is_mean"].item() == pytest.approx(2.0, rel=1e-6)
    weights = corrected["is_weights"]
    torch.testing.assert_close(weights, 2.0 * batch["response_mask"].to(weights.dtype))
    _, plain = update(_state(copy.deepcopy(base)), batch, AlgoConfig(), OPTIM, horizon=HORIZON)
    decoupled = AlgoConfig(rollout_is="token", rollout_is_cap=5.0)  # Algorithm.correction_weights
    _, weighted = update(_state(copy.deepcopy(base)), corrected, decoupled, OPTIM, horizon=HORIZON)
    _, unweighted = update(_state(copy.deepcopy(base)), corrected, AlgoConfig(), OPTIM, horizon=HORIZON)
    assert unweighted["actor/pg_loss"] == pytest.approx(plain["actor/pg_loss"], rel=1e-6)  # not asked for
    assert weighted["actor/pg_loss"] == pytest.approx(2.0 * plain["actor/pg_loss"], rel=1e-6)
    assert weighted["actor/grad_norm"] == pytest.approx(2.0 * plain["actor/grad_norm"], rel=1e-6)


def test_rejection_and_veto_remove_units_from_the_mask(setup):
    from rlcore.step.steps import correction_step

    _, batch = setup
    mask = batch["response_mask"]
    gap = torch.zeros_like(batch["old_logprobs"])
    gap[0, 0] = math.log(10.0)  # one token of row 0 ten times likelier under the trainer
    shifted = batch.with_(rollout_logprobs=batch["old_logprobs"] - gap, overwrite=True)
    token, _ = correction_step(shifted, rs_level="token", rs_upper=2.0)
    expected = mask.clone()
    expected[0, 0] = 0
    torch.testing.assert_close(token["response_mask"], expected)
    seq, m = correction_step(shifted, rs_level="sequence", rs_upper=2.0, veto=0.5)
    expected = mask.clone()
    expected[0] = 0  # the whole row
    torch.testing.assert_close(seq["response_mask"], expected)
    assert m["rollout_corr/veto_fraction"].item() == 0.0  # no ratio below 0.5

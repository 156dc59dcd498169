"""One update on 2 FSDP2 ranks (gloo) equals the same update in one process with the plain module.

All scenarios run in one spawn (the ranks' start-up dominates). The one-process reference uses a
different micro-batch split than the ranks, so equality also shows independence from the split.
Compared: actor/pg_loss, actor/grad_norm and every parameter after the step(s), fp32, <= 1e-6.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from configs import AlgoConfig, OptimConfig
from rlcore.batch import Batch
from rlcore.models import load_policy
from rlcore.models.forward import compute_logprobs, model_inputs
from rlcore.models.moe import own_routes, routers
from tests.dist import workers
from tests.dist.rollouts import fake_rollout, with_logprobs

N = 3  # samples per prompt
PROMPTS = 4
HORIZON = 12
# eps 1e-3: Adam's first step is lr g / (|g| + eps); with the default 1e-8 it is ~lr sign(g), blind to
# the gradient's scale and, near g = 0, amplifying fp32 round-off of the gradient (~1e-10) by lr / eps.
# A large eps makes the step proportional to the gradient, so the weights check the gradient itself.
OPTIM = OptimConfig(lr=1e-2, eps=1e-3)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread: on a shared 2-core machine, 2 OpenMP threads stall badly in backward."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SCENARIOS = [
    # token-mean, one mini-batch; ranks: 2-row micro-batches, reference: one micro-batch
    dict(name="token_mean", algo=AlgoConfig(loss_agg="token-mean", micro_batch_size=2), ref_micro=64),
    # seq-mean-token-mean, two mini-batches (two optimizer updates), uneven 2 + 1 row micro-batches
    dict(
        name="seq_mean",
        algo=AlgoConfig(loss_agg="seq-mean-token-mean", mini_batch_size=2, micro_batch_size=2),
        ref_micro=64,
    ),
    # token-budget dynamic batching with every loss term (KL loss, entropy bonus, TIS) and 2 epochs;
    # reference: fixed 5-row micro-batches
    dict(
        name="dynamic",
        algo=AlgoConfig(
            loss_agg="token-mean",
            micro_batch_size=64,
            max_tokens_per_micro_batch=40,
            use_kl_loss=True,
            entropy_coef=0.01,
            tis_cap=2.0,
            ppo_epochs=2,
        ),
        ref_micro=5,
    ),
    # LoRA: frozen base parameters sharded with the trained adapters (the same seeded init on every rank)
    dict(name="lora", algo=AlgoConfig(loss_agg="token-mean", micro_batch_size=2), ref_micro=64, lora=True),
    # a mixture of experts replaying recorded routes (from other router weights: many differ from the
    # trainer's own), with its load-balancing loss; that loss is a function of each forward's tokens (as
    # the model defines it), so the reference runs the ranks' micro-batches: 2 consecutive rows
    dict(name="moe", algo=AlgoConfig(loss_agg="token-mean", micro_batch_size=2, router_aux_coef=0.1),
         ref_micro=2, moe=True),  # fmt: skip
    # the same with its experts split over the 2 ranks (expert parallelism, all-to-all dispatch; with
    # activation checkpointing, so the backward's recompute runs the all-to-alls again), and with them
    # replicated over 2 groups of 1 (the gradient summed across groups, as with 4 ranks, ep 2)
    dict(name="moe_ep", algo=AlgoConfig(loss_agg="token-mean", micro_batch_size=2, router_aux_coef=0.1),
         ref_micro=2, moe=True, ep=(1, 2), checkpointing=True),  # fmt: skip
    # selective checkpointing under FSDP2: each layer keeps its products, recomputes the rest (issue 61)
    dict(name="selective", algo=AlgoConfig(loss_agg="token-mean", micro_batch_size=2), ref_micro=64,
         checkpointing="selective"),  # fmt: skip
    # LoRA on a mixture of experts: adapters on its linear layers and one pair per expert of its fused
    # expert tensors, which FSDP2 shards with the frozen base
    dict(name="moe_lora", algo=AlgoConfig(loss_agg="token-mean", micro_batch_size=2), ref_micro=2, moe=True,
         lora=True),  # fmt: skip
    dict(name="moe_ep_replicated", algo=AlgoConfig(loss_agg="token-mean", micro_batch_size=2),
         ref_micro=2, moe=True, ep=(2, 1)),  # fmt: skip
    # hybrid shard (replicate 2 x shard 1), seq-mean-token-sum-norm, gradient clipping active
    dict(
        name="hybrid",
        algo=AlgoConfig(loss_agg="seq-mean-token-sum-norm", micro_batch_size=3),
        ref_micro=64,
        replicate=2,
        optim=dataclasses.replace(OPTIM, grad_clip=0.05),
    ),
]


def _scenario(sc: dict) -> dict:
    return {"replicate": 1, "optim": OPTIM, "n": N, "horizon": HORIZON} | sc


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("update")
    model, _ = load_policy("builtin:tiny")
    batch = with_logprobs(model, fake_rollout(PROMPTS, N, max_prompt=7, max_response=HORIZON, seed=1))
    torch.save({**batch.tensors, **batch.non_tensors}, directory / "batch.pt")
    torch.save({**(moe := with_routes(batch)).tensors, **moe.non_tensors}, directory / "batch_moe.pt")
    scenarios = [_scenario(sc) for sc in SCENARIOS]
    workers.spawn("update_scenarios", directory, scenarios)
    loaded = {
        sc["name"]: torch.load(directory / f"{sc['name']}.pt") | {"directory": directory} for sc in scenarios
    }
    return batch, loaded


def with_routes(batch: Batch) -> Batch:
    """`batch` with the routes builtin:tiny-moe takes with its router weights nudged (as an engine's
    numerics would): a teacher-forced forward's own top-k, laid out per prompt and response column."""
    model, _ = load_policy("builtin:tiny-moe")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for router in routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=g) * 0.05)
    inputs = model_inputs(model, batch, share_prompts=False)
    routes = own_routes(model, input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                        position_ids=inputs.position_ids).to(torch.int16)  # fmt: skip
    routes = routes.view(len(batch), inputs.input_ids.shape[1], *routes.shape[1:])
    p = batch["input_ids"].shape[1]
    return batch.with_(prompt_routes=routes[:, :p], response_routes=routes[:, p:])


def _one_process(batch: Batch, sc: dict):
    if sc.get("moe"):
        batch = with_routes(batch)
    model = workers.scenario_model(sc)
    state = workers.new_state(model, sc["optim"])
    algo = dataclasses.replace(sc["algo"], micro_batch_size=sc["ref_micro"], max_tokens_per_micro_batch=None)
    _, metrics = workers.update_step(state, batch, algo, sc["optim"], horizon=sc["horizon"])
    return metrics, dict(model.state_dict())


def test_sharded_logprob_pass_with_unequal_rows(results):
    batch, _ = results
    directory = next(iter(results[1].values()))["directory"]
    ranks = [torch.load(directory / f"logprobs_rank{r}.pt") for r in range(2)]
    assert ranks[0]["pieces"] > ranks[1]["pieces"]  # rank 1 had to pad with empty micro-batches
    model, _ = load_policy("builtin:tiny")
    lp, ent = compute_logprobs(model, batch, with_entropy=True)
    torch.testing.assert_close(torch.cat([r["logprobs"] for r in ranks]), lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat([r["entropy"] for r in ranks]), ent, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", [sc["name"] for sc in SCENARIOS])
def test_two_ranks_equal_one_process(results, name):
    batch, by_name = results
    sc = _scenario(next(s for s in SCENARIOS if s["name"] == name))
    ranks = by_name[name]
    metrics, weights = _one_process(batch, sc)
    assert ranks["metrics"]["actor/bad_updates"] == 0.0
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac", "actor/entropy"):
        assert ranks["metrics"][key] == pytest.approx(metrics[key], abs=1e-6, rel=0), key
    if sc.get("moe"):
        for key in ("router/aux_loss", "router/entropy", "rollout/router_agreement"):
            assert ranks["metrics"][key] == pytest.approx(metrics[key], abs=1e-6, rel=0), key
        assert 0.5 < metrics["rollout/router_agreement"] < 1.0  # the replay routes some tokens elsewhere
    if sc["algo"].use_kl_loss:
        assert ranks["metrics"]["actor/kl_loss"] == pytest.approx(metrics["actor/kl_loss"], abs=1e-6, rel=0)
    assert ranks["metrics"]["actor/pg_clipfrac"] > 0  # the clip is exercised (old log-probs perturbed)
    assert set(ranks["weights"]) == {"model.embed_tokens.weight"} | {
        k for k in weights if k != "lm_head.weight"
    }  # tied lm_head sent once
    moved, frozen_moved, experts_moved = 0.0, 0.0, 0.0
    initial = workers.scenario_model(sc).state_dict()
    for key, value in ranks["weights"].items():
        torch.testing.assert_close(value, weights[key], atol=1e-6, rtol=0, msg=key)
        change = float((value - initial[key]).abs().max())
        moved = max(moved, change)
        if sc.get("lora") and ".lora_" not in key:
            frozen_moved = max(frozen_moved, change)
        if ".experts." in key:
            experts_moved = max(experts_moved, change)
    assert moved > 1e-3  # the step changed the weights (lr 1e-2)
    assert experts_moved > 1e-3 or not sc.get("moe")  # the experts (or their adapters) trained too
    assert frozen_moved == 0.0  # LoRA: the base stays where it was

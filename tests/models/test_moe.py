"""Mixture-of-experts policies: the four families, route recording in the native engine, and R3 replay.

The replay test forces disagreement the way numerics do at scale: every router row is one shared row
plus noise of 1e-6, so the top-k is decided by the noise, and the trainer's copy gets noise of 2e-7 more. The
engine and the trainer then pick other experts for many tokens; with replay the trainer's log-probs
equal the engine's to float32 rounding anyway.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GptOssConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from rlcore.batch import Batch
from rlcore.models.families import FAMILIES as RECORDS
from rlcore.models.forward import compute_logprobs, sequence_tensors
from rlcore.models.moe import own_routes, router_tap, routers
from rlcore.models.policy import load_policy
from rlcore.pure.routing import route_agreement
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.native.engine import NativeEngine

SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=128, num_experts_per_tok=2)  # fmt: skip
FAMILIES = {
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **SIZES, num_experts=4, moe_intermediate_size=16, norm_topk_prob=True
    ),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **SIZES, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24
    ),
    "mixtral": lambda: MixtralConfig(**SIZES, num_local_experts=4, intermediate_size=16),
    "olmoe": lambda: OlmoeConfig(**SIZES, num_experts=4, intermediate_size=16),
    "gpt_oss": lambda: GptOssConfig(**SIZES, num_local_experts=4, intermediate_size=16, sliding_window=4),
}


def family_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[name]()).eval()
    with torch.no_grad():
        for router in routers(model):
            router.weight.normal_(0.0, 0.5)  # Qwen's routers start at zero: every token would tie
    return model


def prompts_of(ids: list[list[int]], pad: int = 0) -> Batch:
    width = max(map(len, ids))
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    return Batch.from_dict({"input_ids": input_ids, "attention_mask": mask})


def without_routes(batch: Batch) -> Batch:
    """`batch` without its recorded routes: the trainer then routes by its own routers."""
    return batch.select(*[k for k in batch.keys() if not k.endswith("_routes")])  # noqa: SIM118


class _Tok:
    """Enough of a tokenizer for the engine on a model without one: no stop strings, eos 1."""

    pad_token_id, eos_token_id = 0, 1

    def batch_decode(self, *a, **k):  # never called without stop strings
        raise AssertionError


def test_the_families_are_covered():
    assert set(FAMILIES) == {t for t, record in RECORDS.items() if record.moe is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_native_engine_records_each_fed_tokens_experts_and_samples_the_hf_forward(family):
    """Per family: the routes the engine records (prefill shared by n, then one decode step at a time,
    rows compacted as they stop) are the model's own routes in a teacher-forced forward; the engine's
    log-probs equal the forward's to 1e-5; replaying the recorded routes changes nothing."""
    model = family_model(family)
    engine = NativeEngine(model, _Tok(), record_routes=True, compact_fraction=0.0)
    prompts = prompts_of([[5, 9, 13], [7, 8, 9, 10, 11]])
    out = engine.generate(prompts, SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=3))
    tap = router_tap(model)
    assert out["prompt_routes"].shape == (6, 5, tap.layers, 2) and out["prompt_routes"].dtype == torch.int16
    inputs = sequence_tensors(out)
    own = own_routes(model, input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                     position_ids=inputs.position_ids)  # fmt: skip
    recorded = inputs.routes
    fed = recorded[:, 0, 0] >= 0  # every token fed to the model (not a row's last, nor padding after it)
    real = inputs.token_kind != 0
    assert torch.equal(fed[inputs.token_kind != 2], real[inputs.token_kind != 2])  # every real prompt token
    assert fed.sum() > 20
    assert torch.equal(own[fed & real], recorded[fed & real])
    with_replay, _ = compute_logprobs(model, out, share_prompts=False)
    plain, _ = compute_logprobs(model, without_routes(out), share_prompts=False)
    mask = out["response_mask"] != 0
    assert torch.equal(with_replay[mask], plain[mask])
    assert (plain - out["rollout_logprobs"])[mask].abs().max() < 1e-5


def tied_routers(model: torch.nn.Module, seed: int) -> None:
    """Every router row one shared row + 1e-6 noise: the top-k hangs on the noise."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in routers(model):
            shared = torch.randn(1, router.weight.shape[1], generator=g) * 0.3
            router.weight.copy_(shared + torch.randn(router.weight.shape, generator=g) * 1e-6)


def nudged(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in routers(other):
            router.weight.add_(torch.randn(router.weight.shape, generator=g) * 2e-7)
    return other


@pytest.mark.parametrize("layout", ["rows", "packed", "token budget"])
def test_replay_makes_the_trainer_score_what_the_engine_sampled(layout):
    model, tokenizer = load_policy("builtin:tiny-moe")
    tied_routers(model, seed=1)
    engine = NativeEngine(model, tokenizer, record_routes=True)
    texts = ["reverse 123", "reverse 98765", "reverse 4"]
    enc = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    prompts = Batch.from_dict({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask})
    out = engine.generate(prompts, SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=0))
    trainer = nudged(model, seed=2)
    kw = {"share_prompts": layout == "packed", "max_tokens": 60 if layout == "token budget" else None}
    mask = out["response_mask"] != 0
    replayed, _ = compute_logprobs(trainer, out, **kw)
    plain, _ = compute_logprobs(trainer, without_routes(out), **kw)
    gap = (replayed - out["rollout_logprobs"])[mask].abs().max()
    gap_without = (plain - out["rollout_logprobs"])[mask].abs().max()
    assert gap < 1e-5, gap
    assert gap_without > 1e-3, gap_without
    inputs = sequence_tensors(out)
    own = own_routes(trainer, input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                     position_ids=inputs.position_ids)  # fmt: skip
    agreement = route_agreement(own, inputs.routes, inputs.token_kind == 2)
    assert agreement.mean() < 0.95 and agreement.min() < 0.8, agreement  # many route elsewhere in the trainer


def test_the_replayed_gate_gradient_reaches_the_router_by_hand():
    """A 1-layer Qwen3-MoE with 2 experts, top-1, no renormalisation: replaying expert r for a token
    makes its MoE output p_r(h) * expert_r(h), so d(sum of output * c)/d(router row j) =
    (c . expert_r(h)) * p_r * (1[j == r] - p_j) * h, whichever expert the router would choose itself."""
    config = Qwen3MoeConfig(**{**SIZES, "num_hidden_layers": 1, "num_experts_per_tok": 1}, num_experts=2,
                            moe_intermediate_size=8, norm_topk_prob=False)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    block = model.model.layers[0].mlp
    tap = router_tap(model)
    router = routers(model)[0]
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0)
    h = torch.randn(3, SIZES["hidden_size"])
    own = torch.softmax(h @ router.weight.T, dim=-1).argmax(dim=-1)  # (3,)
    forced = 1 - own  # the other expert for every token
    tap.set_replay(forced.view(3, 1, 1))
    c = torch.randn(3, SIZES["hidden_size"])
    out = block(h[None])[0]  # (3, h)
    (out * c).sum().backward()
    tap.set_replay(None)
    with torch.no_grad():
        p = torch.softmax(h @ router.weight.T, dim=-1)  # (3, 2)
        expert_out = torch.stack([_expert(block.experts, int(forced[i]), h[i]) for i in range(3)])
        assert torch.allclose(out, p.gather(1, forced[:, None]) * expert_out, atol=1e-6)
        dot = (c * expert_out).sum(-1)  # (3,)
        pr = p.gather(1, forced[:, None])[:, 0]
        onehot = torch.nn.functional.one_hot(forced, 2).float()
        hand = ((dot * pr)[:, None, None] * (onehot - p)[:, :, None] * h[:, None, :]).sum(0)  # (2, h)
    assert torch.allclose(router.weight.grad, hand, atol=1e-5)
    assert router.weight.grad.abs().sum() > 0


def _expert(experts, e: int, x):
    gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
    return torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[e])


def test_rounds_of_other_widths_join_with_their_routes_aligned():
    """Dynamic sampling joins rounds of different prompt and response widths (`concat_rollouts`): the
    routes are padded with -1 where the tokens are (prompts on the left, responses on the right), so
    each row's routes stay on its tokens."""
    from rlcore.step.steps import concat_rollouts

    model, tokenizer = load_policy("builtin:tiny-moe")
    engine = NativeEngine(model, tokenizer, record_routes=True)
    rounds = []
    for texts, tokens in ((["reverse 1"], 4), (["reverse 12345", "reverse 9"], 9)):
        enc = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
        prompts = Batch.from_dict({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask})
        rounds.append(
            engine.generate(prompts, SamplingParams(n=2, max_tokens=tokens, temperature=1.0, seed=0))
        )
    joined = concat_rollouts(rounds, tokenizer.pad_token_id)
    assert rounds[0]["input_ids"].shape[1] < joined["input_ids"].shape[1]
    assert rounds[0]["responses"].shape[1] < joined["responses"].shape[1]
    for key, width in (("prompt_routes", "input_ids"), ("response_routes", "responses")):
        assert joined[key].shape[:2] == joined[width].shape
    inputs = sequence_tensors(joined)
    own = own_routes(model, input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                     position_ids=inputs.position_ids)  # fmt: skip
    fed = inputs.routes[:, 0, 0] >= 0
    assert torch.equal(fed & (inputs.token_kind == 1), inputs.token_kind == 1)  # every prompt token recorded
    assert torch.equal(own[fed], inputs.routes[fed])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_pushed_experts_are_named_and_shaped_as_the_checkpoint(family, tmp_path):
    """Engines that load checkpoint-named weights (vLLM) get transformers' fused experts split back per
    expert and projection, under the checkpoint's names (Mixtral: block_sparse_moe, w1 / w3 / w2)."""
    from safetensors.torch import load_file

    from rlcore.models.moe import checkpoint_tensors

    model = family_model(family)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    pushed = {n: t for name, p in model.named_parameters()
              for n, t in checkpoint_tensors(RECORDS[family].moe, name, p.detach())}  # fmt: skip
    assert pushed.keys() == saved.keys()
    assert all(torch.equal(pushed[k], saved[k]) for k in saved)


def test_a_replay_ends_with_the_pass_that_set_it():
    """After a replayed log-prob pass, a plain forward and a non-recording engine route by the routers."""
    model, tokenizer = load_policy("builtin:tiny-moe")
    tied_routers(model, seed=1)
    enc = tokenizer(["reverse 123", "reverse 98765"], padding=True, padding_side="left", return_tensors="pt")
    prompts = Batch.from_dict({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask})
    sampling = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=0)
    out = NativeEngine(model, tokenizer, record_routes=True).generate(prompts, sampling)
    compute_logprobs(nudged(model, seed=2), out)
    trainer = nudged(model, seed=2)
    compute_logprobs(trainer, out, share_prompts=False)
    assert router_tap(trainer).replay is None
    again = NativeEngine(trainer, tokenizer).generate(prompts, sampling)  # (raised on a stale replay)
    assert again["responses"].shape[0] == 4


@pytest.mark.parametrize("targets", [(), ("experts.down_proj",)])
def test_lora_on_a_mixture_of_experts_merges_into_a_plain_copy(targets):
    """By default the linear layers and the fused expert tensors take adapters (one low-rank pair per
    expert); every adapted tensor merges into the engine's plain copy, which then computes what the
    adapted model computes; its expert adapters get gradients. A target list may name one expert tensor."""
    from rlcore.models.lora import apply_lora, merged_state
    from rlcore.rollout.native.engine import load_named

    model, _ = load_policy("builtin:tiny-moe")
    plain, _ = load_policy("builtin:tiny-moe")
    adapted = apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=targets, seed=0)
    trained = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n in trained)
    experts = {n for n in trained if ".experts." in n}
    assert len(experts) == 4 * (2 if targets else 4)  # layers x (A, B) x expert tensors adapted
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    merged = dict(merged_state(adapted))
    assert set(merged) == set(plain.state_dict()) - {"lm_head.weight"}  # tied: sent once
    load_named(plain, merged.items())
    ids = torch.tensor([[5, 9, 13, 20, 31]])
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5)
    adapted(input_ids=ids).logits.sum().backward()
    assert all(float(p.grad.abs().sum()) > 0 for n, p in adapted.named_parameters() if n in experts)
    expert = "model.layers.0.mlp.experts.down_proj"
    assert not torch.equal(
        merged[expert], dict(load_policy("builtin:tiny-moe")[0].named_parameters())[expert]
    )

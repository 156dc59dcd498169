"""The lean decode step (rlcore.rollout.native.lean) against the Hugging Face forward, per architecture."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.cache_utils import Cache

from rlcore.batch import Batch
from rlcore.models import load_policy
from rlcore.models.lora import apply_lora
from rlcore.rollout import NativeEngine, SamplingParams
from rlcore.rollout.native.engine import PreallocatedLayer
from rlcore.rollout.native.lean import _product, can_pack, lean_decoder, row_bucket, unsupported
from rlcore.rollout.native.lean_moe import PackedExperts

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny ops, shared cores

VOCAB = 97
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # fmt: skip

MOE = {**SMALL, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # fmt: skip

ARCHS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=False)),
    "llama-tied-mlp-bias-llama3-rope": lambda: LlamaForCausalLM(
        LlamaConfig(
            **SMALL, tie_word_embeddings=True, mlp_bias=True, attention_bias=True, rope_scaling=LLAMA3
        )
    ),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=24)),  # head_dim != width / heads
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SMALL, sliding_window=None)),
    # peft LoRA on every projection (build() then gives the adapters' B non-zero values too)
    # mixtures of experts: the lean attention around each layer's own sparse block (a dense layer too)
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE, head_dim=24, norm_topk_prob=True,
                                                             mlp_only_layers=[1])),
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(**MOE, shared_expert_intermediate_size=48)),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**{**MOE, "num_local_experts": 4}, sliding_window=None)),
    # LoRA on the attention and on the fused experts (peft wraps the experts: the block's own forward)
    "qwen3_moe-lora": lambda: apply_lora(Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE, head_dim=24)), rank=4,
                                         alpha=8.0, dropout=0.0, targets=()),
    "llama-lora": lambda: apply_lora(LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=False)), rank=4,
                                     alpha=8.0, dropout=0.0, targets=()),
}  # fmt: skip


def build(arch: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ARCHS[arch]().eval()
        with torch.no_grad():  # larger weights than the 0.02 init: logits that differ between tokens
            for name, p in model.named_parameters():
                if p.dim() in (2, 3):  # (3: a MoE's fused experts)
                    p.normal_(
                        0, 0.15 if "lora_" not in name else 0.05
                    )  # an adapter: a correction, not a rewrite
                elif name.endswith(".bias"):
                    p.normal_(0, 0.1)  # HF starts biases at 0, which would hide a dropped bias
    return model.to(dtype)


def padded_prompts(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded random prompts: (ids, attention mask, positions), each (b, max length)."""
    g = torch.Generator().manual_seed(seed)
    p = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), p), generator=g)
    mask = (torch.arange(p)[None] >= p - torch.tensor(lengths)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def hf_logits(model, ids, mask, pos) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "plain"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_lean_step_logits_equal_the_hugging_face_forward(arch, pack):
    """Teacher-forced: prefill left-padded prompts, repeat each twice, feed 12 tokens (dropping rows
    after step 5, reordering them after step 9); every step's logits equal a full forward over prompt + tokens (1e-5), with the
    weights in oneDNN's packed layout (CPU) and as the module's own tensors."""
    model = build(arch)
    assert unsupported(model) is None
    ids, mask, pos = padded_prompts([5, 9, 2])
    repeats, steps = 2, 12
    cache = Cache(layer_class_to_replicate=functools.partial(PreallocatedLayer, ids.shape[1]))
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[
            :, -1
        ]
        state = lean_decoder(model, pack=pack).start(cache, mask, pos[:, -1:] + 1, repeats, steps)
    head, layer = state.weights[3], state.weights[1][0]
    assert head.is_mkldnn == pack == layer[1].is_mkldnn and not layer[0].is_mkldnn  # q packed, norm not
    fused = pack and "lora" not in arch  # packed q, k, v (and gate, up) as one weight, unless adapted
    assert (layer[3] is None) == fused
    if arch in ("qwen3_moe", "mixtral"):  # their experts packed (qwen2_moe: its block, for the shared expert)
        assert isinstance(layer[-1], PackedExperts) == pack
    if arch == "qwen3_moe-lora":  # adapted experts: the block's own forward, packed or not
        assert type(layer[-1].experts).__name__ == "ParamWrapper"
    if layer[-1] is None:  # a dense MLP (a MoE layer's is its sparse block)
        assert fused == (layer[14] is None) and (layer[12].shape[0] == 192) == fused
    rows = torch.arange(ids.shape[0] * repeats) // repeats  # prompt of each row
    fed = torch.randint(3, VOCAB, (len(rows), steps), generator=torch.Generator().manual_seed(1))
    full_ids = torch.cat([ids[rows], fed], dim=1)
    full_mask = torch.cat([mask[rows], torch.ones_like(fed)], dim=1)
    full_pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
    reference = hf_logits(model, full_ids, full_mask, full_pos)  # (b*n, p + steps, v)
    p = ids.shape[1]
    torch.testing.assert_close(first.repeat_interleave(repeats, 0), reference[:, p - 1], rtol=0, atol=1e-5)
    live = torch.arange(len(rows))
    with torch.no_grad():
        for j in range(steps):
            if j == 5:  # ascending rows: moved down in place
                live = torch.tensor([0, 3, 4])
                state.select(live)
            if j == 9:  # any order: gathered
                state.select(torch.tensor([2, 0]))
                live = live[[2, 0]]
            logits = state.step(fed[live, j])
            torch.testing.assert_close(logits, reference[live, p + j], rtol=0, atol=1e-5)


def prompt_batch(lengths: list[int]) -> Batch:
    ids, mask, pos = padded_prompts(lengths, seed=4)
    return Batch(
        {"input_ids": ids, "attention_mask": mask, "position_ids": pos},
        meta={"uid": [f"u{i}" for i in range(len(lengths))]},
    )


class Tok:
    """The engine's tokenizer needs: pad and EOS ids (no stop strings here)."""

    pad_token_id, eos_token_id = 0, 2


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_engine_samples_the_same_tokens_and_logprobs_as_the_hugging_face_step(arch):
    model = build(arch)
    batch = prompt_batch([4, 7, 3, 7])
    sp = SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=5, stop_token_ids=tuple(range(3, 12)))
    lean_engine = NativeEngine(model, Tok())
    assert lean_engine._lean is not None
    lean = lean_engine.generate(batch, sp)
    hf = NativeEngine(model, Tok(), lean=False).generate(batch, sp)
    lengths = lean["response_mask"].sum(-1)
    assert len(set(lengths.tolist())) >= 3  # rows ended at different steps: the batch was compacted
    assert torch.equal(lean["responses"], hf["responses"])
    assert lean["finish_reason"] == hf["finish_reason"]
    torch.testing.assert_close(lean["rollout_logprobs"], hf["rollout_logprobs"], rtol=0, atol=1e-5)
    # the rollout/trainer gap: teacher-forced log-probs of the sampled tokens
    gap = (teacher_logprobs(model, lean) - lean["rollout_logprobs"]).abs()[lean["response_mask"].bool()]
    assert gap.max() <= 1e-5, gap.max()


def teacher_logprobs(model: torch.nn.Module, out: Batch) -> torch.Tensor:
    """The log-probs of `out`'s response tokens under `model`, teacher-forced: (b, t)."""
    full_ids = torch.cat([out["input_ids"], out["responses"]], dim=1)
    full_mask = torch.cat([out["attention_mask"], out["response_attention"].long()], dim=1)
    logits = hf_logits(model, full_ids, full_mask, (full_mask.cumsum(-1) - 1).clamp(min=0))
    p = out["input_ids"].shape[1]
    return torch.log_softmax(logits[:, p - 1 : -1].float(), -1).gather(-1, out["responses"][..., None])[
        ..., 0
    ]


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "plain"])
def test_bf16_lean_step_follows_the_hugging_face_forward(pack):
    """bf16 weights (Qwen2: q/k/v biases), teacher-forced: every step's logits within bf16 rounding of
    the Hugging Face forward's (0.1 on logits of scale ~5; a dropped bias or a wrong weight is far
    more), packed for oneDNN and plain."""
    model = build("qwen2", torch.bfloat16)
    ids, mask, pos = padded_prompts([4, 7])
    steps = 8
    cache = Cache(layer_class_to_replicate=functools.partial(PreallocatedLayer, ids.shape[1]))
    fed = torch.randint(3, VOCAB, (2, steps), generator=torch.Generator().manual_seed(1))
    full_mask = torch.cat([mask, torch.ones_like(fed)], dim=1)
    reference = hf_logits(model, torch.cat([ids, fed], 1), full_mask, (full_mask.cumsum(-1) - 1).clamp(min=0))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
        state = lean_decoder(model, pack=pack).start(cache, mask, pos[:, -1:] + 1, 1, steps)
        # packed where oneDNN has bf16 kernels for this CPU; an AVX2-only CPU samples with plain products
        assert state.weights[3].is_mkldnn == (pack and can_pack(torch.ones(1, dtype=torch.bfloat16)))
        for j in range(steps):
            logits = state.step(fed[:, j])
            assert logits.dtype == torch.bfloat16
            torch.testing.assert_close(
                logits.float(), reference[:, ids.shape[1] + j].float(), rtol=0, atol=0.1
            )


def test_weights_are_read_live_after_in_place_updates_and_mid_generate_loads():
    """No copy of the weights: an optimizer-like in-place change between calls, and `load_weights`
    from the per-step hook (partial rollouts), decode exactly as the Hugging Face step does; after the
    mid-generate load every token's log-prob is the new model's, teacher-forced (the prompts and the
    first 4 tokens prefilled again), and before it the old one's."""
    other = build("llama")
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.3)
    batch = prompt_batch([5, 3])
    sp = SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=2)
    engines = {lean: NativeEngine(build("llama"), Tok(), lean=lean) for lean in (True, False)}
    outs = {}
    for lean, engine in engines.items():
        engine.generate(batch, sp)  # a call before the change
        with torch.no_grad():
            for p in engine.model.parameters():
                p.mul_(0.9)
        first = engine.generate(batch, sp)
        before = copy.deepcopy(engine.model)
        hook = functools.partial(
            lambda e, j: e.load_weights(other.named_parameters()) if int(j.min()) == 4 else None, engine
        )
        with engine.each_step(hook):
            second = engine.generate(batch, sp)
        outs[lean] = (first, second)
        mask = second["response_mask"].bool()
        for model, columns in ((before, slice(0, 4)), (other, slice(4, None))):
            gap = (teacher_logprobs(model, second) - second["rollout_logprobs"]).abs()
            assert gap[:, columns][mask[:, columns]].max() <= 1e-5, (lean, columns)
    for a, b in zip(outs[True], outs[False], strict=True):
        assert torch.equal(a["responses"], b["responses"])
        torch.testing.assert_close(a["rollout_logprobs"], b["rollout_logprobs"], rtol=0, atol=1e-5)
    assert not torch.equal(outs[True][0]["responses"], outs[True][1]["responses"])


def test_row_buckets_are_few_and_cover_the_rows():
    buckets = [row_bucket(rows) for rows in range(1, 513)]
    assert all(b >= rows for rows, b in enumerate(buckets, 1)) and buckets == sorted(buckets)
    assert buckets[:16] == [1, 2, 4, 4, 8, 8, 8, 8, 16, 16, 16, 16, 16, 16, 16, 16]
    assert max(b / rows for rows, b in enumerate(buckets, 1) if rows > 16) < 1.25
    assert len(set(buckets[:64])) == 13 and len(set(buckets)) == 25


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not can_pack(torch.ones(1)), reason="no oneDNN in this build")
def test_packed_products_are_exact_and_hold_no_memory_per_row_count():
    """Each row count a packed product runs at makes oneDNN and ideep cache a primitive with its buffers
    (about 0.6 MB for this weight): run on buckets, a decode's 1-64 rows add nothing once the 13
    buckets are warm (unbucketed, 51 more shapes: about 30 MB)."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(576, 576, generator=g), torch.randn(576, generator=g)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    x = torch.randn(64, 576, generator=g)
    for rows in sorted({row_bucket(r) for r in range(1, 65)}):
        _product(x[:rows], packed, b)
    before = _resident_mb()
    for rows in range(1, 65):
        y = _product(x[:rows], packed, b)
        assert y.shape == (rows, 576)
        torch.testing.assert_close(y, torch.nn.functional.linear(x[:rows], w, b), rtol=0, atol=1e-4)
    assert _resident_mb() - before < 8.0


def test_other_architectures_and_configs_keep_the_hugging_face_step():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64))
    assert "model_type 'gpt2'" in unsupported(gpt2)
    assert NativeEngine(gpt2, Tok())._lean is None
    windowed = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=8))
    assert unsupported(windowed) == "not every layer is full attention"
    dynamic = LlamaForCausalLM(LlamaConfig(**SMALL, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert "depends on the sequence length" in unsupported(dynamic)
    assert NativeEngine(dynamic, Tok())._lean is None
    hooked = build("llama")
    hooked.model.layers[1].self_attn.v_proj.register_forward_hook(lambda module, args, out: out * 2)
    assert unsupported(hooked) == "Linear has forward hooks"

    class LoRALinear(torch.nn.Linear):  # a wrapped projection: its forward is more than its weight
        pass

    wrapped = build("qwen2")
    old = wrapped.model.layers[0].mlp.up_proj
    wrapped.model.layers[0].mlp.up_proj = LoRALinear(old.in_features, old.out_features, bias=False)
    assert "a projection is a LoRALinear" in unsupported(wrapped)
    tiny, tokenizer = load_policy("builtin:tiny")
    assert NativeEngine(tiny, tokenizer)._lean is not None  # the built-in models are Llamas
    assert NativeEngine(tiny, tokenizer, kv_cache="dynamic")._lean is None  # the ablation keeps HF's step


def test_compiled_lean_step_samples_as_the_eager_one():
    """torch.compile of the lean step (CPU inductor, dynamic rows and length: compiled once for the
    call, rows dropped as they finish) decodes the same tokens and log-probs (~20 s of compiling)."""
    from rlcore.rollout.toolchain import cpu_compile_problem

    if cpu_compile_problem():
        pytest.skip(cpu_compile_problem())
    model = build("qwen3")
    batch = prompt_batch([4, 7, 3, 7])
    sp = SamplingParams(n=2, max_tokens=16, temperature=1.0, seed=7, stop_token_ids=tuple(range(3, 12)))
    eager = NativeEngine(model, Tok()).generate(batch, sp)
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    compiled = NativeEngine(model, Tok(), compile=True).generate(batch, sp)
    assert len(set(eager["response_mask"].sum(-1).tolist())) >= 3
    # rows dropped in place as they finish keep the cache's layout: one graph for the batch, and one more
    # only for the last row (dynamo specialises a size of 1); each compile is ~10-15 s on 2 cores
    assert counters["stats"]["unique_graphs"] - before <= 2
    assert torch.equal(compiled["responses"], eager["responses"])
    torch.testing.assert_close(compiled["rollout_logprobs"], eager["rollout_logprobs"], rtol=0, atol=1e-5)


def test_activation_checkpointing_keeps_the_lean_step():
    """--model.activation-checkpointing adds transformers' `make_inputs_require_grads` hook to the embedding,
    which changes no value: the lean step still runs the model (it fell back to the Hugging Face step, a
    2.4x slower SmolLM2 rollout, issue 61)."""
    from rlcore.dist.fsdp import apply_activation_checkpointing

    model = build("llama")
    apply_activation_checkpointing(model)
    assert model.model.embed_tokens._forward_hooks  # the hook is there
    assert unsupported(model) is None
    assert NativeEngine(model, Tok())._lean is not None
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: out * 2)  # any other hook: refused
    assert unsupported(model) == "Embedding has forward hooks"

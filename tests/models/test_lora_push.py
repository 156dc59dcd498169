"""A LoRA policy's push into a native engine in the same process (issue 34): the engine samples a plain
copy of the base with the adapters merged in (the lean decode step, no per-step adapter products),
while the trained module keeps them unmerged; the push moves the merged weights, and an engine copy
with its own adapter layers (FSDP's) still gets the adapter tensors only."""

from __future__ import annotations

import torch

from configs import Config, ModelConfig
from rlcore.dist.mesh import DistInfo
from rlcore.models import load_policy
from rlcore.models.lora import apply_lora
from rlcore.rollout.native.engine import NativeEngine
from rlcore.step.weights import engine_holds, push_weights
from rlcore.trainer.models import build_engine

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def _policy(seed: int = 0) -> torch.nn.Module:
    model, _ = load_policy("builtin:tiny-reverse")
    torch.manual_seed(seed)
    model = apply_lora(model, rank=4, alpha=8, dropout=0.0, targets=())
    with torch.no_grad():  # a trained adapter: B is zero at init
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def test_the_native_engine_of_a_lora_policy_samples_a_merged_plain_copy():
    cfg = Config(model=ModelConfig(path="builtin:tiny-reverse", lora_rank=4, lora_alpha=8))
    policy = _policy()
    engine = build_engine(cfg, policy, load_policy("builtin:tiny-reverse")[1], CPU)
    assert isinstance(engine, NativeEngine) and engine.module is not policy
    assert not any(".lora_" in name for name, _ in engine.module.named_parameters())  # plain: the lean step
    assert engine_holds(policy, engine) is False  # before the first push: the base alone
    pushed = push_weights(policy, engine, bucket_bytes=1)
    base_bytes = sum(p.numel() * 4 for n, p in policy.state_dict().items() if ".lora_" not in n)
    assert pushed["sync/bytes"] < base_bytes and pushed["sync/bytes"] > 0.9 * base_bytes  # tied head once
    assert engine_holds(policy, engine) is True
    ids = torch.tensor([[1, 5, 9, 13, 4, 7, 2, 8]])
    with torch.no_grad():
        torch.testing.assert_close(engine.module(ids).logits, policy(ids).logits, rtol=0, atol=1e-5)
        for name, p in policy.named_parameters():  # an optimizer step on the adapters
            if "lora_A" in name:
                p.add_(0.01)
    assert engine_holds(policy, engine) is False
    push_weights(policy, engine, bucket_bytes=1)
    with torch.no_grad():
        torch.testing.assert_close(engine.module(ids).logits, policy(ids).logits, rtol=0, atol=1e-5)
    assert any(".base_layer." in name for name, _ in policy.named_parameters())  # the policy stays unmerged


def test_an_engine_copy_with_adapter_layers_still_gets_the_adapters_only():
    policy, copy = _policy(seed=0), _policy(seed=1)
    engine = NativeEngine(copy.eval(), load_policy("builtin:tiny-reverse")[1])
    pushed = push_weights(policy, engine, bucket_bytes=1)
    adapters = sum(p.numel() * 4 for n, p in policy.named_parameters() if ".lora_" in n)
    assert pushed["sync/bytes"] == adapters
    assert engine_holds(policy, engine) is True

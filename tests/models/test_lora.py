"""LoRA (issue 19): adapters only train, the disabled adapter is the base, merged and peft exports agree."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel

from configs import AlgoConfig, OptimConfig
from rlcore.models import load_policy
from rlcore.models.lora import adapter_disabled, apply_lora, merged_state, save_adapter
from rlcore.update import build_optimizer
from tests.configured import new_state, update
from tests.dist.rollouts import fake_rollout, with_logprobs
from tests.test_update import HORIZON, _hand_loss

OPTIM = OptimConfig(lr=1e-2, eps=1e-3, grad_clip=0.0)
pytestmark = pytest.mark.usefixtures("one_thread")


def lora_model(dtype=torch.float64, targets=()):
    base, _ = load_policy("builtin:tiny", dtype=dtype)
    return base, apply_lora(copy.deepcopy(base), rank=4, alpha=8.0, dropout=0.0, targets=targets)


def nudge(model, seed=0):
    """Give every lora_B a non-zero value (peft starts them at 0: the adapted model starts as the base)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[1, 5, 9, 13, 4, 7, 2, 8]])


def test_only_the_adapters_train_and_the_optimizer_holds_them_alone():
    base, model = lora_model()
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert {n.split(".")[-4] for n in trained} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    held = [p for group in build_optimizer(model, lr=1e-3).param_groups for p in group["params"]]
    assert len(held) == len(trained) and all(p.requires_grad for p in held)
    torch.testing.assert_close(logits(model, IDS), logits(base, IDS), rtol=0, atol=0)  # B = 0 at the start


def test_lora_update_equals_a_hand_assembled_loss_on_the_adapted_model():
    _, model = lora_model()
    nudge(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = with_logprobs(model, fake_rollout(3, 4, max_prompt=6, max_response=HORIZON, seed=4))
    batch = batch.with_(advantages=batch["advantages"].double(), overwrite=True)
    algo = AlgoConfig(micro_batch_size=4, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01, tis_cap=1.5)
    ref = copy.deepcopy(model)
    _, metrics = update(new_state(model, OPTIM, 10), batch, algo, OPTIM, horizon=HORIZON, temperature=1.0)
    loss, _ = _hand_loss(ref, batch, algo, 1.0)
    loss.backward()
    trained = [p for p in ref.parameters() if p.requires_grad]
    grad_norm = torch.sqrt(sum((p.grad**2).sum() for p in trained))
    torch.optim.AdamW(trained, lr=OPTIM.lr, eps=OPTIM.eps, weight_decay=OPTIM.weight_decay).step()
    assert metrics["actor/grad_norm"] == pytest.approx(float(grad_norm), abs=1e-6, rel=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
        assert torch.equal(p, start[name]) != p.requires_grad, name  # the adapters moved, the base did not


def test_the_disabled_adapter_is_exactly_the_base_model():
    base, model = lora_model()
    nudge(model)
    assert not torch.allclose(logits(model, IDS), logits(base, IDS))
    with adapter_disabled(model):
        torch.testing.assert_close(logits(model, IDS), logits(base, IDS), rtol=0, atol=0)
    assert not torch.allclose(logits(model, IDS), logits(base, IDS))  # enabled again after the block


def test_merged_weights_and_the_peft_adapter_reproduce_the_adapted_model(tmp_path):
    base, model = lora_model(torch.float32)
    nudge(model)
    merged = copy.deepcopy(base)
    missing, unexpected = merged.load_state_dict(dict(merged_state(model)), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied to the embedding, written once
    torch.testing.assert_close(logits(merged, IDS), logits(model, IDS), rtol=0, atol=1e-5)
    save_adapter(model, tmp_path / "adapter", base="builtin:tiny")
    peft = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter"))
    torch.testing.assert_close(logits(peft, IDS), logits(model, IDS), rtol=0, atol=0)


def test_a_target_the_model_lacks_is_one_error_naming_it():
    base, _ = load_policy("builtin:tiny")
    with pytest.raises(
        ValueError, match=r"LoRA targets \['qkv'\] are not linear layers of the model; it has \["
    ):
        apply_lora(base, rank=4, alpha=8.0, dropout=0.0, targets=("q_proj", "qkv"))
    _, only = lora_model(targets=("q_proj", "v_proj"))
    assert {n.split(".")[-4] for n, p in only.named_parameters() if p.requires_grad} == {"q_proj", "v_proj"}

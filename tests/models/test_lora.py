"""LoRA (issue 19): adapters only train, the disabled adapter is the base, merged and peft exports agree."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from configs import AlgoConfig, OptimConfig
from rlcore.models import load_policy
from rlcore.models.lora import adapter_disabled, apply_lora, merged_state, save_adapter
from rlcore.step.update import build_optimizer
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


def _peft_forward(layer, x):
    """peft's own forward of an in-place layer (its base class's)."""
    return type(layer).__mro__[1].forward(layer, x)


class _NewStorages(TorchDispatchMode):
    """Counts the aten ops' outputs that are new storages of exactly `nbytes` (views and in-place
    results share an input's storage and do not count)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.nbytes, self.count = nbytes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.count += t.untyped_storage().nbytes() == self.nbytes
        return out


def _output_sized_allocations(fn, nbytes: int) -> int:
    with _NewStorages(nbytes) as mode:
        fn()
    return mode.count


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_in_place_adapter_forward_equals_peft_and_allocates_one_output(dtype):
    """The adapter goes into the base output in one addmm_: the same values and gradients as peft's
    `result + B(A x) * scale` (within a rounding of the scale), with one output-sized block, not four."""
    _, model = lora_model(dtype)
    nudge(model)
    layer = model.model.layers[0].mlp.up_proj
    assert type(layer).__name__ == "InPlaceLoraLinear"
    x = torch.randn(3, 5, layer.in_features, dtype=dtype, requires_grad=True)
    outs, grads = [], []
    for forward in (layer, lambda t: _peft_forward(layer, t)):
        model.zero_grad()
        x.grad = None
        y = forward(x)
        (y * torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append([x.grad, *(p.grad for p in layer.parameters() if p.requires_grad)])
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(outs[0], outs[1], **tol)
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs, **tol)
    nbytes = outs[0].numel() * outs[0].element_size()
    with torch.no_grad():
        assert _output_sized_allocations(lambda: layer(x), nbytes) == 1
        assert _output_sized_allocations(lambda: _peft_forward(layer, x), nbytes) == 4


def test_disabled_adapters_skip_the_in_place_path():
    base, model = lora_model()
    nudge(model)
    with adapter_disabled(model):
        torch.testing.assert_close(logits(model, IDS), logits(base, IDS), rtol=0, atol=0)
    assert not torch.equal(logits(model, IDS), logits(base, IDS))

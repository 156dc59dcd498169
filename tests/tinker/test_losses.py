"""The Tinker losses (`rlcore.tinker.losses`) against their definitions written out by hand, value and
gradient, on tensors with padding; and the one-line refusals."""

from __future__ import annotations

import pytest
import torch

from rlcore.tinker.errors import UserError
from rlcore.tinker.losses import REFUSED, TINKER_LOSSES, check_inputs, loss_of


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    m, r = 3, 7
    lp = (-torch.rand(m, r, generator=g) * 3).requires_grad_(True)
    q = -torch.rand(m, r, generator=g) * 3
    adv = torch.randn(m, r, generator=g)
    w = (torch.rand(m, r, generator=g) > 0.3).float() * torch.rand(m, r, generator=g) * 2
    mask = torch.ones(m, r)
    mask[1, :3] = 0  # a shorter, left-padded row
    return lp, q, adv, w, mask


def _by_hand(name: str, lp, q, adv, w, mask, cfg):
    ratio = torch.exp(lp - q)
    keep = w * mask
    if name == "cross_entropy":
        return -(keep * lp).sum()
    if name == "importance_sampling":
        return -(keep * ratio * adv).sum()
    if name == "ppo":
        clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return -(keep * torch.minimum(ratio * adv, clipped * adv)).sum()
    if name == "cispo":
        weight = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"]).detach()
        return -(keep * weight * lp * adv).sum()
    if name == "dro":
        return -(keep * (lp * adv - 0.5 * cfg["beta"] * (lp - q) ** 2)).sum()
    if name == "gspo":  # the sequence ratio over the positions with a non-zero advantage (the default mask)
        seq = (keep * (adv != 0)).float()
        mean = ((lp - q) * seq).sum(-1, keepdim=True) / seq.sum(-1, keepdim=True)
        s = torch.exp(mean.detach() + lp - lp.detach())
        clipped = s.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return -(seq * torch.minimum(s * adv, clipped * adv)).sum()
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(TINKER_LOSSES))
@pytest.mark.parametrize("config", [{}, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}, {"beta": 0.3}])
def test_each_loss_is_its_definition_in_value_and_gradient(name, config):
    loss = TINKER_LOSSES[name]
    config = {k: v for k, v in config.items() if k in loss.config}
    _, cfg = loss_of(name, config)
    lp, q, adv, w, mask = _case()
    inputs = {"weights": w, "logprobs": q, "advantages": adv}
    got = loss.fn(lp, inputs, cfg, mask)
    (g_got,) = torch.autograd.grad(got, lp)
    want = _by_hand(name, lp, q, adv, w, mask, cfg)
    (g_want,) = torch.autograd.grad(want, lp)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-6)
    assert g_got[1, :3].abs().sum() == 0  # padding gets no gradient


def test_the_clip_thresholds_bind_where_the_ratio_leaves_them():
    lp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    q = torch.tensor([[-1.0, 1.0]])  # ratios e and 1/e, both outside [0.8, 1.2]
    adv = torch.tensor([[1.0, -1.0]])
    _, cfg = loss_of("ppo", {})
    value = TINKER_LOSSES["ppo"].fn(lp, {"logprobs": q, "advantages": adv}, cfg, torch.ones(1, 2))
    assert value.item() == pytest.approx(-(1.2 * 1.0) + 0.8 * 1.0)  # both clipped: no gradient
    (grad,) = torch.autograd.grad(value, lp)
    assert grad.abs().sum() == 0


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        ("bogus", {}, "unknown loss_fn 'bogus'; served: cross_entropy"),
        ("stable_reinforce", {}, REFUSED["stable_reinforce"]),
        ("ppo", {"clip": 0.2}, "unknown key(s) clip (it takes: clip_low_threshold, clip_high_threshold)"),
        ("ppo", {"clip_low_threshold": 1.3}, "must satisfy 0 <= low <= 1 <= high"),
    ],
)
def test_a_bad_loss_or_config_is_one_line(name, config, message):
    with pytest.raises(UserError) as e:
        loss, cfg = loss_of(name, config)
        loss.fn(torch.zeros(1, 1), {"logprobs": torch.zeros(1, 1), "advantages": torch.zeros(1, 1)}, cfg, torch.ones(1, 1))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"target_tokens": torch.zeros(4)}, "needs loss_fn_inputs advantages, logprobs, target_tokens; missing advantages, logprobs"),
        ({"target_tokens": torch.zeros(4), "logprobs": torch.zeros(4), "advantages": torch.zeros(3)},
         "loss_fn_inputs['advantages'] has shape [3]; expected [4]"),
        ({"target_tokens": torch.zeros(4), "logprobs": torch.zeros(4), "advantages": torch.zeros(4), "ref": torch.zeros(4)},
         "does not read loss_fn_inputs ref"),
    ],
)
def test_bad_loss_inputs_are_one_line(inputs, message):
    loss, _ = loss_of("importance_sampling", {})
    with pytest.raises(UserError, match=None) as e:
        check_inputs("importance_sampling", loss, inputs, 4, "datum 2")
    assert message in str(e.value) and str(e.value).startswith("datum 2: ")

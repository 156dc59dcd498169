"""Tests for rlcore.pure.logprobs: the chunked path equals the naive log_softmax path, values and grads."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rlcore.pure.logprobs import _chunks, token_logprobs


def naive(logits, labels, temperature=1.0):
    """The reference: full log_softmax in float32 (float64 stays float64), then gather."""
    x = logits.double() if logits.dtype == torch.float64 else logits.float()
    return torch.log_softmax(x / temperature, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _inputs(shape, v, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn((*shape, v), generator=g, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, v, shape, generator=g)
    weights = torch.randn(shape, generator=g, dtype=torch.float64)  # upstream gradient
    return logits, labels, weights


def _value_and_grad(fn, logits, weights):
    x = logits.detach().clone().requires_grad_(True)
    out = fn(x)
    (out * weights.to(out.dtype)).sum().backward()
    return out.detach(), x.grad


N_POSITIONS = 2 * 5  # shape (2, 5) below


@pytest.mark.parametrize("chunk_size", [1, 3, 7, None, 4 * N_POSITIONS])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_equals_naive_values_and_grads(chunk_size, dtype, atol):
    logits, labels, w = _inputs((2, 5), 13, dtype, seed=0)
    got, got_grad = _value_and_grad(lambda x: token_logprobs(x, labels, chunk_size=chunk_size), logits, w)
    ref, ref_grad = _value_and_grad(lambda x: naive(x, labels), logits, w)
    assert got.dtype == dtype and got_grad.dtype == dtype
    torch.testing.assert_close(got, ref, atol=atol, rtol=0)
    torch.testing.assert_close(got_grad, ref_grad, atol=atol, rtol=0)


@pytest.mark.parametrize("temperature", [0.6, 1.7])
def test_temperature(temperature):
    logits, labels, w = _inputs((3, 4), 11, torch.float64, seed=1)
    got, got_grad = _value_and_grad(
        lambda x: token_logprobs(x, labels, temperature=temperature, chunk_size=5), logits, w
    )
    ref, ref_grad = _value_and_grad(lambda x: naive(x, labels, temperature), logits, w)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(got_grad, ref_grad, atol=1e-10, rtol=0)


def test_hand_value_two_tokens():
    # logits (0, log 3) at temperature 1: p = (1/4, 3/4); at temperature 2: logits/2 = (0, log 3 / 2).
    logits = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)
    labels = torch.tensor([1])
    torch.testing.assert_close(
        token_logprobs(logits, labels), torch.tensor([math.log(0.75)], dtype=torch.float64)
    )
    p1 = math.sqrt(3.0) / (1.0 + math.sqrt(3.0))  # exp(log3/2) / (1 + exp(log3/2))
    torch.testing.assert_close(
        token_logprobs(logits, labels, temperature=2.0), torch.tensor([math.log(p1)], dtype=torch.float64)
    )
    # d log p_1 / d logits = (onehot - softmax) / T = ((0 - 1/4), (1 - 3/4)) at T = 1
    x = logits.clone().requires_grad_(True)
    token_logprobs(x, labels).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([[-0.25, 0.25]], dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_size", [2, None])
def test_low_precision_logits_compute_in_float32(dtype, chunk_size):
    logits, labels, w = _inputs((3, 6), 17, dtype, seed=2)
    got, got_grad = _value_and_grad(lambda x: token_logprobs(x, labels, chunk_size=chunk_size), logits, w)
    assert got.dtype == torch.float32 and got_grad.dtype == dtype
    ref, ref_grad = _value_and_grad(lambda x: naive(x, labels), logits.float(), w)  # same values, upcast
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # the gradient is computed in float32 and rounded once to the logits' dtype: within half a unit
    # in the last place of the float32 reference (eps * |x| / 2 bounds that), plus float32 noise
    bound = torch.finfo(dtype).eps * ref_grad.abs() / 2 + 1e-6
    assert ((got_grad.float() - ref_grad).abs() <= bound).all()


def test_sliced_non_contiguous_logits_and_4d_shapes():
    logits, labels, w = _inputs((2, 7), 9, torch.float64, seed=3)
    sliced, lab = logits[:, :-1], labels[:, 1:]  # the usual shift: a non-contiguous view
    got, got_grad = _value_and_grad(lambda x: token_logprobs(x[:, :-1], lab, chunk_size=4), logits, w[:, :-1])
    ref, ref_grad = _value_and_grad(lambda x: naive(x[:, :-1], lab), logits, w[:, :-1])
    assert not sliced.is_contiguous()
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(got_grad, ref_grad, atol=1e-10, rtol=0)
    logits4, labels4, w4 = _inputs((2, 3, 4), 5, torch.float64, seed=4)
    got, got_grad = _value_and_grad(lambda x: token_logprobs(x, labels4, chunk_size=5), logits4, w4)
    ref, ref_grad = _value_and_grad(lambda x: naive(x, labels4), logits4, w4)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(got_grad, ref_grad, atol=1e-10, rtol=0)


def test_one_dim_and_empty_inputs():
    logits, labels, _ = _inputs((), 6, torch.float64, seed=5)
    torch.testing.assert_close(token_logprobs(logits, labels), naive(logits, labels), atol=1e-12, rtol=0)
    empty = token_logprobs(torch.zeros(0, 4, 7), torch.zeros(0, 4, dtype=torch.long))
    assert empty.shape == (0, 4)


def test_does_not_modify_inputs():
    logits, labels, w = _inputs((4, 3), 8, torch.float32, seed=6)
    before = logits.clone()
    x = logits.requires_grad_(True)
    (token_logprobs(x, labels, temperature=1.0, chunk_size=2) * w.float()).sum().backward()
    torch.testing.assert_close(logits.detach(), before, atol=0, rtol=0)


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 4),
    t=st.integers(1, 9),
    v=st.integers(2, 12),
    chunk=st.one_of(st.none(), st.integers(1, 40)),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_shapes_and_chunks(b, t, v, chunk, seed):
    logits, labels, w = _inputs((b, t), v, torch.float64, seed=seed, scale=10.0)
    got, got_grad = _value_and_grad(lambda x: token_logprobs(x, labels, chunk_size=chunk), logits, w)
    ref, ref_grad = _value_and_grad(lambda x: naive(x, labels), logits, w)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(got_grad, ref_grad, atol=1e-10, rtol=0)
    assert (got <= 0).all()  # log-probabilities


def test_gradcheck_float64():
    logits, labels, _ = _inputs((2, 3), 5, torch.float64, seed=7)
    x = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, labels, temperature=0.8, chunk_size=2), (x,))


def test_bad_arguments_raise():
    logits, labels, _ = _inputs((2, 3), 5, torch.float32, seed=8)
    with pytest.raises(ValueError, match="labels shape"):
        token_logprobs(logits, labels[:, :2])
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(logits, labels, chunk_size=0)


class _NewFullTensors(TorchDispatchMode):
    """Records every op output that allocates a new storage of at least `nbytes` (views excluded)."""

    def __init__(self, nbytes):
        super().__init__()
        self.nbytes, self.found = nbytes, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            if storage is not None and storage.nbytes() >= self.nbytes and storage.data_ptr() not in inputs:
                self.found.append((str(func), t.dtype))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliced", [False, True])
def test_only_one_full_size_tensor_is_allocated(dtype, sliced):
    # Forward + backward allocate exactly one tensor as large as the logits: the gradient, in the
    # logits' dtype. Anything at or above half the float32 size of the logits counts as "full".
    base = torch.randn(4, 51, 1000).to(dtype)
    logits = (base[:, :-1] if sliced else base[:, 1:].contiguous()).requires_grad_(True)  # (4, 50, 1000)
    labels = torch.randint(0, 1000, (4, 50))
    with _NewFullTensors(4 * 50 * 1000 * 4 // 2) as spy:
        token_logprobs(logits, labels, chunk_size=16).sum().backward()
    assert spy.found == [("aten.empty.memory_format", dtype)]
    with _NewFullTensors(4 * 50 * 1000 * 4 // 2) as spy:  # the detector does see the naive path's copies
        naive(logits, labels).sum().backward()
    assert len(spy.found) >= 3


@settings(max_examples=50, deadline=None)
@given(a=st.integers(0, 9), m=st.integers(0, 9), chunk=st.integers(1, 30))
def test_chunks_cover_every_position_once_within_the_bound(a, m, chunk):
    seen = torch.zeros(a, m, dtype=torch.long)
    for rows, cols in _chunks(a, m, chunk):
        block = seen[rows, cols]
        assert 0 < block.numel() <= chunk
        seen[rows, cols] += 1
    assert (seen == 1).all()

"""The Tinker SDK's protobuf bodies, read and written with the SDK's own generated messages
(`tinker.proto.tinker_public_pb2`, tinker 0.38): `/forward_backward` requests in, `ForwardBackwardOutput`
and `SampleResponse` results out. Everything else the SDK sends is JSON (`rlcore.tinker.server`).

A datum arrives as its model input (token chunks, concatenated) and its named loss inputs; tensors come
dense or sparse CSR, float32 or int64, and become torch tensors of that dtype and shape here. A tensor's
shape is checked against the datum's token count (every loss input is one value per token) before anything
of that shape is allocated, so a small body cannot make the server densify a huge one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from rlcore.tinker.errors import UserError


def _pb():  # the SDK's generated messages (the `tinker` extra)
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def _np_dtype(wire: int) -> type | None:
    pb = _pb()
    return {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}.get(wire)


@dataclasses.dataclass(frozen=True)
class Datum:
    """One sequence of a forward/backward: position i of `tokens` predicts `inputs["target_tokens"][i]`."""

    tokens: Tensor
    """(N,) long: the model input."""
    inputs: Mapping[str, Tensor]
    """The loss inputs by name, each (N,) (or (N, ...)) as sent."""


@dataclasses.dataclass(frozen=True)
class ForwardBackward:
    """A decoded `/forward_backward` body."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: Mapping[str, float]
    data: tuple[Datum, ...]
    forward_only: bool


def _shape(msg, where: str, n: int) -> list[int]:
    """The tensor's shape, if it holds at most `n` values (one per token of its datum), else a UserError."""
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape) or math.prod(shape) > n:
        raise UserError(f"{where}: shape {shape} holds more values than one per token for a datum of {n} tokens; "
                        f"send shape [{n}]")  # fmt: skip
    return shape


def _buffer(data: bytes, dtype: type, where: str) -> Tensor:
    if len(data) % np.dtype(dtype).itemsize:
        raise UserError(f"{where}: {len(data)} bytes are not a whole number of {np.dtype(dtype).name} values")
    return torch.from_numpy(np.frombuffer(data, dtype=dtype).copy())


def _sparse(csr, shape: list[int], np_dtype: type, where: str) -> Tensor:
    values, crow = _buffer(csr.values, np_dtype, where), _buffer(csr.crow_indices, np.int64, where)
    col = _buffer(csr.col_indices, np.int64, where)
    if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values) or len(values) > math.prod(shape):
        raise UserError(f"{where}: a malformed sparse tensor (shape {shape}, {len(crow)} row offsets, {len(col)} "
                        f"columns, {len(values)} values)")  # fmt: skip
    try:
        return torch.sparse_csr_tensor(crow, col, values, size=shape, check_invariants=True).to_dense()
    except RuntimeError as e:
        raise UserError(f"{where}: a malformed sparse tensor ({str(e).splitlines()[0]})") from None


def _tensor(msg, where: str, n: int) -> Tensor:
    np_dtype = _np_dtype(msg.dtype)
    if np_dtype is None:
        raise UserError(f"{where}: dtype {msg.dtype} is not float32 or int64")
    shape = _shape(msg, where, n)
    if msg.HasField("sparse_csr"):
        return _sparse(msg.sparse_csr, shape, np_dtype, where)
    flat = _buffer(msg.dense, np_dtype, where)
    if not shape:
        shape = [flat.numel()]
    if math.prod(shape) != flat.numel():
        raise UserError(f"{where}: shape {shape} does not hold its {flat.numel()} values")
    return flat.reshape(shape)


def _tokens(chunks, where: str) -> Tensor:
    parts = []
    for k, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(f"{where}: model input chunk {k} is {kind}; this server takes token chunks only")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return torch.from_numpy(ids.astype(np.int64))


def decode_forward_backward(body: bytes) -> ForwardBackward:
    """The SDK's `ForwardBackwardRequest` proto as a `ForwardBackward`; malformed bytes are a UserError."""
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError
        raise UserError(f"forward_backward: the body is not a ForwardBackwardRequest ({e})") from None
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") != "number":
            raise UserError(f"loss_fn_config[{k!r}] is {v.text!r}; every loss option here is a number")
        config[k] = float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        where = f"datum {i}"
        tokens = _tokens(d.model_input, where)
        inputs = {name: _tensor(t, f"{where}: loss_fn_inputs[{name!r}]", len(tokens))
                  for name, t in d.loss_fn_inputs.items()}  # fmt: skip
        data.append(Datum(tokens=tokens, inputs=inputs))
    return ForwardBackward(model_id=msg.model_id, seq_id=int(msg.seq_id), loss_fn=msg.loss_fn, config=config,
                           data=tuple(data), forward_only=bool(msg.forward_only))  # fmt: skip


def encode_forward_backward(outputs: Sequence[Mapping[str, Tensor]], metrics: Mapping[str, float]) -> bytes:
    """A `ForwardBackwardOutput` proto: each datum's float32 outputs (e.g. "logprobs"), batched per field
    with byte offsets, and the metrics."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=dict(metrics))
    record = msg.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    for name in outputs[0] if outputs else ():
        arrays = [o[name].detach().to("cpu", torch.float32).contiguous().numpy() for o in outputs]
        sizes = np.array([0, *np.cumsum([a.nbytes for a in arrays])], dtype=np.int64)
        field = record.fields[name]
        field.dtype = pb.DTYPE_FLOAT32
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = sizes.tobytes()
        field.trailing_shape.extend(arrays[0].shape[1:])
    return msg.SerializeToString()


@dataclasses.dataclass(frozen=True)
class Sampled:
    """One sampled sequence of a `SampleResponse`."""

    tokens: Sequence[int]
    logprobs: Sequence[float]
    stop: bool
    """Ended by a stop token or string (else by max_tokens)."""


def encode_sample(sequences: Sequence[Sampled], prompt_logprobs: Sequence[float] | None) -> bytes:
    """A `SampleResponse` proto: int32 tokens and float32 log-probs per sequence, and the prompt's
    log-probs (NaN at position 0, which nothing predicts) when they were asked for."""
    pb = _pb()
    msg = pb.SampleResponse()
    for s in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stop else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()

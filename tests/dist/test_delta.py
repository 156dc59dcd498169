"""Delta weight pushes (issue 62): rlcore.dist.delta's encoding round-trips bit for bit for every dtype a
push carries (NaN payloads, -0.0 and infinities included, tensors of several chunks), a corrupted payload
or a drifted mirror is caught by the checksum, and few changed elements cost few bytes; then the protocol
(rlcore.dist.transfer.broadcast_delta / receive_delta) on 2 gloo ranks over successive versions, the
fallback to a full push taken once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlcore.dist import delta
from rlcore.dist.delta import PushCopy, as_bytes, decode_all, encode_all
from rlcore.step.faults import Hooks

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool]  # fmt: skip


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def random_tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g) * 0.02).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(low, high, (numel,), generator=g, dtype=torch.int64).to(dtype)


def changed(t: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    """`t` with `share` of its elements changed (floats by a small relative step, others flipped)."""
    g = torch.Generator().manual_seed(seed)
    where = torch.rand(t.shape, generator=g) < share
    if t.dtype == torch.bool:
        return torch.where(where, ~t, t)
    if t.dtype.is_floating_point:
        return torch.where(where, t * (1 + 1e-2 * torch.randn(t.shape, generator=g)).to(t.dtype), t)
    return torch.where(where, t ^ 1, t)


def special_bits(dtype: torch.dtype) -> torch.Tensor:
    """NaN (a quiet one and one with a payload), +-inf, +-0.0, a subnormal, as `dtype`."""
    values = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-40, 1.0], dtype=dtype)
    ints = values.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()]).clone()
    ints[0] |= 1  # a NaN with a payload bit: its bits must arrive as they were
    return ints.view(dtype)


def round_trip(new: dict, base: dict, **kw) -> tuple[dict, list, list]:
    records = encode_all(new, base, **kw)
    got, bad = decode_all([(r.entry, r.payload.clone()) for r in records], base, **kw)
    return got, bad, records


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_delta_round_trips_bit_for_bit(dtype) -> None:
    """Several chunks, a few elements changed: "xor"; every bit back, the base untouched."""
    numel = 2 * delta.CHUNK_BYTES // torch.empty((), dtype=dtype).element_size() + 123  # 3 chunks
    base = random_tensor(dtype, numel, 0)
    new = changed(base, 0.01, 1)
    if dtype.is_floating_point:  # special values where the base had ordinary ones, and the other way round
        new[:7] = special_bits(dtype)
        base[-7:] = special_bits(dtype)
    kept = base.clone()
    got, bad, records = round_trip({"w": new}, {"w": base})
    assert bad == []
    assert records[0].entry.encoding == "xor" and len(records[0].entry.planes) == 3 * new.element_size()
    assert same_bits(got["w"], new)
    assert same_bits(base, kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_special_bit_patterns_round_trip_against_each_other(dtype) -> None:
    """-0.0 against 0.0, NaN against NaN with a payload, inf against -inf: only the bits count."""
    base = special_bits(dtype).repeat(1000)
    new = base.flip(0).contiguous()
    new[0] = -0.0
    got, bad, _ = round_trip({"w": new}, {"w": base})
    assert bad == [] and same_bits(got["w"], new)


def test_a_push_without_a_base_or_with_another_shape_is_raw_and_arrives_whole() -> None:
    new = {"a": random_tensor(torch.float32, 1000, 0).reshape(10, 100), "scalar": torch.tensor(3.5),
           "empty": torch.zeros(0, 4), "flags": random_tensor(torch.bool, 17, 1),
           "grown": random_tensor(torch.bfloat16, 20, 2)}  # fmt: skip
    base = {"grown": random_tensor(torch.bfloat16, 10, 3), "flags": new["flags"].to(torch.uint8)}
    got, bad, records = round_trip(new, base)
    assert bad == [] and list(got) == list(new)
    assert all(r.entry.encoding == "raw" for r in records)  # no base, another shape, another dtype
    assert all(same_bits(got[name], t) for name, t in new.items())


def test_an_unchanged_tensor_costs_a_few_bytes_and_a_changed_one_goes_raw() -> None:
    base = {"same": random_tensor(torch.float32, 100_000, 0), "noise": random_tensor(torch.int32, 100_000, 1)}
    new = {"same": base["same"].clone(), "noise": random_tensor(torch.int32, 100_000, 2)}
    got, bad, records = round_trip(new, base)
    same, noise = (r.entry for r in records)
    assert bad == [] and same.encoding == "xor" and same.length < 0.01 * 400_000
    assert noise.encoding == "raw" and noise.length == 400_000  # a delta would not be smaller
    assert all(same_bits(got[name], t) for name, t in new.items())


def test_few_changed_bf16_elements_send_few_bytes() -> None:
    """2% of a bf16 tensor's elements changed: the delta is a small part of the tensor's bytes."""
    base = random_tensor(torch.bfloat16, 1_000_000, 0)
    new = changed(base, 0.02, 1)
    assert 0.01 < (new != base).float().mean() < 0.03
    got, bad, records = round_trip({"w": new}, {"w": base})
    assert bad == [] and same_bits(got["w"], new)
    assert records[0].entry.encoding == "xor" and records[0].entry.length < 0.15 * 2_000_000


def corrupted(records: list, k: int, index: int) -> list:
    payload = records[k].payload.clone()
    payload[index] ^= 0x01
    return [*records[:k], delta.Encoded(records[k].entry, payload), *records[k + 1 :]]


def test_a_corrupted_payload_or_a_drifted_mirror_is_caught() -> None:
    base = {"d": random_tensor(torch.float32, 50_000, 0), "r": random_tensor(torch.bfloat16, 100, 1)}
    new = {"d": changed(base["d"], 0.05, 2), "r": random_tensor(torch.bfloat16, 100, 3)}
    records = encode_all(new, {"d": base["d"]})
    assert [r.entry.encoding for r in records] == ["xor", "raw"]
    pairs = lambda rs: [(r.entry, r.payload.clone()) for r in rs]  # noqa: E731
    for k, index in ((0, 0), (0, records[0].entry.length // 2), (0, records[0].entry.length - 1), (1, 7)):
        got, bad = decode_all(pairs(corrupted(records, k, index)), base)
        assert len(bad) == 1 and bad[0].startswith(f"{'dr'[k]}: "), (k, index, bad)
        assert "dr"[k] not in got
    drifted = dict(base, d=base["d"].clone())
    drifted["d"][123] = -drifted["d"][123]  # the receiver's mirror is not the sender's base
    assert decode_all(pairs(records), drifted)[1] == ["d: checksum disagrees"]
    truncated = [(records[0].entry, records[0].payload[:-1].clone())]
    assert len(decode_all(truncated, base)[1]) == 1
    assert decode_all(pairs(records), base)[1] == []


def test_the_fault_hook_corrupts_one_delta_at_its_step_only() -> None:
    base = {"d": random_tensor(torch.float32, 10_000, 0)}
    records = encode_all({"d": changed(base["d"], 0.05, 1)}, base)
    hooks = Hooks(corrupt_delta_at=2)
    assert hooks.corrupt_delta(1, records) is records and Hooks().corrupt_delta(0, records) is records
    hit = hooks.corrupt_delta(2, records)
    assert not torch.equal(hit[0].payload, records[0].payload) and hit[0].entry == records[0].entry
    assert len(decode_all([(r.entry, r.payload) for r in hit], base)[1]) == 1
    assert Hooks.from_env({"RLCORE_TEST_CORRUPT_DELTA": "2"}).corrupt_delta_at == 2


# ---------------------------------------------------------------- the protocol on 2 gloo ranks

SENDER, VERSIONS, CORRUPT_AT = 1, 5, 3


def version(v: int) -> dict[str, torch.Tensor]:
    """The weights of version `v` (every rank computes the same): `frozen` never changes, `ones`/`half`/
    `flags`/`big` change in 1% of their elements a version, `all` everywhere, `steps` by a counter."""
    out = {"frozen": random_tensor(torch.float32, 3000, 0).reshape(30, 100),
           "ones": random_tensor(torch.float32, 20_000, 1), "half": random_tensor(torch.bfloat16, 30_000, 2),
           "flags": random_tensor(torch.bool, 5000, 3), "big": random_tensor(torch.float32, 1_200_000, 4),
           "all": random_tensor(torch.float16, 4000, 5 + v), "steps": torch.tensor(v)}  # fmt: skip
    for k in range(1, v + 1):
        for i, name in enumerate(("ones", "half", "flags", "big")):
            out[name] = changed(out[name], 0.01, 100 * k + i)
    return out


def protocol_worker(rank: int, directory: str) -> None:
    """Rank 1 pushes versions 0..VERSIONS-1 (the first against an empty base, version CORRUPT_AT with a
    corrupted delta); rank 0 receives each into its mirror and saves it."""
    from rlcore.dist.transfer import broadcast_delta, receive_delta

    torch.set_num_threads(1)
    out = Path(directory)
    store = dist.FileStore(str(out / "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        copy, log = PushCopy(), []
        for v in range(VERSIONS):
            if rank == SENDER:
                new = version(v)
                records = Hooks(corrupt_delta_at=CORRUPT_AT).corrupt_delta(v, encode_all(new, copy.tensors))
                sent = broadcast_delta(records, new, src=SENDER)
                copy.replace(new)
                log.append([sent.bytes, sent.full_bytes, sent.fallbacks])
            else:
                tensors, fallbacks = receive_delta(copy.tensors, src=SENDER)
                copy.replace(tensors)
                torch.save(tensors, out / f"received{v}.pt")
                log.append(fallbacks)
        torch.save(log, out / f"log{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_successive_delta_pushes_leave_the_receiver_bit_for_bit_equal(tmp_path) -> None:
    mp.spawn(protocol_worker, args=(str(tmp_path),), nprocs=2, join=True)
    sent, fallbacks = torch.load(tmp_path / "log1.pt"), torch.load(tmp_path / "log0.pt")
    for v in range(VERSIONS):
        expected, got = version(v), torch.load(tmp_path / f"received{v}.pt")
        assert list(got) == list(expected), v
        for name, tensor in expected.items():
            assert same_bits(got[name], tensor), (v, name)
    assert fallbacks == [0, 0, 0, 1, 0] and [f for *_, f in sent] == fallbacks
    full = sent[0][1]
    assert sent[0][0] == full  # the first push: everything raw
    for v in (1, 2, 4):
        assert sent[v][0] < 0.1 * full, (v, sent[v])  # 1% of "big" (4.8 of 5 MB) changes
    assert sent[CORRUPT_AT][0] > full  # the delta, then the full push

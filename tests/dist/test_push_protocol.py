"""rlcore.dist.push, the weight push both split placements use, on 2 gloo ranks (rank 1 sends, rank 0
receives): an announcement without weights, a full push, a LoRA policy's adapters, delta pushes (the
first against an empty base, one with few changes, one corrupted that falls back to a full push) and a
full push sent without waiting, its announcement received in the background. Each arrives with the
announcement the sender made and exactly the tensors the sender's model holds, in its order, dtypes and
values (what `rlcore.dist.transfer.weight_manifest` says a push of it sends)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlcore.dist import push
from rlcore.models.lora import push_state
from rlcore.dist.delta import PushCopy, as_bytes
from rlcore.dist.stream import unique_state
from rlcore.dist.transfer import weight_manifest
from rlcore.models import load_policy
from rlcore.step.faults import Hooks

SENDER = 1
CORRUPT_AT = 5  # the step of the corrupted delta push
PUSHES = ["unchanged", "full", "adapters", "delta_first", "delta_few", "delta_corrupt", "full_async"]


def lora_policy() -> torch.nn.Module:
    from rlcore.models.lora import apply_lora

    model, _ = load_policy("builtin:tiny", seed=1)
    torch.manual_seed(7)
    model = apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape) * 0.05)
    return model


def nudged(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """`model` with a few elements of one matrix changed (what one small step of training does)."""
    with torch.no_grad():
        weight = dict(model.named_parameters())["model.layers.0.mlp.up_proj.weight"]
        g = torch.Generator().manual_seed(seed)
        weight.view(-1)[torch.randint(0, weight.numel(), (8,), generator=g)] += 0.01
    return model


def sent_state(model: torch.nn.Module | None) -> list[tuple[str, torch.Tensor]]:
    if model is None:
        return []
    return [(n, t.detach().clone()) for n, t in (push_state(model) or unique_state)(model)]


def sender(directory: Path) -> None:
    model, _ = load_policy("builtin:tiny", seed=1)
    lora, base, log = lora_policy(), PushCopy(), []
    hooks = Hooks(corrupt_delta_at=CORRUPT_AT)
    plan = [(lambda: None, None), (lambda: model, None), (lambda: lora, None), (lambda: model, base),
            (lambda: nudged(model, 0), base), (lambda: nudged(model, 1), base),
            (lambda: nudged(model, 2), None)]  # fmt: skip
    for step, (make, delta) in enumerate(plan):
        which = make()
        expected = sent_state(which)
        state = push_state(which) if which is not None else None
        sent = push.send_push(which, step=step, version=10 + step, src=SENDER, group=None, bucket_bytes=1,
                              state=state, base=delta, async_op=PUSHES[step] == "full_async",
                              corrupt=lambda records, s=step: hooks.corrupt_delta(s, records))  # fmt: skip
        for work in sent.works:
            work.wait()
        manifest = weight_manifest(which, push_state(which)) if which is not None else []
        log.append({"note": sent.note, "tensors": sent.tensors, "bytes": sent.bytes,
                    "full_bytes": sent.full_bytes, "fallbacks": sent.fallbacks, "works": len(sent.works),
                    "expected": expected, "manifest": manifest})  # fmt: skip
    torch.save(log, directory / "sender.pt")


def receiver(directory: Path) -> None:
    mirror, log = PushCopy(), []
    for name in PUSHES:
        if name == "full_async":  # stream mode's inbox: the announcement arrives in the background
            wire = push.Announcement.buffer(torch.device("cpu"))
            dist.broadcast(wire, SENDER, async_op=True).wait()
            note = push.Announcement.from_tensor(wire)
        else:
            note = push.receive_announcement(src=SENDER, group=None)
        got: list[tuple[str, torch.Tensor]] = []
        kept = mirror if note.kind == "delta" else None
        push.receive_push(note, got.extend, src=SENDER, group=None, mirror=kept)
        log.append({"note": note, "got": got})
    torch.save(log, directory / "receiver.pt")


def worker(rank: int, directory: str) -> None:
    torch.set_num_threads(1)
    out = Path(directory)
    dist.init_process_group("gloo", store=dist.FileStore(str(out / "store"), 2), rank=rank, world_size=2)
    try:
        (sender if rank == SENDER else receiver)(out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def pushes(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    directory = tmp_path_factory.mktemp("push")
    mp.spawn(worker, args=(str(directory),), nprocs=2, join=True)
    sent = torch.load(directory / "sender.pt", weights_only=False)
    received = torch.load(directory / "receiver.pt", weights_only=False)
    return {name: (s, r) for name, s, r in zip(PUSHES, sent, received, strict=True)}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


@pytest.mark.parametrize("name", PUSHES)
def test_each_push_arrives_with_its_announcement_and_exactly_the_senders_tensors(pushes, name) -> None:
    sent, received = pushes[name]
    step = PUSHES.index(name)
    assert received["note"] == sent["note"]
    assert sent["note"].step == step and sent["note"].version == 10 + step
    assert sent["note"].changed == (name != "unchanged")
    assert [n for n, _ in received["got"]] == [n for n, _ in sent["expected"]]
    wire = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in received["got"]]
    assert wire == sent["manifest"]  # the order, dtypes and shapes a push of the model sends
    for (n, got), (_, expected) in zip(received["got"], sent["expected"], strict=True):
        assert same_bits(got, expected), n
    assert sent["tensors"] == len(sent["expected"])


def test_the_kind_says_how_the_weights_travel(pushes) -> None:
    kinds = {name: pushes[name][0]["note"].kind for name in PUSHES}
    assert kinds == {"unchanged": "full", "full": "full", "adapters": "adapters", "delta_first": "delta",
                     "delta_few": "delta", "delta_corrupt": "delta", "full_async": "full"}  # fmt: skip
    adapters = [n for n, _ in pushes["adapters"][1]["got"]]
    assert adapters and all("lora_" in n for n in adapters)  # the receivers hold the base
    assert pushes["full_async"][0]["works"] > 0 and pushes["full"][0]["works"] == 0


def test_delta_pushes_send_few_bytes_and_fall_back_to_a_full_push_when_corrupted(pushes) -> None:
    first, few, corrupt = (pushes[name][0] for name in ("delta_first", "delta_few", "delta_corrupt"))
    full = pushes["full"][0]["bytes"]
    assert first["full_bytes"] == few["full_bytes"] == corrupt["full_bytes"] == full
    assert first["bytes"] == full and first["fallbacks"] == 0  # against an empty base: everything raw
    assert few["bytes"] < 0.05 * full and few["fallbacks"] == 0
    assert corrupt["fallbacks"] == 1 and corrupt["bytes"] > full


def test_an_announcement_round_trips_through_its_wire_tensor() -> None:
    for kind in push.KINDS:
        note = push.Announcement(step=3, version=2, changed=True, kind=kind)
        wire = note.to_tensor(torch.device("cpu"))
        assert wire.dtype == torch.int64 and wire.shape == push.Announcement.buffer(wire.device).shape
        assert push.Announcement.from_tensor(wire) == note


def test_a_receiver_refuses_a_push_of_another_kind_before_it_reads_anything() -> None:
    delta = push.Announcement(step=1, version=1, changed=True, kind="delta")
    with pytest.raises(ValueError, match="a delta push arrived at a receiver that expects full or adapter"):
        push.receive_push(delta, list, src=SENDER, group=None)
    full = push.Announcement(step=1, version=1, changed=True, kind="full")
    with pytest.raises(ValueError, match="a full push arrived at a receiver that expects delta pushes"):
        push.receive_push(full, list, src=SENDER, group=None, mirror=PushCopy())


def test_a_delta_push_is_never_sent_without_waiting() -> None:
    with pytest.raises(ValueError, match="cannot be sent without waiting"):
        push.send_push(None, step=0, version=0, src=SENDER, group=None, bucket_bytes=1, base=PushCopy(),
                       async_op=True)  # fmt: skip

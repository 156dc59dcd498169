"""Expert parallelism against FSDP2 alone: one training step of a Qwen3-MoE on 2 gloo ranks, side by side.

    .venv/bin/python experiments/bench_ep.py            # the run in experiments/README.md: ~2.5 minutes
    .venv/bin/python experiments/bench_ep.py --quick    # a small model, 1 pair: checks it runs (< 1 min)
    .venv/bin/python experiments/bench_ep.py --pairs 9 --rows 8

Issue 36. The model is bench_moe's random-100m: a random-init `Qwen3MoeForCausalLM` (vocab 32000,
hidden 512, 8 layers, 8 heads / 4 kv heads of 64, 16 experts of width 384, top-2, renormalised, tied
embeddings; seed 0, routers re-drawn from normal(0, 0.02)), fp32, in train mode, with the experts
implementation transformers picks for it (`grouped_mm` in 5.19). Its experts are 77% of its parameters.
Two configurations over the same 2 ranks (`torch.multiprocessing`, gloo, 1 torch thread each), both
built on every rank from the same seeded model:
- (a) fsdp: `apply_fsdp(model, build_mesh(info))`, FSDP2 over everything, experts included;
- (b) ep: `apply_ep(model, DeviceMesh("cpu", arange(2), ("ep",)))` (8 of the 16 experts per rank), then
  `apply_fsdp(model, mesh, ignored_params=expert_params(model))` for the rest (the trainer's layout).
Each rank trains its own random batch (`--rows` x `--seq` token ids and labels from a generator seeded
by the rank; the same in both configurations). One step = zero_grad, forward, loss = the summed
cross-entropy of the logits at the labels / the global token count (the gradient is the global mean's,
as FSDP2 sums over ranks here), backward; no optimizer step. Timed: barrier, step, barrier, per rank,
wall and CPU seconds (rank 0's; rank 1's agree to the barrier). One warm-up each, then `--pairs`
pairs, the order flipped every pair; reported: the median of each, and ep / fsdp as the median of the
pairs' ratios with their range.

Bytes held per rank: the local parameter shards (DTensor `to_local()`), experts and the rest, after
sharding. (a) also holds, while a layer computes, its whole experts all-gathered (E x 3 i h x 4 bytes;
FSDP2 may prefetch the next layer's), which (b) never does.

Bytes communicated per rank per step, "wire" = what a rank sends with W ranks (ring all-gather: its
shard x (W-1); ring reduce-scatter: (W-1)/W of its input; all-to-all: the rows bound for other ranks).
With X = L E 3 i h x 4 (all the expert weights, fp32), B = the rest of the decoder layers, R = the
root's own parameters (embedding, final norm), N = tokens per rank, k = top-k:
- (a) experts: X (W-1)/W x 3 (all-gather in forward, again in backward as the layers reshard after
  forward, reduce-scatter of the fp32 gradients);
- (b) experts: N k h x 4 x (W-1)/W x 4 L (dispatch and combine all-to-all per layer in forward, their
  reverse in backward; (W-1)/W of the rows leave the rank under even routing), + L E x 8 (W-1)/W for
  the per-expert counts (int64) exchanged in every layer's forward;
- both, the rest: (B x 3 + R x 2) (W-1)/W (the root is not resharded after forward).
A TorchDispatchMode counts the c10d ops of one more (untimed) step of each to check the formulas
(the all-to-alls' wire bytes from their split sizes, so under the real routing).

Agreement: after the timed steps, one more step of each; the global loss (all-reduced) and every
gradient gathered whole (`full_tensor`), compared: |loss a - loss b|, the two gradient norms, and
max |grad a - grad b| / max |grad a| over all parameters.

Floor: FLOPs per rank = 3 x 2 x (body x N + vocab x hidden x N), body = the active parameters but the
embedding (non-expert + top_k / E of the experts), attention scores left out (128 tokens), at the
fp32 `F.linear` rate (per CPU second, 1 thread, best of 3, bench_moe's `linear_gflops`) measured at
the start; "% of floor" = floor / median wall time. Uneven routing gives one ep rank more expert
rows than the other: a line under the table gives each ep rank's expert rows over the even share.
Reports, never asserts; aborts if the model cannot be split over the ranks.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "experiments"))

from bench_mesh import collective_kind, spawn  # noqa: E402
from bench_moe import linear_gflops, random_moe  # noqa: E402

WORLD = 2
SIZES = {
    "full": dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, num_experts=16, moe_intermediate_size=384),
    "quick": dict(vocab_size=4000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, num_experts=8, moe_intermediate_size=64),
}  # fmt: skip
TOP_K = 2
CONFIGS = ("fsdp", "ep")
MB = 1e6


# ---------------------------------------------------------------- ranks


class CommCounter(TorchDispatchMode):
    """Calls, input bytes and wire bytes (what this rank sends, module docstring) of every c10d /
    functional collective by (phase, kind); the all-to-alls' rows received, in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.phase, self.counts, self.received = "forward", {}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = collective_kind(func) if func.namespace in ("c10d", "_c10d_functional") else None
        if found is not None:
            kind, index = found
            payload = [t for t in tree_leaves(args[index]) if isinstance(t, torch.Tensor)]
            nbytes = sum(t.nbytes for t in payload)
            wire = nbytes * {"all_gather": WORLD - 1, "reduce_scatter": (WORLD - 1) / WORLD,
                             "all_reduce": 2 * (WORLD - 1) / WORLD, "broadcast": 1.0}.get(kind, 0.0)  # fmt: skip
            if kind == "all_to_all":
                wire = self._all_to_all(func, args, payload[0])
            calls, total, sent = self.counts.get((self.phase, kind), (0, 0, 0.0))
            self.counts[(self.phase, kind)] = (calls + 1, total + nbytes, sent + wire)
        return func(*args, **kwargs)

    def _all_to_all(self, func, args, x: torch.Tensor) -> float:
        """Bytes of `x` bound for other ranks; records the rows this rank receives (uneven splits)."""
        me = dist.get_rank()
        row = x.nbytes / max(1, x.shape[0])
        out_splits, in_splits = (args[3], args[4]) if func.namespace == "c10d" else (args[1], args[2])
        if not in_splits:  # even splits (the per-expert counts)
            return x.nbytes * (WORLD - 1) / WORLD
        self.received.append((self.phase, int(sum(out_splits))))
        return row * (sum(in_splits) - in_splits[me])


def build(config: str, sizes: dict, mesh) -> torch.nn.Module:
    """The seeded random Qwen3-MoE of `sizes` in train mode, sharded as `config` (module docstring)."""
    from torch.distributed.device_mesh import DeviceMesh

    from rlcore.dist import apply_fsdp
    from rlcore.dist.ep import apply_ep, expert_params

    model = random_moe(sizes, torch.float32).train()
    experts = None
    if config == "ep":
        apply_ep(model, DeviceMesh("cpu", torch.arange(WORLD), mesh_dim_names=("ep",)))
        experts = expert_params(model)
    return apply_fsdp(model, mesh, ignored_params=experts)


def held_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of this rank's parameter shards: experts and the rest."""
    out = {"experts": 0, "rest": 0}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        out["experts" if ".experts." in name else "rest"] += local.numel() * local.element_size()
    return out


def train_step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, counter=None) -> torch.Tensor:
    """One training step (module docstring), `counter.phase` set to forward, then backward; returns the
    local loss term, detached."""
    model.zero_grad(set_to_none=True)
    if counter is not None:
        counter.phase = "forward"
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / (WORLD * labels.numel())
    if counter is not None:
        counter.phase = "backward"
    loss.backward()
    return loss.detach()


def timed(step) -> tuple[float, float]:
    """(wall, CPU) seconds of `step()` between two barriers."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    dist.barrier()
    return time.perf_counter() - wall, time.process_time() - cpu


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, gathered whole (a collective: every rank calls it)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def bench_worker(rank: int, directory: Path, sizes: dict, rows: int, seq: int, pairs: int) -> None:
    """Build both configurations, time them in alternated pairs, count one step's collectives, compare
    losses and gradients; rank 0 saves what it saw (and rank 1's timings and expert rows)."""
    from rlcore.dist import build_mesh, init_distributed

    info = init_distributed("cpu")
    mesh = build_mesh(info)
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, sizes["vocab_size"], (rows, seq + 1), generator=g)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    started = time.perf_counter()
    models = {name: build(name, sizes, mesh) for name in CONFIGS}
    build_s = time.perf_counter() - started
    steps = {name: functools.partial(train_step, model, ids, labels) for name, model in models.items()}
    times = {name: {"wall": [], "cpu": []} for name in CONFIGS}
    warm = {name: timed(steps[name])[0] for name in CONFIGS}  # one warm-up each
    for i in range(pairs):
        for name in CONFIGS if i % 2 == 0 else CONFIGS[::-1]:
            wall, cpu = timed(steps[name])
            times[name]["wall"].append(wall)
            times[name]["cpu"].append(cpu)
    result = {"experts_impl": models["fsdp"].config._experts_implementation, "build_s": build_s, "warm": warm,
              "times": times, "held": {}, "comm": {}, "received": {}, "loss": {}, "grad_norm": {}}  # fmt: skip
    grads = {}
    for name in CONFIGS:
        result["held"][name] = held_bytes(models[name])
        counter = CommCounter()
        with counter:
            loss = train_step(models[name], ids, labels, counter)
        result["comm"][name], result["received"][name] = counter.counts, counter.received
        dist.all_reduce(loss)
        result["loss"][name] = float(loss)
        grads[name] = full_grads(models[name])
        result["grad_norm"][name] = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(t) for t in grads[name].values()])))  # fmt: skip
    a, b = grads["fsdp"], grads["ep"]
    result["same_names"] = sorted(a) == sorted(b)
    scale = max(float(t.abs().max()) for t in a.values())
    result["grad_diff"] = max(float((a[n] - b[n]).abs().max()) for n in a if n in b) / scale
    result["worst"] = max((n for n in a if n in b), key=lambda n: float((a[n] - b[n]).abs().max()))
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, {"times": times, "received": result["received"], "held": result["held"]})
    result["ranks"] = everyone
    if rank == 0:
        torch.save(result, directory / "result.pt")


# ---------------------------------------------------------------- analysis (this process)


def shapes(sizes: dict) -> dict[str, float]:
    """Parameter counts of the model (built here as the ranks build it): experts, non-expert decoder
    layers, root (embedding, tied head and final norm), body (active, without the embedding) and head
    (vocab x hidden)."""
    named = dict(random_moe(sizes, torch.float32).named_parameters())  # the tied embedding once
    experts = sum(p.numel() for n, p in named.items() if ".experts." in n)
    layers = sum(p.numel() for n, p in named.items() if ".layers." in n) - experts
    root = sum(p.numel() for n, p in named.items() if ".layers." not in n)
    head = sizes["vocab_size"] * sizes["hidden_size"]
    body = layers + experts * TOP_K / sizes["num_experts"] + (root - head)
    return {"experts": experts, "layers": layers, "root": root, "body": body, "head": head,
            "total": experts + layers + root}  # fmt: skip


def expected_wire(sizes: dict, p: dict, tokens: int) -> dict[str, dict[str, float]]:
    """Analytic wire bytes per rank per step (module docstring), by configuration and part."""
    f = (WORLD - 1) / WORLD
    h, L, e = sizes["hidden_size"], sizes["num_hidden_layers"], sizes["num_experts"]
    rest = (3 * p["layers"] + 2 * p["root"]) * 4 * f
    ep = 4 * L * tokens * TOP_K * h * 4 * f + L * e * 8 * f
    return {"fsdp": {"experts": 3 * p["experts"] * 4 * f, "rest": rest},
            "ep": {"experts": ep, "rest": rest}}  # fmt: skip


def report(result: dict, sizes: dict, rows: int, seq: int, peak: float) -> None:
    p = shapes(sizes)
    tokens = rows * seq
    flops = 6 * (p["body"] * tokens + p["head"] * tokens)
    floor = flops / (peak * 1e9)
    times = result["times"]
    med = {n: {k: statistics.median(v) for k, v in times[n].items()} for n in CONFIGS}
    ratios = {
        k: [b / a for a, b in zip(times["fsdp"][k], times["ep"][k], strict=True)] for k in ("wall", "cpu")
    }
    h, L, e, i = (
        sizes["hidden_size"],
        sizes["num_hidden_layers"],
        sizes["num_experts"],
        sizes["moe_intermediate_size"],
    )
    print(f"\nmodel: {p['total'] / 1e6:.1f}M parameters ({p['experts'] / 1e6:.1f}M in experts, "
          f"{100 * p['experts'] / p['total']:.0f}%), {(p['body'] + p['head']) / 1e6:.1f}M active; {L} layers, "
          f"{e} experts of width {i}, top-{TOP_K}, hidden {h}; per rank {rows} x {seq} = {tokens} tokens")  # fmt: skip
    print(
        f"experts implementation of (a): {result['experts_impl']}; (b): rlcore.dist.ep's per-expert F.linear loop"
    )
    print(f"built both configurations in {result['build_s']:.1f} s; warm-up steps (wall s): "
          + ", ".join(f"{n} {result['warm'][n]:.2f}" for n in CONFIGS))  # fmt: skip
    print(f"floor per rank: {flops / 1e9:.1f} GFLOP at {peak:.1f} GFLOP/s = {1e3 * floor:.0f} ms")

    counted = {n: sum(wire for _, _, wire in result["comm"][n].values()) for n in CONFIGS}
    expected = expected_wire(sizes, p, tokens)
    loads = expert_rows(result["ranks"], tokens, L)
    print(f"\n| configuration | step wall s (median of {len(times['fsdp']['wall'])}) | step CPU s | "
          "ep / fsdp wall (range) | % of floor | MB held / rank: experts, rest | "
          "MB sent / rank, expected: experts, rest | MB sent / rank, counted (all) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for n in CONFIGS:
        held = result["held"][n]
        r = ratios["wall"]
        ratio = "1" if n == "fsdp" else f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"
        print(f"| {n} | {med[n]['wall']:.3f} | {med[n]['cpu']:.3f} | {ratio} | {100 * floor / med[n]['wall']:.1f}% | "
              f"{held['experts'] / MB:.1f}, {held['rest'] / MB:.1f} | "
              f"{expected[n]['experts'] / MB:.1f}, {expected[n]['rest'] / MB:.1f} | "
              f"{counted[n] / MB:.1f} ({counted[n] / sum(expected[n].values()):.2f}x expected) |")  # fmt: skip
    for n in CONFIGS:
        other = statistics.median(result["ranks"][1]["times"][n]["wall"])
        print(f"{n} steps, wall s in order: " + ", ".join(f"{t:.2f}" for t in times[n]["wall"])
              + "; CPU s: " + ", ".join(f"{t:.2f}" for t in times[n]["cpu"]) + f"; rank 1's median wall {other:.3f}")  # fmt: skip
    r = ratios["cpu"]
    print(f"ep / fsdp CPU time: {statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f}); "
          f"fsdp also all-gathers a whole layer's experts while it computes: {e * 3 * i * h * 4 / MB:.1f} MB "
          f"per layer in flight, which ep never holds")  # fmt: skip
    print(f"ep expert rows per rank and layer (forward dispatch), over the even share {tokens * TOP_K}: "
          + ", ".join(f"rank {rk} {x:.3f}" for rk, x in enumerate(loads)))  # fmt: skip

    print("\ncollectives of one step, rank 0 (calls, input MB, wire MB):")
    for n in CONFIGS:
        for (phase, kind), (calls, nbytes, wire) in sorted(result["comm"][n].items()):
            print(f"  {n:>4s} {phase:>8s} {kind:>14s} {calls:5d} {nbytes / MB:9.2f} {wire / MB:9.2f}")
    la, lb = result["loss"]["fsdp"], result["loss"]["ep"]
    na, nb = result["grad_norm"]["fsdp"], result["grad_norm"]["ep"]
    print(f"\nagreement: loss fsdp {la:.7f}, ep {lb:.7f}, |diff| {abs(la - lb):.1e} ({abs(la - lb) / abs(la):.1e} rel); "
          f"grad norm fsdp {na:.6f}, ep {nb:.6f} ({abs(na - nb) / na:.1e} rel); max |grad diff| / max |grad| "
          f"{result['grad_diff']:.1e} (worst: {result['worst']}); same parameter names: {result['same_names']}")  # fmt: skip


def expert_rows(ranks: list[dict], tokens: int, layers: int) -> list[float]:
    """Each rank's rows computed by its experts (the forward dispatch all-to-alls' received rows, the
    even ones of each layer's two), per layer, over the even share tokens x top-k."""
    out = []
    for r in ranks:
        forward = [rows for phase, rows in r["received"]["ep"] if phase == "forward"][::2]
        out.append(sum(forward) / max(1, len(forward)) / (tokens * TOP_K))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 1 pair")
    parser.add_argument("--pairs", type=int, help="timed pairs (default 7; --quick 1)")
    parser.add_argument("--rows", type=int, help="rows per rank (default 4; --quick 2)")
    parser.add_argument("--seq", type=int, help="tokens per row (default 128; --quick 32)")
    args = parser.parse_args()
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    sizes = SIZES["quick" if args.quick else "full"]
    rows, seq = args.rows or (2 if args.quick else 4), args.seq or (32 if args.quick else 128)
    pairs = args.pairs or (1 if args.quick else 7)
    from transformers import Qwen3MoeConfig

    from rlcore.dist.ep import ep_problem

    problem = ep_problem(Qwen3MoeConfig(**sizes), WORLD)
    if problem:
        raise SystemExit(f"bench_ep: cannot split the model over {WORLD} ranks: {problem}")
    torch.set_num_threads(1)
    peak = linear_gflops(torch.float32)
    print(f"torch {torch.__version__}, 1 thread per rank x {WORLD} gloo ranks, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}; fp32 F.linear (512x512x2048, best of 3, CPU time) {peak:.1f} GFLOP/s",
          flush=True)  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="bench-ep-"))
    started = time.perf_counter()
    spawn(bench_worker, root, sizes, rows, seq, pairs)
    result = torch.load(root / "result.pt", weights_only=False)
    report(result, sizes, rows, seq, peak)
    print(f"\nranks ran {time.perf_counter() - started:.0f} s; load at the end {os.getloadavg()[0]:.1f}; "
          f"fp32 F.linear at the end {linear_gflops(torch.float32):.1f} GFLOP/s")  # fmt: skip


if __name__ == "__main__":
    main()

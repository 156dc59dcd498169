"""Tensor and sequence parallelism on 2 gloo ranks: Ulysses activation memory, tp step time, bytes moved.

    .venv/bin/python experiments/bench_mesh.py            # the three parts, ~5 minutes on 2 cores
    .venv/bin/python experiments/bench_mesh.py --quick    # small sizes, 2 trainer steps: checks it runs (~1 min)

Issue 21. The fp32 matmul peak of the machine (benchlib, both cores) is measured at the start (every
floor below is FLOPs / that peak, "%" is floor / measured time) and again at the end (the drift).
1. Activation memory (one Llama: hidden 256, 4 layers, 8 heads, 4 KV heads, MLP 688, vocab 2,000):
   one forward + backward of the policy's log-prob loss (sum of `response_logprobs` x response_mask)
   on 2 rows of a 16-token prompt and a response of each length, sp 1 in this process (2 threads) and
   sp 2 on 2 gloo ranks (`apply_sp`, 1 thread each); seconds are the best of 3. Activation memory is
   the bytes of the tensors saved for backward during the forward (`saved_tensors_hooks`, each
   storage once, parameters left out), per rank; "largest" is the largest saved storage (the
   logits). Then, for the budget of sp 1 at the middle length, the longest measured length that fits
   at each sp, and where a line through each sp's bytes meets it; and max |sp 2 - sp 1| log-prob at
   each length (the numbers are of the same computation).
2. Step time: the real train.py under torchrun, 2 ranks, dp 2 (FSDP2) and tp 2 alternated; medians
   of steps 2.. (step 1 warms up). Both train the same global batch per step (tp: one dp coordinate
   whose two ranks train all of it; dp: each rank half), so per-sample time has the step's ratio.
   Floors: update 6 x params x tokens trained, generation 2 x params x tokens generated.
3. Bytes through collectives per update: one micro-batch forward + backward + AdamW step on 2 gloo
   ranks for each layout (tp 2: `apply_tp`, both ranks the whole micro-batch; dp 2: `apply_fsdp`, each
   rank half of it), every c10d and functional collective counted by a TorchDispatchMode (DTensor
   calls `_c10d_functional` ops, which bypass the Python `torch.distributed` functions), against the
   analytic expectation. "input" is the payload handed to the collective, "wire" what a rank sends
   in a ring over 2 ranks (all-reduce: its input; all-gather: its shard; reduce-scatter: half its input).
Reports, never asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchlib import matmul_gflops, median_time, rollout  # noqa: E402

WORLD = 2
SHAPE = {"hidden": 256, "layers": 4, "heads": 8, "kv": 4, "mlp": 688, "vocab": 2000}
PROMPT, ROWS = 16, 2
LENGTHS = {"full": [256, 512, 1024, 2048, 4096], "quick": [32, 64, 128]}
MiB = 2**20


# ---------------------------------------------------------------- shared


def llama() -> torch.nn.Module:
    """The seeded fp32 Llama of SHAPE (sdpa attention), in train mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPE
    config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["mlp"],
                         num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                         num_key_value_heads=s["kv"], max_position_embeddings=8192, tie_word_embeddings=True,
                         attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def batch_of(rows: int, response: int, seed: int = 0):
    """`rows` rows of a PROMPT-token prompt and a `response`-token response, every token real."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, SHAPE["vocab"], (rows, PROMPT), generator=g)
    responses = torch.randint(7, SHAPE["vocab"], (rows, response), generator=g)
    return rollout(ids, torch.ones_like(ids), responses, torch.ones(rows, response))


def loss_backward(model, batch) -> torch.Tensor:
    """Forward + backward of sum(response_logprobs x response_mask); the log-probs (rows, r), detached."""
    from rlcore.models.forward import model_inputs, response_logprobs

    inputs = model_inputs(model, batch, share_prompts=False)
    logprobs, _ = response_logprobs(model, inputs, temperature=1.0, entropy=False)
    (logprobs * batch["response_mask"][:, : logprobs.shape[1]]).sum().backward()
    return logprobs.detach()


def fwd_bwd_flops(rows: int, response: int) -> float:
    """Useful FLOPs of one forward + backward: 6 x matmul params x tokens, the lm_head on the response
    positions only, and causal attention's half of 12 x S^2 x hidden per layer and row."""
    s = SHAPE
    head = s["hidden"] // s["heads"]
    layer = s["hidden"] * head * (2 * s["heads"] + 2 * s["kv"]) + 3 * s["hidden"] * s["mlp"]
    seq = PROMPT + response
    linear = 6 * rows * seq * s["layers"] * layer + 6 * rows * response * s["vocab"] * s["hidden"]
    return linear + 6 * rows * seq**2 * s["hidden"] * s["layers"]


def spawn(worker: str | Callable[..., None], directory: Path, *args) -> None:
    """Run `worker(rank, directory, *args)` on WORLD gloo ranks, one thread each (a name: this module's
    function; another benchmark passes its own function)."""
    store = tempfile.mktemp(prefix=f"store-{worker}-", dir=directory)  # a fresh FileStore per spawn
    mp.spawn(_entry, args=(worker, store, str(directory), args), nprocs=WORLD, join=True)


def _entry(rank: int, worker: str | Callable[..., None], store: str, directory: str, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", store=dist.FileStore(store, WORLD), rank=rank, world_size=WORLD)
    try:
        (worker if callable(worker) else globals()[worker])(rank, Path(directory), *args)
    finally:
        dist.destroy_process_group()


def mesh1d(name: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,), mesh_dim_names=(name,))


# ---------------------------------------------------------------- part 1: activation memory


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Within the block, every storage saved for backward once (parameters' storages left out)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, torch.UntypedStorage] = {}  # held, so that no address is reused

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.skip and storage.nbytes():
                self.storages[storage.data_ptr()] = storage
            return t

        super().__init__(pack, lambda t: t)

    def total(self) -> int:
        return sum(s.nbytes() for s in self.storages.values())

    def largest(self) -> int:
        return max((s.nbytes() for s in self.storages.values()), default=0)


def measure_lengths(model, lengths: list[int]) -> list[dict]:
    """Per response length: saved bytes, largest saved storage, seconds, log-probs (a warm-up first)."""
    loss_backward(model, batch_of(ROWS, lengths[0]))
    out = []
    for length in lengths:
        model.zero_grad(set_to_none=True)
        batch = batch_of(ROWS, length)
        saved = SavedBytes(model)
        with saved:
            logprobs = loss_backward(model, batch)
        seconds = min(median_time(lambda b=batch: loss_backward(model, b), 1, warmup=0) for _ in range(3))
        out.append({"saved": saved.total(), "largest": saved.largest(), "s": seconds, "logprobs": logprobs})
    return out


def sp_worker(rank: int, directory: Path, lengths: list[int]) -> None:
    """measure_lengths on the model of `directory` under Ulysses sp over both ranks; saved per rank."""
    from rlcore.dist.ulysses import apply_sp

    model = llama()
    model.load_state_dict(torch.load(directory / "llama.pt", weights_only=True))
    apply_sp(model, mesh1d("sp"))
    torch.save(measure_lengths(model, lengths), directory / f"sp-rank{rank}.pt")


def memory_part(root: Path, quick: bool, peak: float) -> None:
    lengths = LENGTHS["quick" if quick else "full"]
    model = llama()
    torch.save(model.state_dict(), root / "llama.pt")
    print(f"\nPart 1: activation memory of one log-prob forward + backward, {ROWS} rows x ({PROMPT} prompt + "
          f"response) tokens, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params")  # fmt: skip
    one = measure_lengths(model, lengths)
    spawn("sp_worker", root, lengths)
    two = [torch.load(root / f"sp-rank{r}.pt", weights_only=True) for r in range(WORLD)]
    head = ("sp1 MB", "sp2 r0 MB", "sp2 r1 MB", "sp2/sp1", "largest 1/2", "sp1 s", "sp2 s", "floor s",
            "sp1 %", "sp2 %", "max|dlp|")  # fmt: skip
    print(f"{'response':>8s} " + " ".join(f"{h:>11s}" for h in head))
    for i, length in enumerate(lengths):
        a, b = one[i], [two[r][i] for r in range(WORLD)]
        sp2, sp2_s = max(x["saved"] for x in b), max(x["s"] for x in b)
        floor = fwd_bwd_flops(ROWS, length) / peak
        diff = (b[0]["logprobs"] - a["logprobs"]).abs().max().item()
        row = (f"{a['saved'] / MiB:11.1f}", f"{b[0]['saved'] / MiB:11.1f}", f"{b[1]['saved'] / MiB:11.1f}",
               f"{sp2 / a['saved']:11.3f}", f"{a['largest'] / MiB:5.1f}/{b[0]['largest'] / MiB:<5.1f}",
               f"{a['s']:11.3f}", f"{sp2_s:11.3f}", f"{floor:11.3f}", f"{100 * floor / a['s']:10.0f}%",
               f"{100 * floor / sp2_s:10.0f}%", f"{diff:11.2e}")  # fmt: skip
        print(f"{length:8d} " + " ".join(row))
    budget_line(lengths, [x["saved"] for x in one], [max(two[r][i]["saved"] for r in range(WORLD))
                                                       for i in range(len(lengths))])  # fmt: skip


def budget_line(lengths: list[int], sp1: list[int], sp2: list[int]) -> None:
    """The longest measured response within sp 1's bytes at the middle length, and where a line through
    each sp's measured bytes meets that budget."""
    budget = sp1[len(lengths) // 2]
    fits = [max((n for n, b in zip(lengths, sp, strict=True) if b <= budget), default=0) for sp in (sp1, sp2)]
    lines = [statistics.linear_regression(lengths, sp) for sp in (sp1, sp2)]
    reach = [(budget - intercept) / slope for slope, intercept in lines]
    print(f"budget {budget / MiB:.1f} MB per rank (sp 1 at {lengths[len(lengths) // 2]}): longest measured "
          f"response that fits: sp 1 {fits[0]}, sp 2 {fits[1]}; on a line through the measured bytes: "
          f"sp 1 {reach[0]:.0f}, sp 2 {reach[1]:.0f} ({reach[1] / reach[0]:.2f}x)")  # fmt: skip


# ---------------------------------------------------------------- part 2: trainer step time

LAYOUTS = {"dp 2": ([], 2), "tp 2": (["--trainer.tp", "2"], 1)}  # flags, data-parallel size


def torchrun(args: list[str], out: Path, timeout: float = 600) -> list[dict]:
    """train.py grpo on 2 torchrun ranks; its metrics records."""
    from rlcore.trainer.logger import read_metrics
    from tests.smoke.test_torchrun import torchrun as launch

    proc = launch("grpo", *args, "--log.no-progress", "--out-dir", str(out), timeout=timeout, nproc=WORLD)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return read_metrics(out / "metrics.jsonl")


def step_row(records: list[dict], dp: int, samples: int, params: float, peak: float) -> dict:
    """Medians of steps 2.. and their floors: update 6 P x trained tokens, generation 2 P x generated."""

    def med(key: str) -> float:
        return statistics.median(r[key] for r in records)

    trained = med("throughput/tokens_per_s") * med("timing/step_s") * dp  # every rank's tokens, summed
    generated = med("response/length_mean") * samples
    update_floor, gen_floor = 6 * params * trained / peak, 2 * params * generated / peak
    return {"step": med("timing/step_s"), "update": med("timing/update_s"), "rollout": med("timing/rollout_s"),
            "sync": med("timing/sync_s"), "trained": trained, "update_floor": update_floor,
            "step_floor": update_floor + gen_floor}  # fmt: skip


def step_part(root: Path, quick: bool, rounds: int, peak: float) -> None:
    steps, prompts, n = (2 if quick else 4), 4, 4
    common = ["--model.path", "builtin:small", "--trainer.steps", str(steps), "--data.batch-size", str(prompts),
              "--rollout.n", str(n), "--rollout.max-tokens", "32", "--trainer.val-every", "0"]  # fmt: skip
    print(f"\nPart 2: train.py grpo, builtin:small, {steps} steps of {prompts} prompts x {n}, 32 tokens, "
          f"{rounds} alternated round(s); medians of steps 2..")  # fmt: skip
    later: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    params = 0.0
    for i in range(rounds):
        for name, (flags, _) in LAYOUTS.items():
            records = torchrun([*common, *flags], root / f"train-{name.replace(' ', '')}-{i}")
            params = records[0]["model/params"]
            later[name] += [r for r in records if r["step"] >= 2]
    rows = {name: step_row(later[name], dp, prompts * n, params, peak) for name, (_, dp) in LAYOUTS.items()}
    head = ("step s", "update s", "rollout s", "sync s", "ms/sample", "tokens", "upd floor", "upd %",
            "step floor", "step %")  # fmt: skip
    print(f"{params / 1e6:.2f}M params, {prompts * n} samples trained per step in both layouts")
    print(f"{'layout':>6s} " + " ".join(f"{h:>10s}" for h in head))
    for name, r in rows.items():
        vals = (r["step"], r["update"], r["rollout"], r["sync"], 1e3 * r["step"] / (prompts * n), r["trained"],
                r["update_floor"], 100 * r["update_floor"] / r["update"], r["step_floor"],
                100 * r["step_floor"] / r["step"])  # fmt: skip
        print(f"{name:>6s} " + " ".join(f"{v:10.4g}" for v in vals))
    tp, dp = rows["tp 2"], rows["dp 2"]
    print(
        f"tp2/dp2: step {tp['step'] / dp['step']:.2f}x, update {tp['update'] / dp['update']:.2f}x, "
        f"rollout {tp['rollout'] / dp['rollout']:.2f}x, per trained sample {tp['step'] / dp['step']:.2f}x"
    )


# ---------------------------------------------------------------- part 3: bytes through collectives

WIRE = {"all_reduce": 1.0, "all_gather": 1.0, "reduce_scatter": 0.5, "all_to_all": 0.5, "broadcast": 1.0}
"""Bytes a rank sends per byte of its input, ring algorithms over 2 ranks."""


def collective_kind(func) -> tuple[str, int] | None:
    """(kind, index of the sent payload among the op's arguments) of a collective op, None for others."""
    name = func.__name__.split(".")[0].strip("_")
    for kind, words in (("all_gather", ("allgather", "all_gather")), ("reduce_scatter", ("reduce_scatter",)),
                        ("all_to_all", ("alltoall", "all_to_all")), ("all_reduce", ("allreduce", "all_reduce")),
                        ("broadcast", ("broadcast",))):  # fmt: skip
        if any(w in name for w in words):
            inplace = func.namespace == "c10d" and kind in ("all_gather", "reduce_scatter", "all_to_all")
            return kind, 1 if inplace else 0  # c10d's (output, input, ...) vs functional (input, ...)
    return None


class CommCounter(TorchDispatchMode):
    """Calls and input bytes of every c10d / functional collective, by (phase, kind)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase, self.counts = "forward", {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = collective_kind(func) if func.namespace in ("c10d", "_c10d_functional") else None
        if found is not None:
            payload = [t for t in tree_leaves(args[found[1]]) if isinstance(t, torch.Tensor)]
            calls, nbytes = self.counts.get((self.phase, found[0]), (0, 0))
            self.counts[(self.phase, found[0])] = (calls + 1, nbytes + sum(t.nbytes for t in payload))
        return func(*args, **kwargs)


def comm_worker(rank: int, directory: Path, layout: str, rows: int, response: int) -> None:
    """One counted update (after one uncounted warm-up) of `layout` on the micro-batch of `rows` rows."""
    from rlcore.dist import apply_fsdp, apply_tp

    model = llama()
    batch = batch_of(rows, response, seed=1)
    if layout == "tp 2":
        apply_tp(model, mesh1d("tp"))  # both ranks train every row
    else:
        apply_fsdp(model, mesh1d("dp_shard"))
        batch = batch[rank * rows // WORLD : (rank + 1) * rows // WORLD]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    counter = CommCounter()
    for counted in (False, True):
        optimizer.zero_grad(set_to_none=True)
        with counter if counted else contextlib.nullcontext():
            _forward_backward_step(model, batch, optimizer, counter)
    torch.save(counter.counts, directory / f"comm-{layout.replace(' ', '')}-rank{rank}.pt")


def _forward_backward_step(model, batch, optimizer, counter: CommCounter) -> None:
    from rlcore.models.forward import model_inputs, response_logprobs

    counter.phase = "forward"
    logprobs, _ = response_logprobs(model, model_inputs(model, batch, share_prompts=False))
    loss = (logprobs * batch["response_mask"]).sum()
    counter.phase = "backward"
    loss.backward()
    counter.phase = "step"
    optimizer.step()


def expected_bytes(layout: str, rows: int, response: int) -> dict[tuple[str, str], float]:
    """Analytic input bytes per rank: tp 2 all-reduces of (tokens x hidden) fp32 per layer in forward
    and 2 in backward (Megatron's fused minimum); FSDP2 all-gathers of every unit's shard in forward,
    the decoder layers' again in backward (resharded after forward), reduce-scatter of every gradient."""
    s = SHAPE
    if layout == "tp 2":
        act = rows * (PROMPT + response) * s["hidden"] * 4
        return {
            ("forward", "all_reduce"): 2 * s["layers"] * act,
            ("backward", "all_reduce"): 2 * s["layers"] * act,
        }
    model = llama()
    total = sum(p.numel() for p in model.parameters()) * 4
    layers = sum(p.numel() for p in model.model.layers.parameters()) * 4
    return {("forward", "all_gather"): total / WORLD, ("backward", "all_gather"): layers / WORLD,
            ("backward", "reduce_scatter"): total}  # fmt: skip


def comm_part(root: Path, quick: bool) -> None:
    rows, response = (4, 48) if quick else (8, 112)
    tokens = rows * (PROMPT + response)
    print(f"\nPart 3: collectives of one update (forward, backward, AdamW step) per rank, a micro-batch of "
          f"{rows} rows x {PROMPT + response} tokens ({tokens} tokens; dp 2: half on each rank)")  # fmt: skip
    print(f"{'layout':>6s} {'phase':>8s} {'collective':>14s} {'calls':>6s} {'input MB':>9s} {'wire MB':>8s} "
          f"{'expected MB':>11s} {'meas/exp':>8s}")  # fmt: skip
    wires = {}
    for layout in LAYOUTS:
        spawn("comm_worker", root, layout, rows, response)
        ranks = [torch.load(root / f"comm-{layout.replace(' ', '')}-rank{r}.pt") for r in range(WORLD)]
        print_counts(layout, ranks[0], expected_bytes(layout, rows, response))
        if ranks[0] != ranks[1]:
            print(f"{'':>6s} (rank 1 differs: {ranks[1]})")
        wires[layout] = sum(b * WIRE[kind] for (_, kind), (_, b) in ranks[0].items())
    even = wires["dp 2"] / wires["tp 2"] * tokens
    print(f"tp2/dp2 wire bytes {wires['tp 2'] / wires['dp 2']:.2f}x; tp's grow with the tokens, FSDP's with the "
          f"parameters: equal at ~{even:.0f} tokens per micro-batch")  # fmt: skip


def print_counts(layout: str, counts: dict, expected: dict) -> None:
    wire = 0.0
    for (phase, kind), (calls, nbytes) in sorted(counts.items()):
        exp = expected.get((phase, kind), 0.0)
        ratio = f"{nbytes / exp:8.2f}" if exp else f"{'-':>8s}"
        wire += nbytes * WIRE[kind]
        print(f"{layout:>6s} {phase:>8s} {kind:>14s} {calls:6d} {nbytes / MiB:9.2f} {nbytes * WIRE[kind] / MiB:8.2f} "
              f"{exp / MiB:11.2f} {ratio}")  # fmt: skip
    total, exp = sum(b for _, b in counts.values()), sum(expected.values())
    print(f"{layout:>6s} {'total':>8s} {'':>14s} {sum(c for c, _ in counts.values()):6d} {total / MiB:9.2f} "
          f"{wire / MiB:8.2f} {exp / MiB:11.2f} {total / exp:8.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="alternated dp/tp trainer runs (part 2)")
    parser.add_argument("--parts", nargs="+", type=int, default=[1, 2, 3])
    args = parser.parse_args()
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    root = Path(tempfile.mkdtemp(prefix="bench-mesh-"))
    peaks = [max(matmul_gflops() for _ in range(3))]  # the best of 3: other work shares these cores
    print(f"torch threads {torch.get_num_threads()}, fp32 matmul peak {peaks[0]:.1f} GFLOP/s")
    peak = peaks[0] * 1e9
    if 1 in args.parts:
        memory_part(root, args.quick, peak)
    if 2 in args.parts:
        step_part(root, args.quick, 1 if args.quick else args.rounds, peak)
    if 3 in args.parts:
        comm_part(root, args.quick)
    peaks.append(max(matmul_gflops() for _ in range(3)))
    print(f"\nfp32 matmul peak at the end {peaks[1]:.1f} GFLOP/s (floors above use the start's)")


if __name__ == "__main__":
    main()

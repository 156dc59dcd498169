"""The Tinker API served by rlcore against train.py, on the same work (issue 60).

    .venv/bin/python experiments/bench_tinker.py            # the default task, then SmolLM2-135M
    .venv/bin/python experiments/bench_tinker.py --quick    # the default task only, 2 pairs

Side A is examples/tinker_rl.py (the cookbook-style loop: the real `tinker` SDK against
`python -m rlcore.tinker`, one sample request per prompt, forward_backward with importance_sampling,
optim_step, save_weights_and_get_sampling_client every step); side B is `python train.py` with the same
model, prompts x samples, max tokens and learning rate (GRPO, one update per step). Each side runs as its own
process(es) with the machine's threads; A and B alternate, `--repeats` pairs. A step's seconds exclude the
first step (warm-up) and validation. Each line gives the median s/step, the ratio A / B (the goal: <= 1.3)
and the floor: 8 x parameters x the tokens of a step, each prompt counted once for its samples (2 to sample
them, 6 to train on them), over the fp32 matmul peak measured in the same run, with the % of it each side
reached.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

import torch  # noqa: E402
from benchlib import lscpu_model, matmul_gflops  # noqa: E402

from rlcore.data.prompts import render_prompt  # noqa: E402
from rlcore.data.tasks import generate_rows  # noqa: E402
from rlcore.models.onednn import cpu_isa  # noqa: E402
from rlcore.models.policy import load_model, load_tokenizer  # noqa: E402
from tests.tinker.server import running  # noqa: E402


def train_py(work: dict, steps: int, out: Path) -> tuple[list[float], float]:
    """(train.py's s/step after the first, its mean response length)."""
    cmd = [sys.executable, str(ROOT / "train.py"), "--model.path", work["model"], "--data.batch-size", str(work["prompts"]),
           "--rollout.n", str(work["group"]), "--rollout.max-tokens", str(work["max_tokens"]), "--optim.lr", str(work["lr"]),
           "--trainer.steps", str(steps), "--trainer.val-every", "0", "--data.builtin-val-size", "8", "--log.no-progress",
           "--out-dir", str(out)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_s = [r["timing/step_s"] for r in records if r.get("step", 0) >= 2 and "timing/step_s" in r]
    return steps_s, statistics.mean(r["response/length_mean"] for r in records if "response/length_mean" in r)


def loop(work: dict, steps: int, workdir: Path) -> list[float]:
    """examples/tinker_rl.py's s/step after the first, through a fresh server."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tinker_rl", ROOT / "examples" / "tinker_rl.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with running(workdir, threads=torch.get_num_threads()) as url:
        os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY="tml-bench")
        _, _, seconds = example.main(steps, base_model=work["model"], rank=0, prompts=work["prompts"],
                                     group=work["group"], max_tokens=work["max_tokens"], lr=work["lr"], val_rows=8)  # fmt: skip
    return seconds[1:]


def compare(work: dict, steps: int, repeats: int, peak: float) -> None:
    sides: dict[str, list[float]] = {"tinker loop": [], "train.py": []}
    lengths = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for name in ("tinker loop", "train.py")[:: 1 if i % 2 else -1]:
                if name == "train.py":
                    s, length = train_py(work, steps, Path(tmp) / f"train{i}")
                    lengths.append(length)
                else:
                    s = loop(work, steps, Path(tmp) / f"server{i}")
                sides[name].append(statistics.median(s))
    params = sum(p.numel() for p in load_model(work["model"]).parameters())
    tokenizer = load_tokenizer(work["model"])
    rows = generate_rows("reverse", "train", work["prompts"])
    prompt = statistics.mean(len(tokenizer.encode(render_prompt(tokenizer, r["prompt"])[0], add_special_tokens=False)) for r in rows)
    tokens = work["prompts"] * (prompt + work["group"] * statistics.mean(lengths))  # each prompt once
    floor = 8 * params * tokens / peak
    print(f"\n### {work['model']} ({params / 1e6:.1f}M parameters, full fine-tuning): {work['prompts']} prompts x "
          f"{work['group']} samples, <= {work['max_tokens']} tokens, {steps} steps, {repeats} pairs")  # fmt: skip
    print("| side | s/step (median of runs) | runs | floor s | % of floor |")
    print("|---|---|---|---|---|")
    for name, v in sides.items():
        s = statistics.median(v)
        print(f"| {name} | {s:.3f} | {', '.join(f'{x:.3f}' for x in v)} | {floor:.4f} | {100 * floor / s:.1f} |")
    ratio = statistics.median(sides["tinker loop"]) / statistics.median(sides["train.py"])
    print(f"tinker loop / train.py s/step: {ratio:.2f} (goal <= 1.3)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the default task only, 2 pairs")
    parser.add_argument("--repeats", type=int, default=3, help="loop / train.py pairs per model")
    args = parser.parse_args()
    torch.manual_seed(0)
    peak = matmul_gflops() * 1e9
    print(f"## bench_tinker, {datetime.date.today()}: {lscpu_model()} ({cpu_isa()}), {torch.get_num_threads()} "
          f"threads, fp32 matmul peak {peak / 1e9:.0f} GFLOP/s")  # fmt: skip
    default = {"model": "builtin:tiny-reverse", "prompts": 32, "group": 8, "max_tokens": 12, "lr": 1e-3}
    compare(default, 12, 2 if args.quick else args.repeats, peak)
    if not args.quick:
        from tests.real_model import smollm2_gguf

        smol = {"model": str(smollm2_gguf()), "prompts": 8, "group": 4, "max_tokens": 32, "lr": 1e-6}
        compare(smol, 5, max(2, args.repeats - 1), peak)


if __name__ == "__main__":
    main()

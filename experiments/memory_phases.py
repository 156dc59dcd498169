"""Where a train.py run's memory goes, phase by phase (issue 61, the first measurement).

    .venv/bin/python experiments/memory_phases.py              # SmolLM2-135M, GRPO 8 prompts x 8 samples, <= 48 tokens
    .venv/bin/python experiments/memory_phases.py --model builtin:tiny-reverse

Runs `train.py` in this process for 2 steps and samples the process's resident memory (RSS, /proc) every
millisecond on a thread, labelled with the trainer phase running (`rlcore.step.phases.phase`: rollout,
scoring, logprobs, update, sync, validation, checkpoint; "outside phases": loading, building, between steps).
Prints each phase's peak RSS and the largest rise of RSS within one occurrence of it, next to the optimizer floor (16 bytes per trained parameter: fp32 weights,
gradients, AdamW's two moments) and `perf/max_memory_mb` of the run. RSS is the check the issue asks for; the
breakdown inside a phase (activations, logits, KV cache, slack) is the next measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from benchlib import lscpu_model  # noqa: E402

PAGE = 4096


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Sampler:
    """RSS every millisecond, its peak per phase, and the RSS when each phase began."""

    def __init__(self) -> None:
        self.current, self.peaks, self.rises, self.order = "outside phases", {}, {}, []
        self._occurrence = 0  # the peak RSS of the phase running now, since it began
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = rss()
            self.peaks[self.current] = max(self.peaks.get(self.current, 0), now)
            self._occurrence = max(self._occurrence, now)
            time.sleep(0.001)

    @contextlib.contextmanager
    def phase(self, name: str):
        outer, start = self.current, rss()
        if name not in self.order:
            self.order.append(name)
        self.current, self._occurrence = name, start
        try:
            yield
        finally:
            peak = max(self._occurrence, rss())
            self.peaks[name] = max(self.peaks.get(name, 0), peak)
            self.rises[name] = max(self.rises.get(name, 0), peak - start)  # the largest rise of any occurrence
            self.current = outer

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model path (default: SmolLM2-135M's GGUF file)")
    args, extra = parser.parse_known_args()  # the rest goes to train.py (e.g. --model.activation-checkpointing)
    model = args.model
    if model is None:
        from tests.real_model import smollm2_gguf

        model = str(smollm2_gguf())
    import train
    from rlcore.models.policy import load_model
    from rlcore.step import collect, stages
    from rlcore.step import train_step as step
    from rlcore.trainer import run

    params = sum(p.numel() for p in load_model(model).parameters())
    before = rss()
    with Sampler() as sampler, tempfile.TemporaryDirectory() as out:
        for module in (collect, stages, run, step):  # each imported `phase` by name
            module.phase = sampler.phase
        code = train.main(["grpo", "--model.path", model, "--data.batch-size", "8", "--rollout.n", "8",
                           "--rollout.max-tokens", "48", "--trainer.steps", "2", "--trainer.val-every", "0",
                           "--data.builtin-val-size", "8", "--log.no-progress", "--out-dir", out, *extra])  # fmt: skip
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    assert code == 0, code
    mib = 2**20
    floor = 16 * params
    print(f"## memory_phases, {datetime.date.today()}: {lscpu_model()}; {model} ({params / 1e6:.1f}M parameters), "
          f"GRPO 8 prompts x 8 samples, <= 48 tokens, 2 steps {' '.join(extra)}")  # fmt: skip
    print(f"RSS before the run {before / mib:.0f} MiB; optimizer floor (16 B x parameters) {floor / mib:.0f} MiB")
    print("| phase | peak RSS MiB | largest rise within one occurrence MiB | peak / floor |")
    print("|---|---|---|---|")
    for name in ["outside phases", *sampler.order]:
        peak = sampler.peaks.get(name, 0)
        rise = f"{sampler.rises[name] / mib:.0f}" if name in sampler.rises else "-"
        print(f"| {name} | {peak / mib:.0f} | {rise} | {peak / floor:.2f} |")
    worst = max(r.get("perf/max_memory_mb", 0) for r in records)
    print(f"perf/max_memory_mb of the run: {worst:.0f} ({worst * mib / floor:.2f}x the floor)")
    last = records[-1]  # the second step: no first-call warm-up
    print("second step: " + ", ".join(f"{k} {last[k]:.2f}" for k in sorted(last) if k.startswith("timing/")))


if __name__ == "__main__":
    main()

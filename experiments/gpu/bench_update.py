"""Update-step MFU and tokens/s of a 0.5B-class model on one GPU with FSDP2 (issue 4, GPU section).

    python experiments/gpu/bench_update.py                    # Qwen2-0.5B shapes, bf16 compute, 1 GPU
    python experiments/gpu/bench_update.py --quick            # a 2-layer model, to check the script runs
    python experiments/gpu/bench_update.py --activation-checkpointing --budget 32768

Not run yet (written in a session without a GPU): no figures are recorded for it. It reports and
never asserts. What it does:
- a random-init `Qwen2ForCausalLM` built from a config with Qwen2-0.5B's shapes (hidden 896,
  24 layers, 14 heads / 2 KV heads, MLP 4864, vocab 151,936, tied embeddings), no download;
  fp32 master weights, FSDP2 on a 1-rank mesh (`rlcore.dist.apply_fsdp`) with bf16 parameters
  and fp32 gradient reduction; AdamW (`rlcore.step.update.build_optimizer`);
- a synthetic GRPO batch (prompts 64-256 tokens, responses log-normal, median 512, cap 4096);
- times (CUDA-synchronised medians): the log-prob pass (`compute_logprobs`) and `update_step`
  (token-budget dynamic batching, ppo_clip, token-mean, one optimizer update);
- reports real tokens/s, model FLOPs (forward = 2 x layer params per token + lm_head on response
  tokens + causal attention; backward = 2 x forward) and MFU against both the bf16 dense peak
  (--peak-tflops, default 989 for H100/H200 SXM) and a bf16 matmul measured in the same run;
  peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "experiments"))

from bench_batching import rollout_batch, useful_flops  # noqa: E402

from rlcore.algorithm import Algorithm  # noqa: E402
from rlcore.dist import apply_activation_checkpointing, apply_fsdp  # noqa: E402
from rlcore.dist.mesh import MeshAxis  # noqa: E402
from rlcore.models.forward import compute_logprobs  # noqa: E402
from rlcore.plan import UpdatePlan  # noqa: E402
from rlcore.pure.advantages import ESTIMATORS  # noqa: E402
from rlcore.pure.losses import POLICY_LOSSES  # noqa: E402
from rlcore.state import ModelState  # noqa: E402
from rlcore.step.update import build_optimizer, build_scheduler, update_step  # noqa: E402


def qwen2_05b_config(quick: bool) -> Qwen2Config:
    """Qwen2-0.5B's shapes (the public config), built locally; --quick keeps 2 layers."""
    return Qwen2Config(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=2 if quick else 24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32_768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def cuda_time(fn, repeats: int, warmup: int = 1) -> float:
    """Median seconds of `fn()`, synchronising the GPU around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bf16_matmul_tflops(device: str, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / cuda_time(lambda: a @ b, 10, warmup=3) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 layers, a small batch")
    parser.add_argument("--rows", type=int, default=64, help="rollouts in the batch (8 per prompt)")
    parser.add_argument("--budget", type=int, default=16_384, help="tokens per micro-batch")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak of the GPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=str, default=None, help="also write the figures to this file")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke test only")
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_update needs a CUDA GPU (or --device cpu --quick as a smoke test)")

    if device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0)
        )
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device, (1,), mesh_dim_names=(MeshAxis.DP_SHARD.value,))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(qwen2_05b_config(args.quick))  # fp32 master weights
    if args.activation_checkpointing:
        apply_activation_checkpointing(model)
    apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())

    rows = 16 if args.quick else args.rows
    median, cap = (128, 1024) if args.quick else (512, 4096)
    if device == "cpu":  # smoke test sizes
        rows, median, cap = 8, 16, 64
    batch = rollout_batch(rows, prompt=(64, 256), median=median, max_tokens=cap, vocab=151_936).to(device)
    n = 8
    batch = batch.with_(uid=[f"p{i // n}" for i in range(rows)])
    real = int(batch["attention_mask"].sum() + batch["response_attention"].sum())
    fwd_flops = useful_flops(model, batch)

    lp_time = cuda_time(lambda: compute_logprobs(model, batch, max_tokens=args.budget), args.repeats)
    old, _ = compute_logprobs(model, batch, max_tokens=args.budget)
    gen = torch.Generator(device=device).manual_seed(0)
    adv = torch.randn(rows, 1, device=device, generator=gen) * batch["response_mask"]
    batch = batch.with_(old_logprobs=old, advantages=adv)

    algorithm = Algorithm(advantage_fn=ESTIMATORS["grpo"], policy_loss_fn=POLICY_LOSSES["ppo_clip"])
    plan = UpdatePlan(micro_batch_size=rows, max_tokens_per_micro_batch=args.budget)
    opt = build_optimizer(model, lr=1e-6)
    state = ModelState(model=model, optimizer=opt, scheduler=build_scheduler(opt, total_updates=100))
    holder = {"state": state}

    def one_update() -> None:
        holder["state"], holder["metrics"] = update_step(holder["state"], batch, algorithm, plan, horizon=cap)

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    up_time = cuda_time(one_update, args.repeats)
    peak_mem = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    measured = bf16_matmul_tflops(device, 8192 if device == "cuda" else 512)

    def mfu(flops: float, seconds: float, peak: float) -> float:
        return flops / seconds / (peak * 1e12)

    record = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "params_m": n_params / 1e6,
        "rows": rows,
        "real_tokens": real,
        "budget": args.budget,
        "activation_checkpointing": args.activation_checkpointing,
        "bf16_matmul_tflops_measured": measured,
        "logprob_pass_s": lp_time,
        "logprob_tokens_per_s": real / lp_time,
        "logprob_mfu_spec": mfu(fwd_flops, lp_time, args.peak_tflops),
        "update_s": up_time,
        "update_tokens_per_s": real / up_time,
        "update_mfu_spec": mfu(3 * fwd_flops, up_time, args.peak_tflops),
        "update_mfu_measured_peak": mfu(3 * fwd_flops, up_time, measured),
        "peak_memory_gib": peak_mem / 2**30,
        "metrics": holder["metrics"],
    }
    print(json.dumps(record, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

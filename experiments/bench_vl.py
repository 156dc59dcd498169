"""Vision-language RL: what images cost in rollout and update, the vision tower's share, what freezing saves.

    .venv/bin/python experiments/bench_vl.py            # the run in experiments/README.md: ~3 minutes
    .venv/bin/python experiments/bench_vl.py --quick    # tiny-vl only, 1 pair: checks it runs

Issue 37. Two Qwen2-VL models (`Qwen2VLForConditionalGeneration`, fp32, the native engine, 2 threads):
- `tiny-vl`: the built-in one (rlcore/models/weights/tiny-vl/), `builtin:shapes` prompts (48x48 images:
  9 image tokens each);
- `vl-40m`: a random-init Qwen2-VL of ~38M parameters (language model: hidden 512, 8 layers, 8 heads / 4
  kv heads of 64, MLP 1536; vision tower: 8 blocks of width 384, 14-pixel patches merged 2x2) on the
  same prompts with 224x224 images (256 patches, 64 image tokens each), and the built-in character
  vocabulary (106 ids), so the head costs little and the body dominates.

For each model, side by side (one warm-up each, then `--pairs` pairs, the order flipped every pair):
- rollout: `NativeEngine.generate` of 16 prompts x 4 samples, at most `--tokens` tokens (a random model
  rarely stops; the trained one answers in 2 tokens, so tok/s counts the tokens generated), with the
  images, against the same prompts with each image left out (the text alone);
- update: one forward + backward of the trainer over that rollout (`model_inputs` + `response_logprobs`),
  with the images, without them, and with the vision tower frozen (`requires_grad_(False)`: its
  backward and its weight gradients skipped); the tower encodes each prompt's images once for its 4
  samples (`rlcore.models.vision.feeding`);
- the vision tower alone: its forward (+ backward) over the batch's distinct images, as a share of the
  update.

Reported: median wall seconds and the ratios as the median of the pairs' ratios (with their range);
floors = FLOPs / the fp32 matmul peak measured at the start (benchlib.matmul_gflops), FLOPs = 2 x
parameters x tokens (x3 with the backward; the vision tower's tokens are the distinct images' patches), attention scores
left out. Reports, never asserts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.benchlib import matmul_gflops
from rlcore.batch import Batch
from rlcore.data.prompts import make_prompt_batch
from rlcore.data.rows import row_from_dict
from rlcore.data.shapes import generate_rows
from rlcore.models.forward import model_inputs, response_logprobs, vision_inputs
from rlcore.models.policy import _builtin_vision, _vision_config, builtin_spec, load_policy, load_vision
from rlcore.models.vision import vision_tower
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.native.engine import NativeEngine


def vl_40m(tokenizer):
    """(model, vision processor) of the ~38M random Qwen2-VL described in the module docstring."""
    from transformers import AutoModelForImageTextToText

    spec = builtin_spec("tiny-vl")
    text = {"vocab_size": len(tokenizer), "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
            "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 2048,
            "tie_word_embeddings": True, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    big = type(spec)(**{**spec.__dict__, "hidden_size": 512, "num_heads": 8, "vision_depth": 8,
                        "vision_width": 384, "patch_size": 14, "image_size": 224})  # fmt: skip
    config = _vision_config(big, tokenizer, text)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    return model, _builtin_vision(big, config, tokenizer)


def prompts(tokenizer, vision, *, images: bool, n: int = 16) -> Batch:
    rows = generate_rows("val", n, seed=0)
    if not images:
        rows = [{**r, "images": [], "prompt": [{"role": "user", "content": r["prompt"][0]["content"].replace(
            "<image>", "")}]} for r in rows]  # fmt: skip
    return make_prompt_batch([row_from_dict(r, f"r{i}") for i, r in enumerate(rows)], tokenizer,
                             vision=vision, uids=[str(i) for i in range(n)])  # fmt: skip


def update_s(model, batch: Batch) -> float:
    start = time.perf_counter()
    logprob, _ = response_logprobs(model, model_inputs(model, batch))
    (logprob * batch["response_mask"][:, : logprob.shape[1]]).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def tower_s(model, batch: Batch) -> float:
    images = vision_inputs(batch)
    start = time.perf_counter()
    out = model.model.get_image_features(images.pixel_values, images.image_grid_thw)
    torch.cat(list(out.pooler_output)).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def measure(name: str, model, tokenizer, vision, args, peak: float) -> None:
    engine = NativeEngine(model, tokenizer)
    sampling = SamplingParams(n=4, max_tokens=args.tokens, temperature=1.0, seed=0)
    with_images, text_only = prompts(tokenizer, vision, images=True), prompts(tokenizer, vision, images=False)
    gen = {k: engine.generate(p, sampling) for k, p in (("images", with_images), ("text", text_only))}
    times: dict[str, list[float]] = {k: [] for k in ("roll_images", "roll_text", "upd_images", "upd_text",
                                                    "upd_frozen", "tower")}  # fmt: skip
    tower = vision_tower(model)
    model.train()
    for pair in range(args.pairs + 1):  # the first is a warm-up
        order = ("images", "text") if pair % 2 else ("text", "images")
        for kind in order:
            start = time.perf_counter()
            engine.generate(with_images if kind == "images" else text_only, sampling)
            times[f"roll_{kind}"].append(time.perf_counter() - start)
            times[f"upd_{kind}"].append(update_s(model, gen[kind]))
        tower.requires_grad_(False)
        times["upd_frozen"].append(update_s(model, gen["images"]))
        tower.requires_grad_(True)
        times["tower"].append(tower_s(model, gen["images"]))
        model.train()
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    ratio = lambda a, b: [x / y for x, y in zip(times[a][1:], times[b][1:], strict=True)]  # noqa: E731
    toks = {k: float(gen[k]["response_mask"].sum()) for k in gen}
    lm, vt = params(model) - params(tower), params(tower)
    patches = float(vision_inputs(gen["images"]).pixel_values.shape[0])  # each prompt's images once
    seq = {k: float(gen[k]["attention_mask"].sum() + gen[k]["response_mask"].sum()) for k in gen}
    flops_update = 6 * lm * seq["images"] + 6 * vt * patches
    flops_roll = 2 * lm * (seq["images"] / 4 + toks["images"]) + 2 * vt * patches  # prompts once each
    print(f"\n{name}: language model {lm / 1e6:.1f}M, vision tower {vt / 1e6:.1f}M params; "
          f"{patches / len(with_images):.0f} patches per prompt; responses {toks['images']:.0f} tokens")  # fmt: skip
    for kind, a, b in (("rollout", "roll_images", "roll_text"), ("update", "upd_images", "upd_text")):
        r = ratio(a, b)
        tps = f" ({toks['images'] / med[a]:.0f} vs {toks['text'] / med[b]:.0f} tok/s)" if kind == "rollout" else ""
        print(f"  {kind}: images {med[a]:.3f} s, text {med[b]:.3f} s: {statistics.median(r):.2f}x "
              f"[{min(r):.2f}-{max(r):.2f}]{tps}")  # fmt: skip
    r = ratio("upd_frozen", "upd_images")
    print(f"  update with the tower frozen: {med['upd_frozen']:.3f} s, {statistics.median(r):.2f}x of trained "
          f"[{min(r):.2f}-{max(r):.2f}]; the tower's forward+backward alone {med['tower']:.3f} s, "
          f"{med['tower'] / med['upd_images']:.0%} of the update")  # fmt: skip
    for kind, flops, sec in (("update", flops_update, med["upd_images"]), ("rollout", flops_roll, med["roll_images"])):
        floor = flops / (peak * 1e9)
        print(f"  {kind} floor {floor * 1e3:.1f} ms ({flops / 1e9:.2f} GFLOP at {peak:.0f} GFLOP/s): "
              f"{floor / sec:.0%} of it reached")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.quick:
        args.pairs = 1
    torch.set_num_threads(args.threads)
    peak = matmul_gflops()
    print(f"fp32 matmul peak {peak:.0f} GFLOP/s, {args.threads} threads, {time.strftime('%Y-%m-%d')}")
    model, tokenizer = load_policy("builtin:tiny-vl")
    measure("tiny-vl", model, tokenizer, load_vision("builtin:tiny-vl"), args, peak)
    if not args.quick:
        big, big_vision = vl_40m(tokenizer)
        measure("vl-40m", big, tokenizer, big_vision, args, peak)


if __name__ == "__main__":
    main()

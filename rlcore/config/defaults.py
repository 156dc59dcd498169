"""Defaults that depend on the kind of model a run trains, resolved once at start-up.

    values = defaulted(cfg)      # {"optim.lr": 1e-06, "rollout.max_tokens": 512, ...}: what cfg leaves None
    cfg = resolve(cfg)           # a new, concrete Config (the user's is never changed)
    lines = default_lines(values, kind=model_kind(cfg.model.path), lora=cfg.model.lora_rank > 0)

A built-in model (`--model.path builtin:<name>`) keeps the values its tasks were tuned with; anything
else (a directory, a hub id, a GGUF file) is a pretrained model and gets values that fit one. A value the
user gave always wins: only the fields the config leaves None are filled (`--optim.lr`, `--critic.lr`,
`--rollout.max-tokens`, `--reward.overlong-buffer-length`, which the dapo preset leaves None, and
`--algo.max-tokens-per-micro-batch`). `--data.val-files` left None follows the training data whatever the
model: generated tasks validate on their own val split, the user's files turn validation off
(`validation_files`).

Why the pretrained values (their sources):
- learning rate 1e-6 for full fine-tuning: verl's `actor_rollout_ref.actor.optim.lr` and TRL's
  `GRPOConfig.learning_rate` both default to it. rlcore's SmolLM2-135M study (experiments/README.md,
  "A real pretrained model: SmolLM2-135M-Instruct") trained at 1e-5 for 8-step probes on a 135M model;
  1e-6 is the value that does not diverge on the 0.5B-7B models the README's examples train, and a short
  study raises it with --optim.lr.
- LoRA 1e-5, ten times full fine-tuning's: the ratio of "LoRA Without Regret" (Schulman et al. 2025)
  and of the SmolLM2 study (1e-5 full, 1e-4 LoRA); the built-in models' own ratio is 5x (1e-3, 5e-3).
- critic 1e-5: verl's `critic.optim.lr` (a value head learns from scratch, so faster than the actor).
- 512 response tokens: verl's `data.max_response_length` (TRL's `max_completion_length` is 256); a
  GSM8K chain of thought fits, where the built-in models' 12 tokens cannot hold one.
- DAPO's overlong buffer as a share of the response length, 20%: the DAPO paper (Yu et al. 2025) and
  verl's recipe penalise the last 4096 of 20480 tokens. The built-in models keep 4 tokens (of 12).
- micro-batches by a budget in bytes (`MICRO_BATCH_MIB` on a CPU, `GPU_BUDGET_SHARE` of free memory on a
  GPU; experiments/README.md "Memory at real sizes"): a pretrained model's update in one micro-batch of
  rows holds every token's activations at once (measured 1.7 MB per fed token on SmolLM2-135M, 5.2 GiB
  for GRPO 8 x 8, the update at 4.3x the optimizer floor); the tokens are read from the model's config.
  A --algo.micro-batch-size the user gives keeps micro-batches of rows.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from configs import AlgoConfig, Config, ConfigError
from rlcore.data.sources import is_generated
from rlcore.dist.mesh import device_type
from rlcore.models.policy import BUILTIN_PREFIX

Kind = Literal["builtin", "pretrained"]


@dataclass(frozen=True, kw_only=True)
class KindDefaults:
    """One model kind's defaults."""

    lr: float
    """--optim.lr, full fine-tuning."""
    lora_lr: float
    """--optim.lr with --model.lora-rank > 0."""
    critic_lr: float
    """--critic.lr."""
    max_tokens: int
    """--rollout.max-tokens."""
    overlong_buffer_tokens: int
    """--reward.overlong-buffer-length where a preset leaves it None: this many tokens ..."""
    overlong_buffer_share: float
    """... plus this share of --rollout.max-tokens (rounded)."""
    micro_batch_mib: int | None
    """--algo.max-tokens-per-micro-batch: the tokens whose saved activations and logits take this many MiB
    (`rlcore.models.footprint`); None: micro-batches of --algo.micro-batch-size rows."""


MICRO_BATCH_MIB = 2048
"""A pretrained model's micro-batch budget on a CPU (experiments/README.md "Memory at real sizes").
SmolLM2-135M, GRPO 8 x 8, 48 tokens: one micro-batch of rows peaks at 4.29x the optimizer floor, 49.1 s a
step; this budget (1,058 tokens) at 2.06x, 45.2 s; 256 tokens at 1.65x, 54.6 s (the prompts of a group
are no longer shared and the products shrink). Qwen2.5-0.5B's shape gets 511 tokens: 1.22x its floor."""

DEFAULTS: dict[Kind, KindDefaults] = {
    "builtin": KindDefaults(
        lr=1e-3,  # the default run's (README: reverse from greedy val 0.233 to 0.993 in 30 steps)
        lora_lr=5e-3,  # rank 16, alpha 32, default task: val 0.998 (experiments/README.md, "bench_lora")
        critic_lr=1e-3,  # the actor's
        max_tokens=12,  # the built-in tasks' answers are a few tokens (the default run's responses: 5-7)
        overlong_buffer_tokens=4,  # the dapo preset's 4 of 12 tokens
        overlong_buffer_share=0.0,
        micro_batch_mib=None,  # rows, as the built-in tasks were tuned (their activations are a few MiB)
    ),
    "pretrained": KindDefaults(
        lr=1e-6,  # verl actor_rollout_ref.actor.optim.lr and TRL GRPOConfig.learning_rate
        lora_lr=1e-5,  # 10x full fine-tuning (LoRA Without Regret; rlcore's SmolLM2 study: 1e-5 / 1e-4)
        critic_lr=1e-5,  # verl critic.optim.lr
        max_tokens=512,  # verl data.max_response_length (TRL max_completion_length: 256)
        overlong_buffer_tokens=0,
        overlong_buffer_share=0.2,  # DAPO (Yu et al. 2025): a 4096-token buffer of 20480 tokens
        micro_batch_mib=MICRO_BATCH_MIB,
    ),
}
"""The defaults of each model kind, each value with its source."""

FLAGS = {
    "optim.lr": "--optim.lr",
    "critic.lr": "--critic.lr",
    "rollout.max_tokens": "--rollout.max-tokens",
    "reward.overlong_buffer_length": "--reward.overlong-buffer-length",
    "algo.max_tokens_per_micro_batch": "--algo.max-tokens-per-micro-batch",
    "data.val_files": "--data.val-files",
}
"""The fields resolved at start-up (section.field, as config.json names them) and their flags."""

KIND_NAMES: dict[Kind, str] = {"builtin": "a built-in model", "pretrained": "a pretrained model"}


def model_kind(path: str) -> Kind:
    """builtin for --model.path builtin:<name>; pretrained for a directory, a hub id or a GGUF file."""
    return "builtin" if path.startswith(BUILTIN_PREFIX) else "pretrained"


def overlong_buffer(d: KindDefaults, max_tokens: int) -> int:
    """The soft overlong penalty's buffer for responses of at most `max_tokens` (at least 1 token)."""
    return max(1, d.overlong_buffer_tokens + round(d.overlong_buffer_share * max_tokens))


def defaulted(cfg: Config, free_memory: FreeMemory | None = None) -> dict[str, Any]:
    """The values the model's kind gives the fields `cfg` leaves None, by section.field (FLAGS' keys);
    `free_memory` answers a GPU's free bytes (`gpu_free_bytes` by default)."""
    d = DEFAULTS[model_kind(cfg.model.path)]
    values: dict[str, Any] = {}
    if cfg.optim.lr is None:
        values["optim.lr"] = d.lora_lr if cfg.model.lora_rank > 0 else d.lr
    if cfg.critic.lr is None:
        values["critic.lr"] = d.critic_lr
    max_tokens = cfg.rollout.max_tokens
    if max_tokens is None:
        max_tokens = values["rollout.max_tokens"] = d.max_tokens
    if cfg.reward.overlong_buffer_length is None:
        values["reward.overlong_buffer_length"] = overlong_buffer(d, max_tokens)
    rows_given = cfg.algo.micro_batch_size != AlgoConfig.micro_batch_size  # the user chose rows: they win
    if cfg.algo.max_tokens_per_micro_batch is None and d.micro_batch_mib is not None and not rows_given:
        tokens = micro_batch_tokens(cfg, micro_budget(cfg, free_memory).bytes)
        if tokens is not None:
            values["algo.max_tokens_per_micro_batch"] = tokens
    if cfg.data.val_files is None:
        values["data.val_files"] = validation_files(cfg.data.train_files)
    return values


def validation_files(train_files: tuple[str, ...]) -> tuple[str, ...]:
    """What an unset --data.val-files follows: generated tasks validate on their own val split; files of the
    user's turn validation off (which of their rows are held out is theirs to say)."""
    return train_files if all(is_generated(s) for s in train_files) else ()


FreeMemory = Callable[[], int]
"""The free bytes of the GPU a rank trains on."""

GPU_BUDGET_SHARE = 0.25
"""On a GPU a pretrained model's micro-batch budget is this share of the device's free memory at start (whole
GiB, at least 1): the rest holds the weights, the optimizer, the engine's KV cache and the allocator's slack.
On a CPU the budget is MICRO_BATCH_MIB whatever the machine's memory (the measured trade-off above)."""


@dataclass(frozen=True)
class MicroBudget:
    """A pretrained model's micro-batch budget: bytes of saved activations and logits, and how it was set."""

    bytes: int
    words: str


@functools.cache
def gpu_free_bytes() -> int:
    """This rank's GPU's free bytes, asked once per process (LOCAL_RANK's device, as torchrun numbers them)."""
    import torch

    return int(torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))[0])


def micro_budget(cfg: Config, free_memory: FreeMemory | None = None) -> MicroBudget:
    """The micro-batch budget of a pretrained model's run: MICRO_BATCH_MIB on a CPU, GPU_BUDGET_SHARE of the
    GPU's free memory on a GPU."""
    mib = DEFAULTS[model_kind(cfg.model.path)].micro_batch_mib or MICRO_BATCH_MIB
    at = f"at {compute_bytes(cfg)} bytes a value ({'bf16' if compute_bytes(cfg) == 2 else 'fp32'})"
    if device_type(cfg.trainer.device) != "cuda":
        return MicroBudget(mib * 2**20, f"{mib} MiB {at}")
    free = (free_memory or gpu_free_bytes)()
    gib = max(1, int(GPU_BUDGET_SHARE * free) // 2**30)
    share = f"{GPU_BUDGET_SHARE:.0%} of the GPU's {free / 2**30:.1f} GiB free"
    return MicroBudget(gib * 2**30, f"{gib} GiB ({share}) {at}")


def compute_dtype(cfg: Config) -> str:
    """bfloat16 where the model's weights or its compute are bf16, else float32."""
    return "bfloat16" if "bfloat16" in (cfg.model.dtype, cfg.model.compute_dtype) else "float32"


def compute_bytes(cfg: Config) -> int:
    """Bytes of one saved activation or logit: 2 where the model computes in bf16, else 4."""
    return 2 if compute_dtype(cfg) == "bfloat16" else 4


def micro_batch_tokens(cfg: Config, budget: int) -> int | None:
    """The tokens a micro-batch of the run's model may hold for its saved activations and logits to take
    `budget` bytes (`rlcore.models.footprint`); None when the model's config cannot be read (loading it
    reports why)."""
    from rlcore.config.model_checks import model_shape
    from rlcore.models.footprint import micro_tokens_within

    try:
        shape = model_shape(cfg.model.path)
    except (ConfigError, OSError):
        return None
    if shape is None:
        return None
    return micro_tokens_within(shape, budget=budget, compute_bytes=compute_bytes(cfg),
                               checkpointing=cfg.model.activation_checkpointing,
                               selective=cfg.model.selective_checkpointing)  # fmt: skip


def resolve(cfg: Config, values: dict[str, Any] | None = None) -> Config:
    """`cfg` with every field it leaves None filled by the model's kind (`values`, by default `defaulted(cfg)`):
    a new Config."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in (defaulted(cfg) if values is None else values).items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    parts = {s: dataclasses.replace(getattr(cfg, s), **fields) for s, fields in sections.items()}
    return dataclasses.replace(cfg, **parts)


def default_lines(
    values: dict[str, Any], *, kind: Kind, lora: bool = False, budget: MicroBudget | None = None
) -> list[str]:
    """One line per defaulted value, as a run prints them first:
    `optim.lr 1e-06 (default for a pretrained model; --optim.lr to change)`; `budget`: how the micro-batch
    budget was set (by default the CPU's)."""
    lines = []
    for key, value in values.items():
        if key == "data.val_files":
            lines.append(validation_line(value))
            continue
        flag, what = FLAGS[key], KIND_NAMES[kind]
        if key == "optim.lr" and lora:
            what += " with LoRA"
        share = DEFAULTS[kind].overlong_buffer_share
        if key == "reward.overlong_buffer_length" and share:
            what += f": {share:.0%} of --rollout.max-tokens"
        if key == "algo.max_tokens_per_micro_batch":
            words = budget.words if budget else f"{DEFAULTS[kind].micro_batch_mib} MiB"
            what += f": saved activations and logits within {words}"
        lines.append(f"{flag.removeprefix('--')} {value:g} (default for {what}; {flag} to change)")
    return lines


def validation_line(files: tuple[str, ...]) -> str:
    """The start line of an unset --data.val-files: the tasks it validates on, or that validation is off."""
    if not files:
        return ("validation off: --data.train-files are files of yours and no --data.val-files was given; "
                "--data.val-files FILE (held-out rows) turns it on")
    held_out = "(default: the training tasks' held-out rows; --data.val-files to change)"
    return f"data.val-files {' '.join(files)} {held_out}"

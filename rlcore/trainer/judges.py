"""The run's generative judge (--reward.judge*): checked before any weights load, built on the ranks that
score (rlcore.rewards.judge holds what it does)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from configs import Config, ConfigError
from rlcore.config.algo_checks import need
from rlcore.models.specs import EngineSpec, ModelSpec, SpecError
from rlcore.rewards.judge import DEFAULT_TEMPLATE, PARSERS, Judge, Parser, check_template
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.build import build_judge_engine
from rlcore.rollout.engines import engine_kind


@dataclasses.dataclass(frozen=True)
class JudgeParts:
    """What a judge needs besides its model and engine, read from the config and its files."""

    template: str
    parse: Parser
    tokenizer: Any
    sources: frozenset[str]


def judge_parts(cfg: Config) -> JudgeParts | None:
    """The judge's template, parser and tokenizer (None without --reward.judge); every problem is one
    line naming its flag."""
    r = cfg.reward
    if r.judge is None:
        return None
    need(r.judge_max_tokens >= 1, f"--reward.judge-max-tokens {r.judge_max_tokens}: must be >= 1")
    need(r.judge_temperature >= 0, f"--reward.judge-temperature {r.judge_temperature}: must be >= 0")
    from rlcore.models.policy import BUILTIN_PREFIX, load_tokenizer

    need(not engine_kind(r.judge_engine).own_weights or not r.judge.startswith(BUILTIN_PREFIX),
         f"--reward.judge-engine {r.judge_engine}: {r.judge} is a built-in model, which vLLM cannot read; use "
         "--reward.judge-engine native")  # fmt: skip
    try:
        tokenizer = load_tokenizer(r.judge)
    except ValueError as e:
        raise ConfigError(f"--reward.judge: {e}") from None
    need(bool(getattr(tokenizer, "chat_template", None)),
         f"--reward.judge {r.judge}: its tokenizer has no chat template; a judge reads its prompt as a chat turn")  # fmt: skip
    return JudgeParts(template=_template(r.judge_template), parse=_parser(r.judge_parser), tokenizer=tokenizer,
                      sources=frozenset(r.judge_sources))  # fmt: skip


def _template(path: str | None) -> str:
    if path is None:
        return DEFAULT_TEMPLATE
    where = f"--reward.judge-template {path}"
    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"{where}: cannot read it ({type(e).__name__}: {e}); give a UTF-8 text file"
        ) from None
    try:
        return check_template(text, where)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _parser(spec: str) -> Parser:
    """A parser of the table, or a `file.py:function` hook (imported here, once)."""
    if spec in PARSERS:
        return PARSERS[spec]
    if ":" not in spec:
        raise ConfigError(
            f"--reward.judge-parser {spec!r}: choose one of {sorted(PARSERS)} or give path/to/file.py:function"
        )
    from rlcore.rewards.custom import import_file, split_spec

    flag = "--reward.judge-parser"
    try:
        path, name = split_spec(spec)
        if not path.is_file():
            raise ConfigError(f"{flag} {spec!r}: file {path} not found")
        fn = getattr(import_file(flag, spec, path, ConfigError), name, None)
    except ValueError as e:
        raise ConfigError(str(e).replace("--reward.custom", flag)) from None
    need(callable(fn), f"{flag} {spec!r}: {path.name} defines no function {name!r}")
    return fn


def build_judge(cfg: Config, parts: JudgeParts, dist: Any) -> Judge:
    """The judge with its own engine on this rank's device: native over its model, or vLLM
    (`rlcore.rollout.build.build_judge_engine`)."""
    r = cfg.reward
    sampling = SamplingParams(n=1, max_tokens=r.judge_max_tokens, temperature=r.judge_temperature)
    model = ModelSpec(path=r.judge, dtype=cfg.model.dtype, seed=cfg.trainer.seed)
    spec = EngineSpec(kind=r.judge_engine, seed=cfg.trainer.seed,
                      gpu_memory_utilization=cfg.rollout.gpu_memory_utilization)  # fmt: skip
    try:
        engine = build_judge_engine(model, spec, parts.tokenizer, dist)
    except SpecError as e:
        raise ConfigError(_line(cfg, e)) from None
    return Judge(engine=engine, tokenizer=parts.tokenizer, template=parts.template, parse=parts.parse,
                 sampling=sampling, failure_score=r.failure_score, seed=cfg.trainer.seed,
                 sources=parts.sources)  # fmt: skip


def _line(cfg: Config, e: SpecError) -> str:
    """The one line of the judge's spec error, named by its flags."""
    r = cfg.reward
    return {
        "path": f"--reward.judge: {e}",
        "kind": f"--reward.judge-engine {r.judge_engine}: {e}",
        "engine": f"--reward.judge-engine {r.judge_engine} with --reward.judge {r.judge}: {e}",
    }[e.field]

"""Generative judges (LLM-as-judge): a language model reads each prompt and response, writes a verdict,
and a parser turns the verdict into a score.

    judge = Judge(engine, tokenizer, template=DEFAULT_TEMPLATE, parse=PARSERS["score"])
    verdicts = judge.judge(prompts, responses, ground_truths)     # one batched generate call
    verdicts.scores, verdicts.texts, verdicts.failures

The template is text with the fields `{prompt}` and `{response}`, and optionally `{ground_truth}`
(`str.format` fields: a literal brace is written twice). Each filled template is one user turn in the
judge's own chat template; the judge answers with its own engine (`rlcore.rollout`: native or vLLM),
greedy by default, else seeded by the run's seed and the requests themselves, so the same requests get
the same verdicts in any run, resumed or not. A verdict the parser cannot read (or a parser that raises,
or a non-finite number) scores `failure_score` and is counted.

Parsers (`PARSERS`, one table; a `path/to/file.py:function` hook takes the verdict text and returns a
float, or None when it cannot read it):
- `score`: the last `score: N` (or `score = N`), any case; N a number.
- `boxed`: the last `\\boxed{N}`.
- `yes_no`: the first word `yes` (1.0) or `no` (0.0), any case.

`rlcore.rewards.step.score_step` calls the judge for the rows whose data_source it covers (all, or
`sources`), the rule rewards for the others. This is verl's generative reward model (GenRM) in its
reward loop, TRL's judges and verifiers' `JudgeRubric` in rlcore's form.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import string
import time
from collections.abc import Callable, Sequence
from typing import Any

from rlcore.data.prompts import make_prompt_batch
from rlcore.data.rows import Row
from rlcore.rollout.base import RolloutEngine, SamplingParams

TEMPLATE_FIELDS = ("prompt", "response", "ground_truth")
"""The fields a judge template may use (`prompt` and `response` it must)."""

DEFAULT_TEMPLATE = """You are grading a response to a task.

Task:
{prompt}

Reference answer:
{ground_truth}

Response:
{response}

Does the response reach the reference answer? Reply with one line: "score: 1" if it does, "score: 0" if it does not."""
"""The judge's prompt without --reward.judge-template: a reference-answer check read by the `score` parser."""

Parser = Callable[[str], float | None]

_NUMBER = r"([-+]?\d+(?:\.\d+)?)"
_SCORE = re.compile(r"score\s*[:=]\s*" + _NUMBER, re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{\s*" + _NUMBER + r"\s*\}")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def parse_score(text: str) -> float | None:
    """The last `score: N` of `text` (None: there is none)."""
    found = _SCORE.findall(text)
    return float(found[-1]) if found else None


def parse_boxed(text: str) -> float | None:
    """The last `\\boxed{N}` of `text` (None: there is none)."""
    found = _BOXED.findall(text)
    return float(found[-1]) if found else None


def parse_yes_no(text: str) -> float | None:
    """1.0 if the first `yes` / `no` word of `text` is yes, 0.0 if it is no (None: neither is there)."""
    found = _YES_NO.search(text)
    return None if found is None else float(found.group(1).lower() == "yes")


PARSERS: dict[str, Parser] = {"score": parse_score, "boxed": parse_boxed, "yes_no": parse_yes_no}
"""Verdict parsers by name (--reward.judge-parser); a script may add its own."""


def check_template(text: str, where: str) -> str:
    """`text` if it is a usable template; else a one-line ValueError naming `where` and the fix."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as e:
        raise ValueError(f"{where}: not a template ({e}); write a literal brace as {{{{ or }}}}") from None
    unknown = sorted(fields - set(TEMPLATE_FIELDS))
    if unknown:
        raise ValueError(
            f"{where}: unknown field {{{unknown[0]}}}; a judge template uses {{prompt}}, {{response}} and "
            "{ground_truth} (a literal brace is written twice)"
        )
    missing = [f for f in ("prompt", "response") if f not in fields]
    if missing:
        raise ValueError(f"{where}: no {{{missing[0]}}} field; a judge template shows the judge the "
                         "{prompt} and the {response} (and optionally the {ground_truth})")  # fmt: skip
    return text


def prompt_text(prompt: str | Sequence[dict[str, Any]]) -> str:
    """A row's prompt as the judge reads it: a string as is, chat messages' contents joined by blank lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(str(m.get("content", "")) for m in prompt)


@dataclasses.dataclass(frozen=True)
class Verdicts:
    """What a judge said of a batch of responses."""

    scores: list[float]
    """Each response's score (`failure_score` where the verdict could not be read)."""
    texts: list[str]
    """The judge's verdicts as it wrote them."""
    failures: int
    """Verdicts that could not be read."""
    seconds: float
    """Wall time of the judging."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Judge:
    """A generative judge: an engine on its own model, a template, a parser (see the module docstring)."""

    engine: RolloutEngine
    tokenizer: Any
    """The judge model's tokenizer and chat template."""
    template: str = DEFAULT_TEMPLATE
    parse: Parser = parse_score
    sampling: SamplingParams = dataclasses.field(
        default_factory=lambda: SamplingParams(max_tokens=32, temperature=0.0)
    )
    """How the judge writes (n is 1; greedy by default)."""
    failure_score: float = 0.0
    """The score of a verdict that cannot be read."""
    seed: int = 0
    """With temperature > 0, the run's seed: each call's seed derives from it and the requests."""
    sources: frozenset[str] = frozenset()
    """The data sources the judge scores (empty: every one)."""

    def covers(self, data_source: str) -> bool:
        return not self.sources or data_source in self.sources

    def judge(
        self, prompts: Sequence[Any], responses: Sequence[str], ground_truths: Sequence[Any]
    ) -> Verdicts:
        """Score each (prompt, response, ground truth) with one batched generate call."""
        started = time.perf_counter()
        requests = [
            self.template.format(prompt=prompt_text(p), response=r, ground_truth="" if g is None else g)
            for p, r, g in zip(prompts, responses, ground_truths, strict=True)
        ]
        rows = [Row(data_source="judge", prompt=[{"role": "user", "content": text}]) for text in requests]
        batch = make_prompt_batch(rows, self.tokenizer, uids=[str(i) for i in range(len(rows))])
        sampling = dataclasses.replace(self.sampling, n=1, seed=_seed(self.seed, requests))
        out = self.engine.generate(batch, sampling)
        mask = out["response_mask"].bool().cpu()
        ids = [row[m].tolist() for row, m in zip(out["responses"].cpu(), mask, strict=True)]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        parsed = [self._read(text) for text in texts]
        scores = [self.failure_score if s is None else s for s in parsed]
        failures = sum(s is None for s in parsed)
        return Verdicts(scores=scores, texts=texts, failures=failures, seconds=time.perf_counter() - started)

    def _read(self, text: str) -> float | None:
        """The parser's number for `text`; None if it cannot read it, raises, or gives no finite number."""
        try:
            value = self.parse(text)
        except Exception:  # a user's hook: its failure is an unreadable verdict, counted
            return None
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            return None
        return float(value) if math.isfinite(value) else None


def _seed(seed: int, requests: Sequence[str]) -> int:
    """A call's sampling seed from the run's seed and its requests (the same requests: the same seed)."""
    digest = hashlib.sha256(str(seed).encode())
    for text in requests:
        digest.update(b"\0" + text.encode())
    return int.from_bytes(digest.digest()[:4], "little")

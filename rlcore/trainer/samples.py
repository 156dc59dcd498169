"""What the model wrote: each step's first K samples as decoded text, in samples.jsonl.

    writer = SampleWriter(out_dir, tokenizer, k=4)          # --log.samples 4 (0: off)
    writer.write(step, batch)                               # train: samples.jsonl
    writer.write(step, batch, validation=True)              # val_samples.jsonl (greedy)

One JSON object per sample: `step`, `prompt` and `response` (decoded with special tokens kept: the
text the model read and wrote, chat template and stop token included), `score` (the sequence reward), `advantage` (mean over the response's policy tokens; absent for a
validation sample), `data_source`, `finish_reason`, `ground_truth`. A multi-turn response (tool or
environment observations inside it: attended tokens outside `response_mask`) also gets `turns`, its
text split into `{"role": "model" | "observation", "text"}` runs, so what the environment said is not
mistaken for what the policy wrote. Rank 0 writes (the first K rows of its part of the batch); with
W&B on, the same rows go to a `wandb.Table` (`samples`, `val_samples`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import torch

from rlcore.batch import Batch

COLUMNS = ("step", "data_source", "prompt", "response", "score", "advantage", "finish_reason", "ground_truth")
"""The `wandb.Table` columns (`turns` stays in the jsonl file)."""


class SampleWriter:
    """Appends decoded samples to `out_dir/samples.jsonl` / `val_samples.jsonl` (nothing when k is 0)."""

    def __init__(self, out_dir: Path, tokenizer: Any, *, k: int, wandb_run: Any = None) -> None:
        self.out_dir, self.tokenizer, self.k, self.wandb_run = out_dir, tokenizer, k, wandb_run

    def write(self, step: int, batch: Batch, *, validation: bool = False) -> None:
        if self.k <= 0 or len(batch) == 0:
            return
        records = sample_records(batch[: self.k], self.tokenizer, step=step)
        name = "val_samples" if validation else "samples"
        with (self.out_dir / f"{name}.jsonl").open("ab") as f:
            f.write(b"".join(_json(r) + b"\n" for r in records))
        if self.wandb_run is not None:
            import wandb

            rows = [[_cell(r.get(c)) for c in COLUMNS] for r in records]
            self.wandb_run.log({name: wandb.Table(columns=list(COLUMNS), data=rows)}, step=step)


def sample_records(batch: Batch, tokenizer: Any, *, step: int) -> list[dict[str, Any]]:
    """One record per row of a rolled-out, scored batch (see the module docstring for the fields)."""
    prompt_ids, prompt_mask = batch["input_ids"].cpu(), batch["attention_mask"].cpu()
    responses, policy = batch["responses"].cpu(), batch["response_mask"].cpu() != 0
    attended = batch["response_attention"].cpu() != 0
    scores = batch["token_scores"].sum(-1).tolist() if "token_scores" in batch else [None] * len(batch)
    advantages = _mean_advantage(batch, policy) if "advantages" in batch else [None] * len(batch)
    records = []
    for i in range(len(batch)):
        record = {
            "step": step,
            "prompt": _decode(tokenizer, prompt_ids[i][prompt_mask[i] != 0]),
            "response": _decode(tokenizer, responses[i][attended[i]]),
            "score": scores[i],
            "advantage": advantages[i],
            "data_source": _field(batch, "data_source", i),
            "finish_reason": _field(batch, "finish_reason", i),
            "ground_truth": _field(batch, "ground_truth", i),
        }
        if "judge_verdicts" in batch and batch["judge_verdicts"][i] is not None:  # the judge's words
            record["judge"] = batch["judge_verdicts"][i]
        if advantages[i] is None:  # validation: no advantages
            del record["advantage"]
        if bool((attended[i] & ~policy[i]).any()):  # observations inside the response
            record["turns"] = _turns(tokenizer, responses[i], policy[i], attended[i])
        records.append(record)
    return records


def _mean_advantage(batch: Batch, policy: torch.Tensor) -> list[float]:
    adv = batch["advantages"].detach().float().cpu()
    mask = policy.float()
    return ((adv * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).tolist()


def _turns(tokenizer: Any, ids: torch.Tensor, policy: torch.Tensor, attended: torch.Tensor) -> list[dict]:
    """The attended response tokens as runs of model tokens and observation tokens, decoded."""
    turns: list[dict] = []
    run: list[int] = []
    role = None
    for token, mine, seen in zip(ids.tolist(), policy.tolist(), attended.tolist(), strict=True):
        if not seen:
            continue
        now = "model" if mine else "observation"
        if now != role and run:
            turns.append({"role": role, "text": _decode(tokenizer, run)})
            run = []
        role = now
        run.append(token)
    if run:
        turns.append({"role": role, "text": _decode(tokenizer, run)})
    return turns


def _decode(tokenizer: Any, ids: Any) -> str:
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return tokenizer.decode(ids, skip_special_tokens=False)


def _field(batch: Batch, key: str, i: int) -> Any:
    return batch[key][i] if key in batch else None


def _cell(value: Any) -> Any:
    """A W&B table cell: plain scalars and strings as they are, anything else as its JSON text."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return _json(value).decode()


def _json(value: Any) -> bytes:
    """JSON of a record: numpy values (parquet ground truths) as lists, anything else unknown as text."""
    return orjson.dumps(value, default=str, option=orjson.OPT_SERIALIZE_NUMPY)

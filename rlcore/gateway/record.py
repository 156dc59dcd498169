"""What the gateway recorded, and how it becomes training samples: pure data, no I/O.

Every engine call the gateway makes for a session is kept as a `Call`: the exact prompt token ids the
engine saw, the ids it sampled, their log-probs and the policy version that sampled them. The trainer
never re-tokenizes text: a sample is built from these ids alone.

A session's calls become samples by token-exact prefix. Call k+1 continues the segment of call k when
its prompt starts with `call_k.prompt_ids + call_k.ids`; the tokens between that end and call k+1's
prompt end are observations (tool results, the next user turn, the template's closing). When it does
not (a template that drops earlier `<think>` blocks, as Qwen3's does; an agent that edits or trims its
history; one of `n` sibling choices), the call starts a new segment, so one session may give several
samples:

    prompt   = segment[0].prompt_ids
    response = segment[0].ids | obs_1 | segment[1].ids | obs_2 | ...
    mask       1 ...            0 ...   1 ...            0 ...       (response_mask)
    logprobs   sampled ...      0 ...   sampled ...      0 ...       (rollout_logprobs)

`to_batch` lays samples out as the agent loop (`rlcore.rollout.agent.loop`) lays out its output: left-padded
prompts (`rlcore.data.prompts.left_pad`), right-padded responses with the pad id, the budget cut.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from rlcore.batch import Batch
from rlcore.data.prompts import left_pad, right_pad


@dataclasses.dataclass(frozen=True)
class Call:
    """One sampled completion: what the engine saw and what it drew."""

    prompt_ids: tuple[int, ...]
    """The context the engine sampled from (unpadded)."""
    ids: tuple[int, ...]
    """The sampled token ids (a stop token included, as the engine returns them)."""
    logprobs: tuple[float, ...]
    """Log-prob of each sampled id under the distribution it was drawn from."""
    finish_reason: str
    """The engine's: "stop" or "length"."""
    version: int
    """The policy version (the gateway's `version` when the engine was called)."""


@dataclasses.dataclass(frozen=True)
class RecordedSample:
    """One training sample's tokens, before padding: a prompt and a response of model and observation tokens."""

    prompt: tuple[int, ...]
    response: tuple[int, ...]
    mask: tuple[float, ...]
    """1.0 on sampled tokens, 0.0 on observations."""
    logprobs: tuple[float, ...]
    """Sampled tokens' log-probs, 0.0 on observations."""
    versions: tuple[int, ...]
    """The policy version of each response token (an observation takes the version of the call it precedes)."""
    finish_reason: str
    num_turns: int


def extends(previous: Call, call: Call) -> bool:
    """Whether `call`'s prompt starts with `previous`'s whole context (prompt + sampled ids), token for token."""
    context = previous.prompt_ids + previous.ids
    return call.prompt_ids[: len(context)] == context


def segments(calls: Sequence[Call]) -> list[list[Call]]:
    """`calls` (in order) split where a call does not extend the previous one; `len(result) - 1` splits."""
    out: list[list[Call]] = []
    for call in calls:
        if out and extends(out[-1][-1], call):
            out[-1].append(call)
        else:
            out.append([call])
    return out


def splits(calls: Sequence[Call]) -> int:
    """How many times `calls` break the prefix chain (0 for a session that is one sample)."""
    return max(len(segments(calls)) - 1, 0)


def sample(segment: Sequence[Call]) -> RecordedSample:
    """The tokens of one segment (see the module docstring); `segment` must chain by `extends`."""
    first = segment[0]
    response: list[int] = []
    mask: list[float] = []
    logprobs: list[float] = []
    versions: list[int] = []
    end = len(first.prompt_ids)  # where the context so far ends, in prompt coordinates
    for call in segment:
        assert len(call.prompt_ids) >= end, "a segment's calls must extend each other"
        observation = call.prompt_ids[end:]
        response += [*observation, *call.ids]
        mask += [0.0] * len(observation) + [1.0] * len(call.ids)
        logprobs += [0.0] * len(observation) + list(call.logprobs)
        versions += [call.version] * (len(observation) + len(call.ids))
        end = len(call.prompt_ids) + len(call.ids)
    return RecordedSample(first.prompt_ids, tuple(response), tuple(mask), tuple(logprobs), tuple(versions),
                  segment[-1].finish_reason, len(segment))  # fmt: skip


def cut(item: RecordedSample, max_response: int) -> RecordedSample:
    """`item` with at most `max_response` response tokens; a cut sample finishes with "length"."""
    if len(item.response) <= max_response:
        return item
    k = max_response
    return dataclasses.replace(item, response=item.response[:k], mask=item.mask[:k], logprobs=item.logprobs[:k],
                               versions=item.versions[:k], finish_reason="length")  # fmt: skip


def to_batch(samples: Sequence[RecordedSample], *, pad_id: int, max_response: int, uids: Sequence[str]) -> Batch:
    """A rollout Batch with the agent loop's fields: prompt tensors (b, p), `responses`, `response_mask`,
    `response_attention`, `rollout_logprobs`, `rollout_versions` (b, t), `finish_reason`, `uid`, and
    `num_turns`, `num_observation_tokens` (b,); responses cut at `max_response`."""
    if len(uids) != len(samples):
        raise ValueError(f"to_batch: {len(samples)} samples but {len(uids)} uids")
    samples = [cut(s, max_response) for s in samples]
    input_ids, attention_mask, position_ids = left_pad([s.prompt for s in samples], pad_id)  # (b, p)
    t = max((len(s.response) for s in samples), default=0)
    responses = right_pad([s.response for s in samples], pad_id, torch.long, t)  # (b, t)
    mask = right_pad([s.mask for s in samples], 0, torch.float32, t)
    attention = right_pad([[1.0] * len(s.response) for s in samples], 0, torch.float32, t)
    logprobs = right_pad([s.logprobs for s in samples], 0, torch.float32, t)
    versions = right_pad([s.versions for s in samples], 0, torch.long, t)
    return Batch.from_dict({
        "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
        "responses": responses, "response_mask": mask, "response_attention": attention,
        "rollout_logprobs": logprobs, "rollout_versions": versions,
        "finish_reason": [s.finish_reason for s in samples], "uid": list(uids),
        "num_turns": torch.tensor([s.num_turns for s in samples], dtype=torch.long),
        "num_observation_tokens": torch.tensor([s.mask.count(0.0) for s in samples], dtype=torch.long),
    })  # fmt: skip

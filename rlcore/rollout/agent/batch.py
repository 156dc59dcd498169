"""The output batch of an agent rollout (`rlcore.rollout.agent.loop`), assembled once all samples have ended.

    batch = assemble(rows, trajectories, prompt_ids, pad, setup)

Each sample's response (model tokens and observations) is right-padded into the fields every engine
returns (`rlcore.rollout.base`), with the counts of its turns, tool calls, tool errors and observation
tokens. The rest depends on the run: each token's policy version where the engine tagged them (partial
rollouts); the prompts the policy saw where they differ from the rows' (an environment's first
observation, a vision-language policy's expanded images) with the vision fields; the environment's
rewards and faults; and, with a chat template, whether rendering the whole conversation again would give
the tokens the policy saw (`retokenize_mismatch`: where it would not, the template is not prefix-stable).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlcore.batch import Batch
from rlcore.data.prompts import left_pad, right_pad
from rlcore.rollout.agent.images import assembled_fields, expanded, template_messages
from rlcore.rollout.agent.state import Setup, Trajectory


def assemble(
    rows: Batch, trajectories: list[Trajectory], prompt_ids: list[list[int]], pad: int, setup: Setup
) -> Batch:
    """`rows` (one per sample) with each sample's response, its counts and the fields of the run's kind."""
    t = max((len(x.tokens) for x in trajectories), default=0)
    responses, mask, attention, logprobs = _response_tensors(trajectories, pad, t)
    device = rows["input_ids"].device
    counts = {
        f"num_{name}": torch.tensor([getattr(x, name) for x in trajectories], dtype=torch.long, device=device)
        for name in ("turns", "tool_calls", "tool_errors", "observation_tokens")
    }
    fields = _run_fields(trajectories, prompt_ids, pad, setup, t, device)
    return rows.with_(
        responses=responses.to(device),
        response_mask=mask.to(device),
        response_attention=attention.to(device),
        rollout_logprobs=logprobs.to(device),
        finish_reason=[x.finish or "length" for x in trajectories],
        **counts,
        **fields,
        overwrite=True,
    )


def _response_tensors(
    trajectories: list[Trajectory], pad: int, t: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(b, t) right-padded responses, response mask, response attention and log-probs."""
    responses = right_pad([x.tokens for x in trajectories], pad, torch.long, t)
    mask = right_pad([x.mask for x in trajectories], 0, torch.float32, t)
    attention = right_pad([[1.0] * len(x.tokens) for x in trajectories], 0, torch.float32, t)
    logprobs = right_pad([x.logprobs for x in trajectories], 0, torch.float32, t)
    return responses, mask, attention, logprobs


def _run_fields(
    trajectories: list[Trajectory], prompt_ids: list[list[int]], pad: int, setup: Setup, t: int,
    device: torch.device,
) -> dict[str, Any]:  # fmt: skip
    """The fields only some runs have: versions, the prompts the policy saw, vision, env, re-tokenization."""
    fields: dict[str, Any] = {}
    if any(x.versions for x in trajectories):  # the engine tagged each token's version (partial rollouts)
        fields["rollout_versions"] = _versions(trajectories, t).to(device)
    if (
        setup.env is not None or setup.vision is not None
    ):  # the prompts the policy saw (+ a first observation)
        input_ids, attention_mask, position_ids = left_pad(prompt_ids, pad)
        fields |= {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device),
                   "position_ids": position_ids.to(device)}  # fmt: skip
    if setup.vision is not None:
        vision = assembled_fields(setup.vision, prompt_ids, [x.tokens for x in trajectories],
                                  [x.images for x in trajectories], t)  # fmt: skip
        fields |= {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vision.items()}
    if setup.env is not None:
        fields |= _env_fields(trajectories, device)
    if setup.renderer is not None:
        stable = [x.messages is None or _reencodes(setup, x) for x in trajectories]
        fields["retokenize_mismatch"] = torch.tensor(
            [not s for s in stable], dtype=torch.float32, device=device
        )
    return fields


def _versions(trajectories: list[Trajectory], t: int) -> Tensor:
    """(b, t) each response token's policy version (0 past the end)."""
    versions = torch.zeros((len(trajectories), t), dtype=torch.long)
    for i, x in enumerate(trajectories):
        versions[i, : len(x.versions)] = torch.tensor(x.versions, dtype=torch.long)
    return versions


def _env_fields(trajectories: list[Trajectory], device: torch.device) -> dict[str, Tensor]:
    """Each episode's summed reward (`env_rewards`) and whether its environment failed or timed out."""
    fields = {
        "env_rewards": torch.tensor([x.env_reward for x in trajectories], dtype=torch.float32, device=device)
    }
    for fault in ("error", "timeout"):
        fields[f"env_{fault}s"] = torch.tensor([x.env_fault == fault for x in trajectories], device=device)
    return fields


def _reencodes(setup: Setup, traj: Trajectory) -> bool:
    """Whether the whole conversation, rendered again (images expanded), gives the context the policy saw."""
    if setup.vision is None:
        return setup.renderer.reencodes(traj.messages, traj.context)
    text = setup.renderer.conversation_text(template_messages(traj.messages))
    return (
        setup.renderer.encode(expanded(setup.vision, text, traj.images))[: len(traj.context)] == traj.context
    )

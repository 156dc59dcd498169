"""A model-based reward: a Hugging Face sequence-classification model with its own tokenizer.

    rm = RewardModel.from_pretrained("/models/Skywork-Reward-Llama-3.1-8B", device="cuda", dtype=torch.bfloat16)
    scores = rm.score(prompts, responses)          # (b,) float32 on the CPU

Each (prompt, response) is rendered with the reward model's own chat template as the prompt's
messages (a string prompt becomes one user message) followed by an assistant message holding the
response, as verl does when the reward model's tokenizer differs from the policy's. A tokenizer
without a chat template gets the messages' contents joined by newlines, with its special tokens.
Sequences are right-padded with the model's pad id in micro-batches; the model pools the logit of
the last non-pad token (transformers' `*ForSequenceClassification`), so padding never changes a
score. `max_length` truncates from the left, keeping the end of the response.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


class RewardModel:
    """Scores (prompt, response) pairs with a one-label sequence-classification model."""

    def __init__(
        self, model: Any, tokenizer: Any, *, micro_batch_size: int = 8, max_length: int | None = None
    ):
        if getattr(model.config, "num_labels", None) != 1:
            raise ValueError(
                f"reward model has num_labels={model.config.num_labels}; a reward model outputs one scalar "
                "(load it with num_labels=1)"
            )
        if micro_batch_size < 1:
            raise ValueError(f"--reward.rm-micro-batch-size={micro_batch_size}: expected >= 1")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if model.config.pad_token_id is None:
            if pad_id is None:
                raise ValueError(
                    "the reward model's tokenizer has neither a pad nor an eos token to pad with"
                )
            model.config.pad_token_id = pad_id  # transformers pools the last token that is not this id
        self.model, self.tokenizer = model.eval(), tokenizer
        self.micro_batch_size, self.max_length = micro_batch_size, max_length

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        micro_batch_size: int = 8,
        max_length: int | None = None,
    ) -> RewardModel:
        """Load `AutoModelForSequenceClassification` and `AutoTokenizer` from a local directory or a hub
        id (`rlcore.models.hub.model_directory`)."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from rlcore.models.hub import model_directory

        directory = model_directory(path)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=dtype).to(device)
        return cls(model, tokenizer, micro_batch_size=micro_batch_size, max_length=max_length)

    def render(self, prompt: str | Sequence[dict[str, str]], response: str) -> str:
        """The text the reward model reads: the prompt's messages, then the response as the assistant."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        messages.append({"role": "assistant", "content": response})
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return "\n".join(m["content"] for m in messages)

    def encode(self, prompt: str | Sequence[dict[str, str]], response: str) -> list[int]:
        """Token ids of the rendered pair, left-truncated to `max_length`."""
        special = not getattr(self.tokenizer, "chat_template", None)  # a template writes its own
        ids = list(self.tokenizer(self.render(prompt, response), add_special_tokens=special)["input_ids"])
        return ids[-self.max_length :] if self.max_length else ids

    @torch.no_grad()
    def score(self, prompts: Sequence[Any], responses: Sequence[str]) -> Tensor:
        """One scalar per (prompt, response): (b,) float32 on the CPU."""
        encoded = [self.encode(p, r) for p, r in zip(prompts, responses, strict=True)]
        device = next(self.model.parameters()).device
        out = []
        for start in range(0, len(encoded), self.micro_batch_size):
            chunk = encoded[start : start + self.micro_batch_size]
            width = max(len(ids) for ids in chunk)
            input_ids = torch.full(
                (len(chunk), width), self.model.config.pad_token_id, dtype=torch.long
            )  # (m, s)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)  # (m, s)
            for i, ids in enumerate(chunk):
                input_ids[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
                attention_mask[i, : len(ids)] = 1
            logits = self.model(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)
            ).logits
            out.append(logits[:, 0].float().cpu())  # (m,)
        return torch.cat(out) if out else torch.zeros(0)

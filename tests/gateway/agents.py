"""Agents written against the openai client, as users write them, for `--rollout.agent tests/gateway/agents.py:NAME`."""

import re


async def two_turns(client, row):
    """Asks, then asks again for just the number; the reward function scores the answer (None)."""
    first = await client.chat.completions.create(model="gpt-4o", messages=row["prompt"], max_tokens=6)
    said = first.choices[0].message.content or ""
    again = [*row["prompt"], {"role": "assistant", "content": said}, {"role": "user", "content": "Just the answer."}]
    await client.chat.completions.create(model="gpt-4o", messages=again, max_tokens=6)
    return None


async def edits_history(client, row):
    """Turn 2 sends an edited turn 1 (as a template that drops <think> would): a split, every episode."""
    first = await client.chat.completions.create(model="m", messages=row["prompt"], max_tokens=6)
    said = "Edited: " + (first.choices[0].message.content or "")  # (an edit after the sampled tokens would
    # keep the chain: they are all there, the added text an observation)
    again = [*row["prompt"], {"role": "assistant", "content": said}, {"role": "user", "content": "Sure?"}]
    await client.chat.completions.create(model="m", messages=again, max_tokens=6)
    return {"reward": 1.0, "edits": 1}


async def fails_sometimes(client, row):
    """Raises on every prompt whose text holds an even digit count, after one call; 0.5 otherwise."""
    await client.chat.completions.create(model="m", messages=row["prompt"], max_tokens=4)
    if len(re.findall(r"\d", row["prompt"][-1]["content"])) % 2 == 0:
        raise RuntimeError("the agent's own bug")
    return 0.5


def not_async(client, row):
    return 1.0


async def wrong_arguments(client):
    return 1.0

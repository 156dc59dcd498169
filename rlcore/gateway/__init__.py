"""An OpenAI-compatible endpoint in front of a rollout engine that records token-exact trajectories.

    from rlcore.gateway import Gateway, segments, sample, to_batch

    with Gateway(engine, tokenizer) as gw:
        run_my_agent(openai.OpenAI(base_url=gw.base_url, api_key="episode-1"))
        calls = gw.take("episode-1")                      # what the engine saw and sampled
    samples = [sample(s) for s in segments(calls)]        # split where the prefix chain breaks
    batch = to_batch(samples, pad_id=pad, max_response=512, uids=["episode-1"] * len(samples))

`record` (pure data: calls, segments, samples, the Batch), `batcher` (continuous batching on one engine
thread), `translate` (OpenAI bodies <-> token ids), `schema` (request bodies and errors), `server`
(the FastAPI app and `Gateway`).
"""

from typing import Any

from rlcore.gateway.record import Call, RecordedSample, cut, extends, sample, segments, splits, to_batch

__all__ = ["Batcher", "Call", "Gateway", "RecordedSample", "create_app", "cut", "extends", "sample", "segments",
           "splits", "to_batch"]  # fmt: skip

_SERVED = {"Batcher": "rlcore.gateway.batcher", "Gateway": "rlcore.gateway.server", "create_app": "rlcore.gateway.server"}
"""Names whose modules import the server stack (the `gateway` extra: fastapi, uvicorn, openai), loaded when
first asked for, so that a run without `--rollout.agent` never imports it."""


def __getattr__(name: str) -> Any:
    if name in _SERVED:
        import importlib

        return getattr(importlib.import_module(_SERVED[name]), name)
    raise AttributeError(f"module 'rlcore.gateway' has no attribute {name!r}")

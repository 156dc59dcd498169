"""Model paths: a local Hugging Face directory, or a hub id resolved through the Hugging Face cache.

    model_directory("/models/Qwen2.5-0.5B-Instruct")   # a directory: itself
    model_directory("Qwen/Qwen2.5-0.5B-Instruct")      # a hub id: its snapshot in the HF cache
    model_directory("SmolLM2-135M-Instruct.Q4_1.gguf") # a GGUF file: its dequantized copy (rlcore.models.gguf)

A hub id goes through `huggingface_hub.snapshot_download`, the cache `from_pretrained` uses
(`HF_HOME` / `HF_HUB_CACHE`, `HF_HUB_OFFLINE=1` for cache only, `HF_TOKEN` for gated repos): the newest
cached snapshot offline; online, the repo's config, tokenizer and safetensors weights (not every file
in it). Every consumer (the policy, the critic, vLLM, a reward model) then reads the same local
directory. An id that is neither cached nor downloadable is a `ValueError` naming it and the fix.
"""

from __future__ import annotations

import re
from pathlib import Path

from rlcore.models.gguf import dequantized_directory, is_gguf

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
"""What a hub id looks like: `name` or `owner/name` (letters, digits, `_`, `-`, `.`)."""

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]
"""The files of a hub repo a download fetches: configs, tokenizers, chat templates, safetensors weights."""


def model_directory(path: str) -> Path:
    """The local directory of `path`: a directory as given (`~` expanded), or a hub id's cached snapshot."""
    directory = Path(path).expanduser()
    if directory.is_dir():
        return directory
    if is_gguf(path):
        return dequantized_directory(directory)
    if not HUB_ID.fullmatch(path) or directory.exists():
        raise ValueError(
            f"model path {path!r} is not a directory; expected a local Hugging Face model directory or a "
            f"hub id such as Qwen/Qwen2.5-0.5B-Instruct"
        )
    return _snapshot(path)


def _snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    try:
        return Path(snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError, OSError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"model path {repo_id!r} is not a local directory, and as a Hugging Face hub id it is neither "
            f"in the cache nor downloadable ({reason}); download it where there is network "
            f"(`hf download {repo_id}`) into this machine's HF_HOME cache, or pass a local directory"
        ) from None

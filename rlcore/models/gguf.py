"""GGUF checkpoints as model paths: `--model.path model.Q4_1.gguf` (and the critic's, the reference's,
a reward model's).

    directory = dequantized_directory(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))
    # a Hugging Face directory (safetensors, config, tokenizer and chat template from the file)

transformers' GGUF support (the `gguf` package) dequantizes the file to float32 once; the result is
written to a cache directory keyed by the file's content and the transformers version
(`$RLCORE_CACHE`, default `~/.cache/rlcore`, under `gguf/<key>`), so every later run, every rank
under torchrun and vLLM load that directory like any other. Writers take a file lock and publish the
directory by an atomic rename: concurrent ranks convert once. A quantized file is a rounding of the
released weights (Q4_1: 4-bit blocks with a scale and a minimum), not the weights themselves.

Refused before any conversion, in one line naming the file: a missing `gguf` package, an architecture
rlcore does not train, a tensor quantization type that cannot be dequantized.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

SUFFIX = ".gguf"

TRAINED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
"""GGUF `general.architecture` values rlcore trains: dense decoder-only models of the Llama layout (its
native engine's lean decode step and its tensor-parallel plans know them)."""

_NATIVE_TYPES = ("F32", "F16", "BF16")
"""Tensor types that are read as they are (no dequantization)."""


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(SUFFIX)


def cache_root() -> Path:
    """`$RLCORE_CACHE`, else `$XDG_CACHE_HOME/rlcore`, else `~/.cache/rlcore`."""
    if os.environ.get("RLCORE_CACHE"):
        return Path(os.environ["RLCORE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rlcore"


def dequantized_directory(file: Path) -> Path:
    """The Hugging Face directory of GGUF `file`, converted once and cached (see the module docstring);
    a ValueError naming the file and the fix for what cannot be used."""
    file = file.expanduser()
    if not file.is_file():
        raise ValueError(f"model path {str(file)!r}: no such GGUF file")
    directory = cache_root() / "gguf" / content_key(file)
    if (directory / "config.json").is_file():
        return directory
    check_file(file)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with _locked(directory.parent / f"{directory.name}.lock"):
        if not (directory / "config.json").is_file():  # another process may have converted it meanwhile
            try:
                _convert(file, directory)
            except (ValueError, NotImplementedError, KeyError, OSError) as e:
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ValueError(
                    f"model path {str(file)!r}: transformers cannot load this GGUF file ({reason})"
                ) from None
    return directory


def content_key(file: Path) -> str:
    """The cache key: a hash of the file's bytes and of the transformers version that dequantizes it
    (hashed once per process for a file of the same size and modification time: a run resolves its
    model path several times, and a 7B file takes seconds to read)."""
    stat = file.stat()
    return _content_key(file.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _content_key(file: Path, size: int, mtime_ns: int) -> str:
    import transformers

    digest = hashlib.sha256()
    with file.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    digest.update(transformers.__version__.encode())
    return f"{file.stem}-{digest.hexdigest()[:16]}"


def check_file(file: Path) -> None:
    """Refuse a file rlcore cannot use, before converting: no `gguf` package, an architecture it does not
    train, a tensor type that cannot be dequantized."""
    try:
        import gguf
        from gguf.quants import _type_traits  # the types gguf-py can dequantize
    except ImportError:
        raise ValueError(
            f"model path {str(file)!r}: reading GGUF needs the gguf package; pip install gguf accelerate"
        ) from None
    try:
        reader = gguf.GGUFReader(file)
    except (ValueError, OSError) as e:
        raise ValueError(f"model path {str(file)!r}: not a readable GGUF file ({e})") from None
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in TRAINED_ARCHITECTURES:
        raise ValueError(
            f"model path {str(file)!r}: GGUF architecture {arch!r} is not one rlcore trains; use a "
            f"{'/'.join(TRAINED_ARCHITECTURES)} model, or convert a Hugging Face directory of it instead"
        )
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        if kind.name not in _NATIVE_TYPES and kind not in _type_traits:
            raise ValueError(
                f"model path {str(file)!r}: tensor {tensor.name} is quantized as {kind.name}, which the gguf "
                "package cannot dequantize; use a file quantized as Q4_0/Q4_1/Q5_*/Q8_0/Q*_K, F16 or F32"
            )


def _convert(file: Path, directory: Path) -> None:
    """Dequantize `file` with transformers into a fresh directory, then publish it by renaming."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": file.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(file.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(file.parent, dtype=torch.float32, **kw)
    model.hf_quantizer = None  # dequantized: a plain float32 model from here on
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "SOURCE").write_text(f"{file.resolve()}\n")
        shutil.rmtree(directory, ignore_errors=True)  # a directory without config.json is no entry
        staging.rename(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    import fcntl

    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

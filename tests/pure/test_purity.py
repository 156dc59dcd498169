"""rlcore.pure stays pure: it imports torch and itself only, and never syncs the host or prints."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PURE = Path(__file__).resolve().parents[2] / "rlcore" / "pure"
FILES = sorted(PURE.glob("*.py"))
ALLOWED_ROOTS = {"torch", "rlcore", "__future__", "typing", "collections", "math", "numbers", "dataclasses"}
FORBIDDEN_CALLS = {"item", "tolist", "print", "open", "numpy", "cpu"}
FORBIDDEN_MODULES = {"torch.distributed", "transformers", "numpy", "os", "sys", "io"}


def test_there_are_pure_modules():
    assert {p.stem for p in FILES} >= {"masks", "groups", "advantages", "kl", "losses", "logprobs"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_imports_are_torch_and_rlcore_pure_only(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        for name in names:
            assert name.split(".")[0] in ALLOWED_ROOTS, f"{path.name} imports {name}"
            assert not any(name == m or name.startswith(m + ".") for m in FORBIDDEN_MODULES), name
            if name.startswith("rlcore"):
                assert name.startswith("rlcore.pure"), f"{path.name} imports {name} outside rlcore.pure"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_no_host_sync_io_or_printing(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            assert name not in FORBIDDEN_CALLS, f"{path.name}:{node.lineno} calls {name}()"
        if isinstance(node, ast.Global):
            raise AssertionError(f"{path.name}:{node.lineno} uses a global")

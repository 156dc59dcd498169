"""Checkpoints load as data, never as code: every file a run writes is read by a loader that cannot run
code (json, safetensors, torch.load(weights_only=True), DCP through rlcore.dist.safe_dcp); crafted files
are refused without running their payload; and no code in rlcore unpickles anything else (or trusts a
model directory's code)."""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict

from rlcore.dist.checkpoint import COMPLETE, load_checkpoint
from rlcore.dist.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

ROOT = Path(__file__).resolve().parents[2]
UNREAD = object()


def _load_dcp(directory: Path) -> dict:
    """Every entry of a DCP directory, read through the safe reader and planner."""
    metadata = SafeFileSystemReader(directory).read_metadata()
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata)
             else UNREAD for key, meta in metadata.state_dict_metadata.items()}  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        reader = SafeFileSystemReader(directory)
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    assert not [key for key, value in state.items() if value is UNREAD]
    return state


def test_every_file_of_a_run_loads_without_unpickling_code(reference):
    checked = []
    for path in sorted(p for p in reference.rglob("*") if p.is_file()):
        name = path.relative_to(reference).as_posix()
        if name.startswith("checkpoints/") and path.parent.name == "dcp":
            if path.name == ".metadata":
                assert _load_dcp(path.parent)  # the index and every shard of the directory
            else:
                assert path.suffix == ".distcp", name  # read by _load_dcp above
        elif path.suffix == ".safetensors":
            assert load_file(path)
        elif path.suffix == ".pt":
            assert torch.load(path, weights_only=True)
        elif path.suffix == ".json" or path.name == COMPLETE:
            assert json.loads(path.read_text())
        elif path.suffix == ".jsonl":
            assert [json.loads(line) for line in path.read_text().splitlines()]
        elif path.suffix in (".png", ".jinja"):  # the plot; the tokenizer's chat template (text)
            assert path.stat().st_size > 0
        else:
            pytest.fail(f"{name}: a file of unknown format in a run directory")
        checked.append(name)
    assert any(name.endswith(".distcp") for name in checked) and "final/model.safetensors" in checked


class _Payload:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_checkpoint_index_is_refused_without_running_it(reference, launch, tmp_path):
    checkpoint, marker = tmp_path / "step_4", tmp_path / "pwned"
    shutil.copytree(reference / "checkpoints" / "step_4", checkpoint)
    (checkpoint / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    from tests.reliability.helpers import RUN

    proc = launch.run([*RUN, "--resume", str(checkpoint)], out=tmp_path / "run")
    assert not marker.exists()
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "refers to posix.system" in lines[0] and "refusing to unpickle" in lines[0], lines


def test_a_crafted_value_in_a_shard_is_refused_without_running_it(tmp_path):
    model = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    marker, directory = tmp_path / "pwned", tmp_path / "step_1" / "dcp"
    optim_sd["param_groups"][0]["lr"] = _Payload(marker)  # DCP stores non-tensor values with torch.save
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory, no_dist=True)
    (tmp_path / "step_1" / COMPLETE).write_text("{}")
    with pytest.raises(BaseException, match="Weights only load failed"):  # DCP's CheckpointException
        load_checkpoint(tmp_path / "step_1", model, optimizer)
    assert not marker.exists()


# ---------------------------------------------------------------- a scan of the code

UNPICKLERS = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("dill", "load"),
              ("dill", "loads"), ("cloudpickle", "load"), ("cloudpickle", "loads"), ("marshal", "loads"),
              ("pd", "read_pickle"), ("pandas", "read_pickle"), ("joblib", "load")}  # fmt: skip


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def unsafe_loads(source: str, filename: str) -> list[str]:
    """Lines of `source` that could run code from a file: torch.load without weights_only=True, pickle & co.,
    np.load(allow_pickle=True), dcp.load without the safe reader and planner, trust_remote_code."""
    found = []
    tree = ast.parse(source, filename)
    allowed_bases = {
        id(b)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and any(isinstance(f, ast.FunctionDef) and f.name == "find_class" for f in node.body)
        for b in node.bases
    }  # fmt: skip  (an Unpickler subclass restricting its globals)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in {m for m, _ in UNPICKLERS}:
            found += [f"{filename}:{node.lineno}" for a in node.names if (node.module, a.name) in UNPICKLERS]
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
            continue
        owner, attr = node.value.id, node.attr
        if (owner, attr) in UNPICKLERS and id(node) not in allowed_bases:
            found.append(f"{filename}:{node.lineno}: {owner}.{attr}")
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
        owner = call.func.value.id if isinstance(call.func.value, ast.Name) else None
        where = f"{filename}:{call.lineno}: {owner}.{call.func.attr}"
        if (owner, call.func.attr) == ("torch", "load"):
            weights_only = _keyword(call, "weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                found.append(where + " without weights_only=True")
        if (owner, call.func.attr) in {("np", "load"), ("numpy", "load")}:
            allow = _keyword(call, "allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                found.append(where + " with allow_pickle")
        remote = _keyword(call, "trust_remote_code")
        if remote is not None and not (isinstance(remote, ast.Constant) and remote.value is False):
            found.append(where + " with trust_remote_code (runs the model directory's code)")
        safe = _keyword(call, "storage_reader") is not None and _keyword(call, "planner") is not None
        if (owner, call.func.attr) == ("dcp", "load") and not safe:
            found.append(where + " without the safe storage_reader and planner")
    return found


def test_no_code_in_rlcore_loads_pickles():
    files = [*sorted((ROOT / "rlcore").rglob("*.py")), ROOT / "train.py", ROOT / "configs.py"]
    found = [line for path in files for line in unsafe_loads(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.load(path)\n",
        "import torch\ntorch.load(path, weights_only=False)\n",
        "import pickle\npickle.loads(data)\n",
        "from pickle import load\n",
        "import numpy as np\nnp.load(path, allow_pickle=True)\n",
        "import torch.distributed.checkpoint as dcp\ndcp.load(state, checkpoint_id=path)\n",
        "import pickle\nclass U(pickle.Unpickler):\n    pass\n",
        "from transformers import AutoModel\nAutoModel.from_pretrained(path, trust_remote_code=True)\n",
    ],
)
def test_the_scan_flags_each_unsafe_load(source):
    assert unsafe_loads(source, "example.py")


def test_the_scan_accepts_the_safe_forms():
    source = (
        "import torch, pickle\ntorch.load(path, weights_only=True)\n"
        "class U(pickle.Unpickler):\n    def find_class(self, module, name):\n        raise Error\n"
    )
    assert unsafe_loads(source, "example.py") == []

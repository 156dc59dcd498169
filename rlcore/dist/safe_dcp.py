"""Reading DCP checkpoints without running code from them.

torch.distributed.checkpoint stores its index (`.metadata`) as a plain pickle and loads non-tensor
values (optimizer hyper-parameters) with `torch.load(weights_only=False)`: a crafted checkpoint could
run any code on `--resume`. `load(state, path)` reads the same files with

- `SafeFileSystemReader`: the index is unpickled by an allow-list unpickler that resolves only DCP's
  metadata dataclasses, `torch.Size`, dtypes, layouts and paths (pickle's documented "restricting
  globals" recipe); anything else is refused with `pickle.UnpicklingError`;
- `SafeLoadPlanner`: non-tensor values are loaded with `torch.load(weights_only=True)`.

Tensor data was already read with `weights_only=True` by DCP itself. Saving is unchanged.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout from its name
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}  # fmt: skip


class _IndexUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{self.source} refers to {module}.{name}, which a checkpoint index never contains; "
            "refusing to unpickle it (the file is damaged or was crafted)"
        )


class SafeFileSystemReader(dcp.FileSystemReader):
    """`FileSystemReader` whose `.metadata` is read by an allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _IndexUnpickler(stream, Path(path)).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not a DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that loads non-tensor values with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:  # the parent's, but weights_only
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load(state: dict[str, Any], path: str | Path, *, no_dist: bool, process_group: Any = None) -> None:
    """`dcp.load(state, checkpoint_id=path)` through the safe reader and planner (in place), by the ranks
    of `process_group` (default: all)."""
    reader = SafeFileSystemReader(path)
    reader.read_metadata()  # a refused index raises here, not inside DCP (which logs it and retries)
    dcp.load(
        state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist, process_group=process_group
    )

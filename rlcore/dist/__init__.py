"""Distribution: DeviceMesh, FSDP2 wrapping, tensor parallelism, global reductions, DCP checkpoints,
weight streaming.

Knows nothing of RL. One process needs none of it beyond `init_distributed` (which then creates no
process group) and `build_mesh` (which then returns None): the trainer keeps the plain module.

    info = init_distributed()                      # torchrun env, or one process
    mesh = build_mesh(info, replicate=1)           # DeviceMesh, or None for one process
    if mesh is not None:
        apply_fsdp(model, mesh, param_dtype=torch.bfloat16 if info.device.type == "cuda" else None)
"""

from rlcore.dist.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    prune,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from rlcore.dist.fsdp import (
    apply_activation_checkpointing,
    apply_fsdp,
    decoder_layers,
    model_mesh,
    set_gradient_sync,
)
from rlcore.dist.mesh import DistInfo, MeshAxis, build_mesh, close_distributed, init_distributed
from rlcore.dist.reduce import all_reduce, all_reduce_int, mesh_size
from rlcore.dist.stream import gathered_state, iter_full_state, save_hf_pretrained
from rlcore.dist.tp import apply_tp

__all__ = [
    "DistInfo",
    "MeshAxis",
    "all_reduce",
    "all_reduce_int",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "apply_tp",
    "build_mesh",
    "close_distributed",
    "decoder_layers",
    "gathered_state",
    "init_distributed",
    "iter_full_state",
    "latest_checkpoint",
    "load_checkpoint",
    "mesh_size",
    "model_mesh",
    "prune",
    "rng_state",
    "save_checkpoint",
    "save_hf_pretrained",
    "set_gradient_sync",
    "set_rng_state",
]

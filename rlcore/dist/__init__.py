"""Distribution: DeviceMesh, FSDP2 wrapping, global reductions, DCP checkpoints, weight streaming.

Knows nothing of RL. Filled in by the training-engine work (FSDP2 / DTensor).
"""

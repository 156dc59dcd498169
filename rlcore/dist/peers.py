"""A collective that failed because another rank died: `lost_peer` turns it into one line, and the process
exits with `EXIT_PEER_LOST` so that torchrun restarts the world."""

from __future__ import annotations

EXIT_PEER_LOST = 5
"""A rank of the world died (or its node did) and this rank's collective failed with it: torchrun restarts
the world (--max-restarts) and --resume auto continues from the newest checkpoint."""

_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted")


def lost_peer(e: BaseException) -> str | None:
    """One line on a collective that failed because another rank went away (gloo: its connection reset or
    closed; NCCL: the communicator aborted), None for any other error."""
    from torch.distributed import DistNetworkError

    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    if not isinstance(e, DistNetworkError) and not any(s in first for s in _PEER_LOST):
        return None
    return (f"another rank was lost ({type(e).__name__}: {first[:200]}); this rank stops too. Under torchrun "
            "--max-restarts N the world restarts and --resume auto continues from the newest checkpoint")

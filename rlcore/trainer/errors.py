"""What the run shell turns into a user-facing stop: `StopRun` (one `error:` line, exit code 2) and a
collective that failed because another rank died (`lost_peer`: one line, exit code 5)."""

from __future__ import annotations


class StopRun(Exception):
    """Something the user must fix outside the config (a full disk, an unusable checkpoint); the message
    names the culprit and the fix. `run()` prints it as one line and returns 2; the loop's `finally`
    still closes the reward pool, the logger and the engine."""


def reason(e: BaseException) -> str:
    """One line on what failed, for a StopRun message; DCP wraps each rank's exception: the first is used."""
    failures = getattr(e, "failures", None)
    if failures:
        e = next(iter(failures.values()))[0]
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else '(no message)'}"


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

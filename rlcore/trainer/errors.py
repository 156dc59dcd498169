"""What the run shell turns into a user-facing stop: `StopRun`, one `error:` line and exit code 2 (a collective
that failed because another rank died is `rlcore.dist.peers.lost_peer`: one line, exit code 5)."""

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

"""`python -m rlcore.tinker --port PORT`: serve the Tinker API (also under torchrun: rank 0 serves, every
rank trains). Prints one line with `http://HOST:PORT` once it accepts requests; Ctrl-C stops it. A bad flag
is one `error:` line and exit code 2."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train.py: spinning OpenMP waits stall shared cores

PROG = "python -m rlcore.tinker"


def main(argv: list[str] | None = None) -> int:
    import contextlib
    import io

    import tyro

    from rlcore.config.messages import condense
    from rlcore.tinker.serve import ServeArgs, serve

    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        tyro.cli(ServeArgs, args=argv, prog=PROG)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            args = tyro.cli(ServeArgs, args=argv, prog=PROG)
    except SystemExit:  # tyro's boxed message, as one line
        print(f"error: {condense(captured.getvalue(), PROG)}", file=sys.stderr)
        return 2
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())

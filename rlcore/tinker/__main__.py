"""`python -m rlcore.tinker --port PORT`: serve the Tinker API (also under torchrun: rank 0 serves, every
rank trains). Prints one line with `http://HOST:PORT` once it accepts requests; Ctrl-C stops it."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train.py: spinning OpenMP waits stall shared cores


def main(argv: list[str] | None = None) -> int:
    import tyro

    from rlcore.tinker.serve import ServeArgs, serve

    try:
        args = tyro.cli(ServeArgs, args=sys.argv[1:] if argv is None else argv, prog="python -m rlcore.tinker")
    except SystemExit as e:  # tyro printed the problem (or --help)
        return int(e.code or 0) and 2
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())

"""rlcore trainer entry point: parse → build → loop → close.

Not built yet: the loop lands with the trainer issue. Until then this exits with a clear message
instead of pretending to train.
"""

import sys


def main() -> int:
    print("train.py: the trainer is not built yet; use the rlcore.pure functions directly", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""Test-wide settings: passive OpenMP waiting (see train.py), set before anything imports torch."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

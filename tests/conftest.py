"""Test-wide settings: passive OpenMP waiting (see train.py), set before anything imports torch."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: on a shared 2-core machine, 2 OpenMP threads stall in backward."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

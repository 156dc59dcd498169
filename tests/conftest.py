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


HEAVY = ("vllm", "real_model", "smollm2", "gguf")
"""Words in a test's id that mark it as holding several GB (a vLLM engine, SmolLM2-135M's weights)."""


def pytest_collection_modifyitems(items):
    """Under pytest-xdist (the README's `-n 2 --dist loadgroup`): the heavy tests (HEAVY) run on one worker,
    one after the other, so that two of them never hold their memory at once on a 24 GB machine."""
    for item in items:
        if any(word in item.nodeid.lower() for word in HEAVY):
            item.add_marker(pytest.mark.xdist_group("heavy"))

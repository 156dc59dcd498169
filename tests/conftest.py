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


HEAVY = ("real_model", "smollm2", "gguf")
"""Words in a test's id that mark it as loading SmolLM2-135M (7-11 GB at peak in a training run, with
vLLM beside it; a tiny model's vLLM test holds ~2-3 GB)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "heavy: loads SmolLM2; runs while no other heavy test runs")


def pytest_collection_modifyitems(items):
    """Mark the tests whose id names HEAVY (`heavy`: `one_heavy_at_a_time` serialises them)."""
    for item in items:
        if any(word in item.nodeid.lower() for word in HEAVY):
            item.add_marker(pytest.mark.heavy)


@pytest.fixture(autouse=True)
def one_heavy_at_a_time(request, tmp_path_factory):
    """Under pytest-xdist (the README's `-n 2`), a `heavy` test holds a lock file in the directory the workers'
    temporary directories share, so that two never hold their memory at once on a 24 GB machine."""
    if request.node.get_closest_marker("heavy") is None:
        yield
        return
    import fcntl

    with open(tmp_path_factory.getbasetemp().parent / "heavy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield

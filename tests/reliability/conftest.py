"""Fixtures of the reliability suite: one warm launcher for every train.py run, one reference run."""

from __future__ import annotations

import pytest

from tests.reliability.helpers import RUN, ok
from tests.reliability.launcher import Launcher


@pytest.fixture(scope="session")
def launch():
    with Launcher() as launcher:
        yield launcher


@pytest.fixture(scope="session")
def reference(launch, tmp_path_factory):
    """The uninterrupted run every faulty one is compared with."""
    out = tmp_path_factory.mktemp("reference")
    ok(launch.run(RUN, out=out))
    return out

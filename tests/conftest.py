"""Shared test configuration: deterministic seeds, CUDA marker skipping, the slow-marker switch (WG_SLOW=1), torch's
thread count under pytest-xdist."""

import os

import pytest
import torch


def pytest_configure(config):
    """Under pytest-xdist (``-n N``), each worker's torch takes its share of the cores (``cores // N``, at least 1):
    N workers at torch's default thread count would oversubscribe the CPU, where tiny ops with several threads
    spend their time waiting on each other. Without xdist nothing changes."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // workers))


def pytest_collection_modifyitems(config, items):
    cuda = torch.cuda.is_available()
    slow = os.environ.get("WG_SLOW") == "1"
    for item in items:
        if "cuda" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "slow" in item.keywords and not slow:
            item.add_marker(pytest.mark.skip(reason="long experiment check: set WG_SLOW=1"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test (restored after): on tiny matrices two threads spend their time synchronising,
    ~10× slower on the shared, oversubscribed 2-core CI machine. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fixed_msign(monkeypatch):
    """Muon's per-device msign choice fixed (float32, 5 steps) instead of measured, so tests that compare or count a
    step's operations see the same arithmetic on every machine. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread", "fixed_msign")``."""
    monkeypatch.setenv("WEIGHTGEOM_MSIGN", "float32:5")
    yield

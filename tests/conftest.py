"""Shared test configuration: deterministic seeds, CUDA marker skipping, the slow-marker switch (WG_SLOW=1)."""

import os

import pytest
import torch


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

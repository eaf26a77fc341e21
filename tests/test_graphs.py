"""weightgeom.linalg.graphs: a pure tensor function replayed as a CUDA graph (GPU only; None elsewhere)."""

from __future__ import annotations

import pytest
import torch

from weightgeom.linalg import graphs


def _step(x: torch.Tensor, y: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    for _ in range(k):
        x = torch.tanh(x @ y) + x
    return x, x.sum(dim=-1)


def test_cpu_tensors_and_disabled_replay_return_none(monkeypatch):
    """The caller runs the function itself on the CPU and when WEIGHTGEOM_CUDA_GRAPHS=0; nothing is captured."""
    graphs.clear()
    x, y = torch.randn(4, 8), torch.randn(8, 8)
    assert graphs.replay("step", _step, x, y, k=3) is None
    monkeypatch.setenv(graphs.ENV_VAR, "0")
    assert not graphs.enabled()
    assert graphs.replay("step", _step, x, y, k=3) is None and not graphs._entries


@pytest.mark.cuda
def test_cuda_replay_equals_eager_and_recaptures_per_signature():
    """Replays equal eager calls bitwise for new values of the same signature; another shape or keyword is captured
    separately; a transposed (dense) input keeps its strides; outputs are fresh tensors, not the graph's buffers."""
    graphs.clear()
    g = torch.Generator().manual_seed(0)
    y = torch.randn(8, 8, generator=g).cuda() / 4
    for shape, k in (((4, 8), 3), ((4, 8), 3), ((6, 8), 3), ((4, 8), 5)):
        x = torch.randn(shape, generator=g).cuda()
        out = graphs.replay("step", _step, x, y, k=k)
        assert out is not None
        for a, b in zip(out, _step(x, y, k)):
            assert torch.equal(a, b)
    assert len(graphs._entries) == 3
    xt = torch.randn(8, 4, generator=g).cuda().mT
    out = graphs.replay("step", _step, xt, y, k=3)
    assert torch.equal(out[0], _step(xt, y, 3)[0])
    again = graphs.replay("step", _step, xt, y, k=3)
    assert again[0].data_ptr() != out[0].data_ptr()
    graphs.clear()


@pytest.mark.cuda
def test_cuda_function_that_reads_a_value_on_the_host_runs_eagerly_with_a_warning():
    """A capture that fails (a host read inside) warns once, and that signature returns None (eager) from then on."""
    graphs.clear()

    def reads(x: torch.Tensor) -> torch.Tensor:
        return x * float(x.max())

    x = torch.ones(3, device="cuda")
    with pytest.warns(RuntimeWarning, match="capture of reads failed"):
        assert graphs.replay("reads", reads, x) is None
    assert graphs.replay("reads", reads, x) is None
    assert torch.equal(reads(x), x)  # the device is still usable afterwards
    graphs.clear()


def test_size_cap_is_read_from_the_environment_and_validated(monkeypatch):
    monkeypatch.delenv(graphs.MAX_MB_ENV_VAR, raising=False)
    assert graphs.max_input_bytes() == 256 << 20
    monkeypatch.setenv(graphs.MAX_MB_ENV_VAR, "0.5")
    assert graphs.max_input_bytes() == 1 << 19
    monkeypatch.setenv(graphs.MAX_MB_ENV_VAR, "inf")
    assert graphs.max_input_bytes() >= 1 << 62
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv(graphs.MAX_MB_ENV_VAR, bad)
        with pytest.raises(ValueError, match=graphs.MAX_MB_ENV_VAR):
            graphs.max_input_bytes()


@pytest.mark.cuda
def test_cuda_arguments_over_the_cap_run_eagerly(monkeypatch):
    """A call whose arguments exceed the cap is not captured (None: the caller runs eagerly), nothing is kept."""
    graphs.clear()
    monkeypatch.setenv(graphs.MAX_MB_ENV_VAR, "0.001")  # ~1 KB
    x, y = torch.randn(64, 8, device="cuda"), torch.randn(8, 8, device="cuda")
    assert graphs.replay("step", _step, x, y, k=2) is None and not graphs._entries
    graphs.clear()


@pytest.mark.cuda
def test_cuda_captured_inputs_stay_within_four_caps(monkeypatch):
    """Once the captured signatures' inputs hold 4 × the per-call cap, new signatures run eagerly (None)."""
    graphs.clear()
    monkeypatch.setenv(graphs.MAX_MB_ENV_VAR, str(2 * (16 * 8 + 64) * 4 / 2**20))  # two calls' inputs per cap
    y = torch.randn(8, 8, device="cuda")
    got = [graphs.replay("step", _step, torch.randn(16 + i, 8, device="cuda"), y, k=1) for i in range(12)]
    assert all(g is not None for g in got[:6]) and all(g is None for g in got[-3:])
    held = sum(b.numel() * b.element_size() for e in graphs._entries.values() if e for b in e.inputs)
    assert held <= 4 * graphs.max_input_bytes()
    graphs.clear()


@pytest.mark.cuda
def test_cuda_replay_follows_the_callers_resolved_setting_over_the_environment(monkeypatch):
    """max_mb (a Numerics' graphs_max_mb) decides alone: 0 captures nothing even where the environment allows it, a
    cap at least the input's size captures even under WEIGHTGEOM_CUDA_GRAPHS=0."""
    graphs.clear()
    x, y = torch.randn(4, 8, device="cuda"), torch.randn(8, 8, device="cuda") / 4
    assert graphs.replay("step", _step, x, y, max_mb=0.0, k=3) is None and not graphs._entries
    monkeypatch.setenv(graphs.ENV_VAR, "0")
    out = graphs.replay("step", _step, x, y, max_mb=1.0, k=3)
    assert out is not None and torch.equal(out[0], _step(x, y, 3)[0]) and len(graphs._entries) == 1
    graphs.clear()

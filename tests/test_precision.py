"""Full-precision float32 matmuls around the geometry (weightgeom.linalg.precision), whatever the process's mode.

``torch.set_float32_matmul_precision("medium")`` runs float32 matmuls in bf16 arithmetic on CPUs with AMX or
AVX512-BF16 (and "high" in TF32 on recent GPUs). Before ``full_precision`` guarded them, manifold-Muon weights ended
3.4e-3 off the Stiefel manifold after 20 steps on the AMX Xeon (2.9e-7 at full precision).
"""

from __future__ import annotations

import pytest
import torch

from weightgeom import manifolds
from weightgeom.linalg import full_precision, with_full_precision
from weightgeom.optim import Muon


def _settings() -> tuple:
    return (torch.backends.fp32_precision, torch.backends.mkldnn.fp32_precision,
            torch.backends.mkldnn.matmul.fp32_precision, torch.backends.cuda.matmul.fp32_precision)


@pytest.fixture
def restore_precision():
    """Put every level of the float32 matmul precision back as it was (other tests run after this one)."""
    before = _settings()
    yield
    torch.backends.fp32_precision, torch.backends.mkldnn.fp32_precision = before[:2]
    torch.backends.mkldnn.matmul.fp32_precision, torch.backends.cuda.matmul.fp32_precision = before[2:]
    assert _settings() == before


@pytest.mark.parametrize("how", ["legacy medium", "legacy high", "mkldnn bf16", "cuda tf32"])
def test_full_precision_sets_ieee_inside_and_restores_after(restore_precision, how):
    if how.startswith("legacy"):
        torch.set_float32_matmul_precision(how.split()[1])
    elif how == "mkldnn bf16":
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    else:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    before = _settings()
    with full_precision():
        assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        with full_precision():  # nested: untouched
            assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
    assert _settings() == before
    with pytest.raises(RuntimeError, match="boom"):  # an exception inside restores too
        with full_precision():
            raise RuntimeError("boom")
    assert _settings() == before


def test_full_precision_leaves_a_full_precision_process_untouched(restore_precision):
    before = _settings()
    with full_precision():
        assert _settings() == before or torch.backends.mkldnn.matmul.fp32_precision == "ieee"
    assert _settings() == before


def test_every_manifold_method_is_wrapped_also_in_a_user_subclass():
    class MyStiefel(manifolds.Stiefel):
        def retract(self, W):
            assert torch.backends.mkldnn.matmul.fp32_precision in ("ieee", "none")
            return super().retract(W)

    for cls in (manifolds.Stiefel, manifolds.DGram, MyStiefel):
        for name in manifolds.Manifold.FULL_PRECISION_METHODS:
            assert getattr(getattr(cls, name), "_full_precision", False), (cls.__name__, name)
    assert with_full_precision(MyStiefel.retract) is MyStiefel.retract  # wrapping twice is a no-op


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_manifold_muon_under_a_bf16_matmul_mode_equals_full_precision(restore_precision, manifold):
    """20 manifold-Muon steps with the process in 'medium' mode equal, bitwise, the same steps at full precision, and
    the mode is still 'medium' afterwards (on a CPU without bf16 units the mode changes nothing; where it does — AMX,
    AVX512-BF16 — the unguarded steps ended 3.4e-3 off the Stiefel manifold)."""
    def run() -> tuple[torch.Tensor, dict]:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(256, 96) * 0.02)
        opt = Muon([{"params": [p], "names": ["w"]}], lr=0.02, manifold=manifold, init="retract")
        for _ in range(20):
            p.grad = torch.randn_like(p) * 1e-3
            opt.step()
        return p.detach().clone(), opt.last_stats["w"]

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full, full_stats = run()
        torch.set_float32_matmul_precision("medium")
        mode = _settings()
        low, low_stats = run()
    assert _settings() == mode  # the process's mode is kept outside the step
    assert torch.equal(full, low) and full_stats == low_stats
    assert manifolds.get(manifold).check(low, tol=1e-6)


def test_full_precision_on_a_torch_without_per_backend_settings(monkeypatch):
    """torch < 2.9 has no ``torch.backends.*.matmul.fp32_precision``: the guard falls back to the process-wide legacy
    setting, sets 'highest' inside and puts the old value back (also after an exception)."""
    from weightgeom.linalg import precision

    calls: list[str] = []
    state = {"p": "medium"}
    monkeypatch.setattr(precision, "_levels", lambda: [])
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: state["p"])

    def setter(p: str) -> None:
        calls.append(p)
        state["p"] = p

    monkeypatch.setattr(torch, "set_float32_matmul_precision", setter)
    with full_precision():
        assert state["p"] == "highest"
    assert state["p"] == "medium" and calls == ["highest", "medium"]
    with pytest.raises(ValueError):
        with full_precision():
            raise ValueError
    assert state["p"] == "medium"
    state["p"] = "highest"
    calls.clear()
    with full_precision():  # already full: untouched
        pass
    assert calls == []


@pytest.mark.cuda
@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_cuda_manifold_muon_under_tf32_equals_full_precision(restore_precision, manifold):
    """On a GPU, "high" precision runs float32 matmuls in TF32 (10-bit mantissa): the guarded manifold-Muon steps must
    still equal, bitwise, the steps of a full-precision process and keep W on its manifold."""
    def run() -> torch.Tensor:
        torch.manual_seed(0)
        p = torch.nn.Parameter((torch.randn(1024, 256) * 0.02).cuda())
        opt = Muon([{"params": [p], "names": ["w"]}], lr=0.02, manifold=manifold, init="retract")
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(10):
            p.grad = torch.randn(p.shape, generator=g, device="cuda") * 1e-3
            opt.step()
        return p.detach().clone()

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = run()
        torch.set_float32_matmul_precision("high")
        low = run()
    assert torch.equal(full, low)
    assert manifolds.get(manifold).check(low.cpu(), tol=1e-6)


def test_an_inherited_setting_stays_inherited(restore_precision):
    """The process sets the generic level; the guard must not pin the op level to that value on exit, so a later change
    of the generic level still reaches the matmuls (the hostile trial's case: it stayed bf16)."""
    torch.backends.fp32_precision = "bf16"
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"  # inherited
    with full_precision():
        assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
    torch.backends.fp32_precision = "ieee"
    assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"


def test_a_thread_leaving_does_not_lower_precision_under_another(restore_precision):
    """Thread A enters a guard, the main thread enters one too, A leaves: the main thread is still at IEEE precision
    (the first implementation restored A's saved 'medium' here); the mode comes back when the main thread leaves."""
    import threading

    torch.set_float32_matmul_precision("medium")
    mode = _settings()
    inside, release = threading.Event(), threading.Event()

    def a() -> None:
        with full_precision():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=a)
    t.start()
    assert inside.wait(10)
    with full_precision():
        release.set()
        t.join(10)
        assert not t.is_alive()
        assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"  # A left, this thread is still inside
    assert _settings() == mode


def test_static_and_class_methods_of_a_subclass_are_guarded_too(restore_precision):
    class Odd(manifolds.Stiefel):
        @staticmethod
        def constraint_violation(W):
            return torch.tensor(torch.backends.mkldnn.matmul.fp32_precision == "ieee")

        @classmethod
        def random_point(cls, *shape, generator=None, dtype=torch.float64):
            assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
            return manifolds.Stiefel().random_point(*shape, generator=generator, dtype=dtype)

    torch.set_float32_matmul_precision("medium")
    assert bool(Odd().constraint_violation(torch.eye(3)))  # called as an instance's staticmethod: W only
    assert Odd.random_point(6, 3).shape == (6, 3)

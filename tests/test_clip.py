"""weightgeom.train.distributed.clip_grad_norm: the trainer's global gradient-norm clip (no host sync on a GPU)."""

from __future__ import annotations

import pytest
import torch

from weightgeom.train.distributed import DistInfo, clip_grad_norm


def _params(device: str, scale: float, dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    ps = []
    for shape in [(64, 32), (32,), (16, 16, 3)]:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
        p.grad = (scale * torch.randn(shape, generator=g)).to(device=device, dtype=dtype)
        ps.append(p)
    return ps


@pytest.mark.parametrize("scale", [1e-3, 10.0])
def test_clip_returns_the_norm_before_clipping_and_scales_only_above(scale):
    ps = _params("cpu", scale)
    before = [p.grad.clone() for p in ps]
    norm = clip_grad_norm(ps, 1.0, DistInfo(device=torch.device("cpu")))
    exact = float(torch.linalg.vector_norm(torch.cat([b.reshape(-1) for b in before]).double()))
    assert norm.shape == () and abs(float(norm) - exact) <= 1e-5 * exact
    if exact <= 1.0:
        assert all(torch.equal(p.grad, b) for p, b in zip(ps, before))
    else:
        coef = 1.0 / (float(norm) + 1e-6)
        assert all(torch.equal(p.grad, b * coef) for p, b in zip(ps, before))
    assert float(clip_grad_norm([], 1.0, DistInfo(device=torch.device("cpu")))) == 0.0


def test_non_finite_gradient_gives_a_non_finite_norm_and_no_scaling():
    ps = _params("cpu", 10.0)
    ps[1].grad[3] = float("nan")
    before = [p.grad.clone() for p in ps]
    norm = clip_grad_norm(ps, 1.0, DistInfo(device=torch.device("cpu")))
    assert torch.isnan(norm)
    assert all(torch.equal(p.grad, b) for p, b in zip(ps[:1], before[:1]))


@pytest.mark.cuda
@pytest.mark.parametrize("scale", [1e-3, 10.0])
def test_cuda_clip_has_no_host_sync_and_matches_the_cpu(scale):
    """On a GPU the norm and the clip factor stay on the device (sync debug mode "error" raises on any host read);
    the clipped gradients equal the CPU path's within float32 rounding (bitwise where not clipped)."""
    cpu, gpu = _params("cpu", scale), _params("cuda", scale)
    n_cpu = clip_grad_norm(cpu, 1.0, DistInfo(device=torch.device("cpu")))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        n_gpu = clip_grad_norm(gpu, 1.0, DistInfo(device=torch.device("cuda")))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert abs(float(n_gpu) - float(n_cpu)) <= 1e-5 * float(n_cpu)
    for a, b in zip(cpu, gpu):
        torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=2e-6, atol=0)


def test_mixed_dtype_gradients_sum_in_their_own_order():
    """The total sums the per-gradient norms in the gradients' order (float32 ones are reduced together but placed
    back): bitwise the one-norm-per-gradient formula the trainer used before, with mixed dtypes too."""
    g = torch.Generator().manual_seed(1)
    ps = []
    for dt in (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float32):
        p = torch.nn.Parameter(torch.zeros(50, dtype=dt))
        p.grad = (3 * torch.randn(50, generator=g)).to(dt)
        ps.append(p)
    ref = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in ps]))
    assert torch.equal(clip_grad_norm(ps, 0.0, DistInfo(device=torch.device("cpu"))), ref)

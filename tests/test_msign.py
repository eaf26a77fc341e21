"""msign presets against the float64 SVD reference (weightgeom.linalg.msign)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from weightgeom import kernels
from weightgeom.linalg import MSIGN_PRESETS, msign, msign_reference

# Tolerances, measured on the shapes below (cond ≤ 4 inputs) with torch 2.13 CPU:
# polar_express (8, 10, 12 steps) vs the SVD reference, max |entry| error: float64 2.5e-15, float32 1.2e-6.
PE_TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
# muon (5 or 7 steps) does not converge to 1: measured singular values of the output in [0.682, 1.134] here
# ([0.51, 1.20] up to cond 100 on 768×768); the test band allows the published ~[0.7, 1.2] plus margin.
MUON_BAND = (0.65, 1.25)
# Singular vectors are preserved exactly by any odd matrix polynomial: off-diagonal of Uᵀ·msign(G)·V, measured
# 1e-15 (float64) / 4e-7 (float32).
VEC_TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
# bfloat16 compute (the CUDA default): measured singular values in [0.994, 1.008], entry error 2.7e-2.
BF16_SV_TOL = 0.05

# Tall, wide, square, batched 3-D and 4-D, 1×n and n×1, and one larger wide matrix.
SHAPES = [(24, 8), (8, 24), (16, 16), (3, 10, 6), (2, 3, 6, 10), (1, 9), (9, 1), (64, 256)]
DTYPES = [torch.float64, torch.float32]


def well_conditioned(*shape: int, cond: float = 4.0, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    """Random (..., m, n) matrix with Haar singular vectors and singular values log-spaced in [1/cond, 1]."""
    g = torch.Generator().manual_seed(seed)
    *batch, m, n = shape
    k = min(m, n)
    U = torch.linalg.qr(torch.randn(*batch, m, k, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(*batch, n, k, generator=g, dtype=torch.float64))[0]
    s = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), k, dtype=torch.float64)
    return ((U * s) @ V.mT).to(dtype)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("steps", [8, 10, 12])
def test_polar_express_matches_reference(shape, dtype, steps):
    G = well_conditioned(*shape, dtype=dtype)
    O = msign(G, method="polar_express", steps=steps)
    assert O.shape == G.shape and O.dtype == dtype
    assert max_err(O, msign_reference(G)) < PE_TOL[dtype]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("steps", [5, 7])
def test_muon_loose_band_same_singular_vectors(shape, dtype, steps):
    """muon is loose by design: singular values land in a band around 1, singular vectors are G's exactly."""
    G = well_conditioned(*shape, dtype=dtype)
    O = msign(G, method="muon", steps=steps).double()
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    D = U.mT @ O @ Vh.mT  # diagonal iff O = U·f(S)·Vᵀ
    diag = torch.diagonal(D, dim1=-2, dim2=-1)
    assert float((D - torch.diag_embed(diag)).abs().max()) < VEC_TOL[dtype]
    assert float(diag.min()) > MUON_BAND[0] and float(diag.max()) < MUON_BAND[1]
    assert max_err(O, msign_reference(G)) > 1e-3 or min(shape[-2:]) == 1  # it really is loose (not exact)


@pytest.mark.parametrize("method", ["polar_express", "muon"])
def test_one_step_is_the_documented_polynomial(method):
    """steps=1: X = G/(‖G‖_F·s), output a·X + b·(XXᵀ)X + c·(XXᵀ)²X with the safety-scaled first triple."""
    preset = MSIGN_PRESETS[method]
    G = well_conditioned(5, 9)
    X = G / (G.norm() * preset.safety)
    a, b, c = preset.coeffs[0]
    if len(preset.coeffs) > 1:
        s = preset.safety
        a, b, c = a / s, b / s**3, c / s**5
    A = X @ X.mT
    expected = a * X + b * A @ X + c * A @ A @ X
    assert max_err(msign(G, method=method, steps=1), expected) < 1e-13
    assert max_err(msign(G.mT, method=method, steps=1), expected.mT) < 1e-13


def test_preset_triples_repeat_last_without_safety():
    t = MSIGN_PRESETS["polar_express"].triples(10)
    assert len(t) == 10 and t[7] == t[8] == t[9] == (1.875, -1.25, 0.375)
    assert t[0][0] == pytest.approx(8.28721201814563 / 1.01)
    assert MSIGN_PRESETS["muon"].triples(5) == [(3.4445, -4.7750, 2.0315)] * 5


def test_default_steps_and_dtypes():
    G = well_conditioned(6, 10, dtype=torch.float32)
    assert torch.equal(msign(G), msign(G, steps=MSIGN_PRESETS["polar_express"].steps))
    assert torch.equal(msign(G, method="muon"), msign(G, method="muon", steps=5))
    # float64 input is computed in float64 on CPU (reaches float64 accuracy).
    assert max_err(msign(G.double()), msign_reference(G)) < PE_TOL[torch.float64]
    # explicit compute dtype: float32 in, float64 compute, float32 out (only the final rounding remains).
    O = msign(G, dtype=torch.float64)
    assert O.dtype == torch.float32 and max_err(O, msign_reference(G)) < 1e-7
    # bfloat16 compute (CUDA default) is loose but sane; bf16 input gives bf16 output.
    Ob = msign(G, dtype=torch.bfloat16)
    s = torch.linalg.svdvals(Ob.double())
    assert Ob.dtype == torch.float32 and float((s - 1).abs().max()) < BF16_SV_TOL
    assert msign(G.bfloat16()).dtype == torch.bfloat16
    assert torch.equal(msign(G, method="svd"), msign_reference(G).float())


@pytest.mark.parametrize("method", ["polar_express", "muon", "svd"])
@pytest.mark.parametrize("shape", [(3, 4), (5, 2), (2, 3, 4, 5), (1, 1)], ids=str)
def test_zero_maps_to_zero(method, shape):
    O = msign(torch.zeros(*shape), method=method)
    assert torch.isfinite(O).all() and torch.equal(O, torch.zeros(*shape))


def test_zero_matrix_in_a_batch_and_rank_deficient():
    G = well_conditioned(4, 6, 9)
    G[2] = 0
    O = msign(G)
    assert torch.equal(O[2], torch.zeros(6, 9, dtype=G.dtype))
    assert max_err(O, msign_reference(G)) < PE_TOL[torch.float64]
    # Rank 1: u vᵀ ↦ u vᵀ/(‖u‖‖v‖) (zero singular values stay zero: a partial isometry).
    u, v = torch.randn(7, 1, dtype=torch.float64), torch.randn(1, 5, dtype=torch.float64)
    assert max_err(msign(u @ v), (u @ v) / (u.norm() * v.norm())) < 1e-10
    # Scale invariance (the input is Frobenius-normalised).
    assert max_err(msign(1e-20 * G), msign(1e20 * G)) < PE_TOL[torch.float64]


@pytest.mark.parametrize("method", ["polar_express", "muon"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 10, 6), (2, 3, 6, 10)], ids=str)
def test_batched_equals_looped(method, dtype, shape):
    G = well_conditioned(*shape, dtype=dtype)
    O = msign(G, method=method)
    flat, Of = G.reshape(-1, *shape[-2:]), O.reshape(-1, *shape[-2:])
    for i in range(flat.shape[0]):
        assert max_err(Of[i], msign(flat[i], method=method)) < PE_TOL[dtype]


def test_bad_input_errors():
    with pytest.raises(ValueError, match="at least 2 dims"):
        msign(torch.ones(5))
    with pytest.raises(ValueError, match="at least 2 dims"):
        msign(torch.tensor(1.0))
    with pytest.raises(ValueError, match="empty matrix"):
        msign(torch.ones(0, 4))
    with pytest.raises(ValueError, match="unknown method 'newton'"):
        msign(torch.ones(3, 4), method="newton")
    with pytest.raises(ValueError, match="steps must be"):
        msign(torch.ones(3, 4), steps=0)


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["polar_express", "muon"])
def test_cuda_default_bf16(method):
    G = well_conditioned(3, 64, 256, dtype=torch.float32).cuda()
    O = msign(G, method=method)
    assert O.device == G.device and O.dtype == torch.float32 and torch.isfinite(O).all()
    s = torch.linalg.svdvals(O.double().cpu())
    lo, hi = (1 - BF16_SV_TOL, 1 + BF16_SV_TOL) if method == "polar_express" else MUON_BAND
    assert float(s.min()) > lo and float(s.max()) < hi
    assert torch.equal(msign(torch.zeros_like(G), method=method), torch.zeros_like(G))


def test_differentiable_when_grad_is_required():
    """With requires_grad the steps avoid out= buffers; forward values equal the no-grad fast path."""
    G = well_conditioned(5, 8, dtype=torch.float64).requires_grad_(True)
    O = msign(G)
    O.pow(2).sum().backward()
    assert G.grad is not None and torch.isfinite(G.grad).all()
    with torch.no_grad():
        assert max_err(O.detach(), msign(G)) < PE_TOL[torch.float64]


@pytest.mark.parametrize("method", sorted(MSIGN_PRESETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (3, 40, 16), (48, 48)])
def test_start_step_continues_the_iteration(method, dtype, shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(7), dtype=dtype)
    full = msign(G, method, steps=10)
    for k in (1, 5, 9):
        part = msign(G, method, steps=k)
        before = part.clone()
        assert torch.equal(msign(part, method, steps=10, start_step=k), full)  # bitwise: same operations
        assert torch.equal(part, before)  # the caller's iterate is not overwritten
    assert torch.equal(msign(full, method, steps=10, start_step=10), full)
    with pytest.raises(ValueError, match="start_step must be in"):
        msign(G, method, steps=5, start_step=6)


# ---- per-device dtype / step choice (weightgeom.linalg.autotune) -----------------------------------------------------
import weightgeom.linalg.autotune as autotune  # noqa: E402
from weightgeom.linalg import msign_choice, orthogonality_error  # noqa: E402


@pytest.fixture
def fresh_choice(tmp_path, monkeypatch):
    """No forced choice, an empty disk cache, nothing remembered in this process."""
    monkeypatch.delenv(autotune.ENV_VAR, raising=False)
    monkeypatch.setenv("WEIGHTGEOM_CACHE_DIR", str(tmp_path))
    autotune.clear_msign_choices()
    yield tmp_path
    autotune.clear_msign_choices()


def test_msign_choice_env_forces_without_measuring(monkeypatch):
    monkeypatch.setattr(autotune, "_measure", lambda device: pytest.fail("measured despite the env var"))
    monkeypatch.setenv(autotune.ENV_VAR, "bfloat16:6")
    c = msign_choice("cpu")
    assert (c.dtype, c.steps, c.source) == (torch.bfloat16, 6, "env")
    monkeypatch.setenv(autotune.ENV_VAR, "float32")
    c = msign_choice("cpu")
    assert (c.dtype, c.steps) == (torch.float32, MSIGN_PRESETS["polar_express"].steps)
    for bad in ("fp8", "float32:0", "bfloat16:x"):
        monkeypatch.setenv(autotune.ENV_VAR, bad)
        with pytest.raises(ValueError, match="WEIGHTGEOM_MSIGN"):
            msign_choice("cpu")


def test_msign_choice_measures_once_then_caches_on_disk(fresh_choice):
    c = msign_choice("cpu")
    assert c.source == "benchmark" and c.dtype in (torch.float32, torch.bfloat16)
    name = str(c.dtype).replace("torch.", "")
    # as orthogonal as torch.optim.Muon's iteration on the probe, with fewer steps than the accurate preset default
    assert c.errors[name] <= c.errors["torch_muon"]
    assert 3 <= c.steps <= MSIGN_PRESETS["polar_express"].steps
    assert msign_choice("cpu") is c  # remembered in this process
    files = list((fresh_choice / "msign").glob("cpu-*.json"))
    assert len(files) == 1
    autotune.clear_msign_choices()
    again = msign_choice("cpu")
    assert again.source == "cache" and (again.dtype, again.steps) == (c.dtype, c.steps)


@pytest.mark.parametrize("bf16_faster", [False, True])
def test_msign_choice_takes_bf16_only_where_faster(fresh_choice, monkeypatch, bf16_faster):
    fast, slow = 0.001, 0.02
    speeds = {torch.float32: slow if bf16_faster else fast, torch.bfloat16: fast if bf16_faster else slow}
    monkeypatch.setattr(autotune, "_step_seconds", lambda dt, device, budget: speeds[dt])
    c = msign_choice("cpu")
    assert c.dtype == (torch.bfloat16 if bf16_faster else torch.float32)
    name = str(c.dtype).replace("torch.", "")
    assert c.errors[name] <= c.errors["torch_muon"]
    if not bf16_faster:
        assert "bfloat16" not in c.errors  # the slower dtype's accuracy probe is skipped


def test_msign_choice_steps_meet_torch_muon_orthogonality(fresh_choice):
    """The chosen (dtype, steps) on a gradient-like input: at least as orthogonal as Keller Jordan's 5-step quintic
    (torch.optim.Muon's iteration) in float32, and strictly less so with one step fewer (the fewest steps)."""
    c = msign_choice("cpu")
    g = torch.Generator().manual_seed(3)
    G = torch.randn(96, 256, generator=g) @ torch.diag(torch.logspace(-2, 0, 256)) @ torch.randn(256, 256, generator=g)
    ours = orthogonality_error(msign(G, dtype=c.dtype, steps=c.steps))
    theirs = orthogonality_error(msign(G, method="muon", steps=5, dtype=torch.float32))
    assert ours <= theirs


def test_orthogonality_error_matches_svd():
    G = torch.randn(40, 70, dtype=torch.float64)
    S = torch.linalg.svdvals(G)
    assert orthogonality_error(G) == pytest.approx(float((S / S.max() - 1).abs().max()), rel=1e-9)
    assert orthogonality_error(G.mT) == pytest.approx(orthogonality_error(G), rel=1e-9)
    assert orthogonality_error(msign_reference(G)) < 1e-10


def test_msign_choice_is_per_thread_count_in_process_as_on_disk(fresh_choice, monkeypatch):
    """A process that changes its thread count looks again (the disk key holds the thread count, and so must the
    in-process memo): a one-thread reference must not reuse the two-thread choice."""
    picks = {1: torch.float32, 2: torch.bfloat16}
    monkeypatch.setattr(autotune, "_measure", lambda device: autotune.MsignChoice(
        str(device), picks[torch.get_num_threads()], 5, "benchmark"))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert msign_choice("cpu").dtype == torch.bfloat16
        torch.set_num_threads(1)
        assert msign_choice("cpu").dtype == torch.float32
        assert len(list((fresh_choice / "msign").glob("cpu-*.json"))) == 2
    finally:
        torch.set_num_threads(n)


def test_adopted_choice_wins_in_this_process(fresh_choice, monkeypatch):
    """rank 0's choice, adopted by another rank, is what that rank's msign_choice returns (no measuring)."""
    monkeypatch.setattr(autotune, "_measure", lambda device: pytest.fail("measured despite an adopted choice"))
    autotune.adopt_msign_choice("cpu", torch.bfloat16, 7)
    c = msign_choice("cpu")
    assert (c.dtype, c.steps, c.source) == (torch.bfloat16, 7, "rank0")
    with pytest.raises(ValueError, match="steps=0"):
        autotune.adopt_msign_choice("cpu", torch.float32, 0)


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (16, 16), (3, 40, 12)])
def test_msign_same_bits_for_any_memory_layout_and_transpose_consistent(shape):
    """msign iterates on a fresh row-major copy of G's values, so a transposed (column-major) view of the same values
    gives bitwise the same result (DDP/FSDP and single-process runs must agree); a tall G (XᵀX form) matches the
    transpose of its wide transpose's msign (XXᵀ form) to rounding."""
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    col_major = G.mT.contiguous().mT  # same values, transposed memory layout
    assert not col_major.is_contiguous() or G.shape[-1] == 1
    for dtype in (torch.float32, torch.bfloat16):
        a = msign(G, steps=6, dtype=dtype)
        assert torch.equal(a, msign(col_major, steps=6, dtype=dtype))
        assert a.is_contiguous()
    torch.testing.assert_close(msign(G, steps=6), msign(G.mT.contiguous(), steps=6).mT, atol=2e-5, rtol=0)


@pytest.mark.parametrize("scale", [1e-40, 1e-30, 1e-23, 1e-21, 1e20, 1e37])
def test_msign_of_tiny_or_huge_inputs_is_accurate_not_nan(scale):
    """Hostile trial: a float32 sum of squares of ~1e-23 entries underflowed, the norm came out ~3× too small, the
    singular values started near 3 and the iteration diverged to NaN (plain Muon's momentum reaches that after ~1000
    steps of zero gradient); the power-of-two prescale before the norm keeps every scale accurate."""
    G = torch.randn(2, 24, 10, generator=torch.Generator().manual_seed(4))
    ref = msign_reference(G).float()
    out = msign(G * scale, steps=12)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-5 if scale >= 1e-38 else 1e-4, rtol=0)
    assert torch.isfinite(msign((G * scale).bfloat16())).all()


def test_muon_survives_a_long_run_of_zero_gradients():
    from weightgeom.optim import Muon

    p = torch.nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(1)))
    opt = Muon([p], lr=0.02)
    p.grad = torch.randn(16, 8)
    opt.step()
    for _ in range(1200):  # the momentum decays by 0.95 per step: below 1e-23 after ~1000
        p.grad = torch.zeros(16, 8)
        opt.step()
    assert torch.isfinite(p).all()


def test_gradient_through_a_batch_with_a_zero_matrix_is_finite():
    """Hostile trial: the zero matrix of a batch got a NaN gradient in float32 (0·inf in the normalisation)."""
    G = torch.randn(3, 20, 8, generator=torch.Generator().manual_seed(2))
    G[1] = 0
    G.requires_grad_(True)
    msign(G).sum().backward()
    assert torch.isfinite(G.grad).all() and torch.equal(G.grad[1], torch.zeros(20, 8))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["row_major", "transposed", "batched"])
def test_column_norms_equal_vector_norm(dtype, layout):
    """column_norms (the fast CPU reduction the retractions use) gives vector_norm's values, in ≥ float32."""
    from weightgeom.linalg import column_norms

    g = torch.Generator().manual_seed(0)
    X = torch.randn(3, 70, 40, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, 40, dtype=torch.float64)
    X = X[0] if layout == "row_major" else X[0].T.contiguous().T if layout == "transposed" else X
    X = X.to(dtype)
    want = torch.linalg.vector_norm(X.double(), dim=-2)
    got = column_norms(X)
    assert got.dtype == dtype
    assert got.shape == want.shape and column_norms(X, keepdim=True).shape == (*X.shape[:-2], 1, X.shape[-1])
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2 ** -8}[dtype]  # bf16: rounding the result
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=0)
    torch.testing.assert_close(column_norms(X, squared=True).double(), want.square(), rtol=3 * tol, atol=0)


def test_column_norms_edges():
    """A zero column has norm 0 and gradient 0 (not NaN); complex input gives the moduli's norms; a vector is
    refused by name."""
    from weightgeom.linalg import column_norms

    X = torch.tensor([[0.0, 3.0], [0.0, 4.0]], requires_grad=True)
    n = column_norms(X)
    n.sum().backward()
    assert n.tolist() == [0.0, 5.0] and torch.isfinite(X.grad).all() and X.grad[:, 0].tolist() == [0.0, 0.0]
    assert column_norms(torch.tensor([[3 + 4j], [0j]])).tolist() == [5.0]
    assert column_norms(torch.zeros(0, 3)).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="column_norms"):
        column_norms(torch.ones(3))


@pytest.mark.parametrize("scale", [1e-8, 1.0, 1e4])
def test_differentiable_msign_matches_inplace_in_float16(scale):
    """The differentiable path prescales like the in-place one: a float16 compute on tiny input stayed finite only
    in place (the power of two 2^26 overflowed float16 when applied after narrowing)."""
    G = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)) * scale
    a = msign(G.clone().requires_grad_(), dtype=torch.float16)
    b = msign(G, dtype=torch.float16)
    assert torch.isfinite(a).all() and torch.equal(a.detach(), b)


def test_msign_choice_cache_is_per_instruction_set_cap(fresh_choice, monkeypatch):
    """A process whose ISA is capped (ONEDNN_MAX_CPU_ISA=AVX2 on an AMX CPU: bf16 matmuls ~800x slower, measured)
    must not read the uncapped process's cached choice from disk: the cap is part of the key."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(autotune, "_measure", lambda device: autotune.MsignChoice(
        str(device), torch.float32 if os.environ.get("ONEDNN_MAX_CPU_ISA") else torch.bfloat16, 5, "benchmark"))
    assert msign_choice("cpu").dtype == torch.bfloat16
    autotune.clear_msign_choices()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    c = msign_choice("cpu")
    assert (c.dtype, c.source) == (torch.float32, "benchmark")
    assert len(list((fresh_choice / "msign").glob("cpu-*.json"))) == 2


@pytest.mark.parametrize("kind, cap, label", [
    ("AMX", "AVX2", "AVX2 (capped; CPU: AMX)"),
    ("AMX", "avx512_core", "AVX512 (capped; CPU: AMX)"),
    ("AMX", "AVX512_CORE_BF16", "AVX512-BF16 (capped; CPU: AMX)"),
    ("AMX", "AVX512_CORE_AMX", "AMX"),
    ("AMX", "ALL", "AMX"),
    ("AMX", "", "AMX"),
    ("AVX512-BF16", "SSE41", "AVX2 (capped; CPU: AVX512-BF16)"),
    ("AVX2", "AVX512_CORE_AMX", "AVX2"),  # a cap above the CPU changes nothing
    ("NEON", "AVX2", "NEON"),
])
def test_benchmark_cpu_kind_names_the_class_a_capped_process_runs_at(kind, cap, label, monkeypatch):
    """Every benchmark figure is labelled with the CPU kind; a process whose oneDNN is capped (AVX2 on an AMX CPU) runs
    bf16 at the cap's speed, so it must not be labelled AMX (it was: the capped run's table said "CPU AMX")."""
    from weightgeom.benchmarks._common import capped_kind, cpu_kind

    assert capped_kind(kind, cap) == label
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    uncapped = cpu_kind()
    if uncapped in ("AMX", "AVX512-BF16", "AVX512"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
        assert cpu_kind() == f"AVX2 (capped; CPU: {uncapped})"


@pytest.mark.cuda
def test_cuda_choice_takes_bf16_where_its_products_are_much_faster(monkeypatch, tmp_path):
    """The per-device choice measured on a GPU (fresh cache): where a 4096² bf16 product is ≥ 3× faster than a float32
    one (every GPU with bf16 tensor cores), the choice is bf16 (on an H200 a launch-bound probe had chosen float32)."""
    import time

    from weightgeom.linalg.autotune import clear_msign_choices, msign_choice

    def seconds(dt):
        X = torch.randn(4096, 4096, device="cuda", dtype=dt)
        for _ in range(3):
            X @ X
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            X @ X
        torch.cuda.synchronize()
        return time.perf_counter() - t

    monkeypatch.setenv("WEIGHTGEOM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("WEIGHTGEOM_MSIGN", raising=False)
    clear_msign_choices()
    try:
        choice = msign_choice("cuda")
    finally:
        clear_msign_choices()
    assert choice.source == "benchmark", choice.describe()
    if seconds(torch.float32) >= 3 * seconds(torch.bfloat16):
        assert choice.dtype == torch.bfloat16, choice.describe()


@pytest.mark.cuda
def test_cuda_msign_replayed_as_a_graph_equals_eager(monkeypatch):
    """On a GPU msign's no-grad path is replayed as a CUDA graph per signature: bitwise the eager result (graphs off),
    for a tall, a wide, a batched and a continued (start_step) call, on repeated calls with new values."""
    from weightgeom.linalg import graphs

    graphs.clear()
    g = torch.Generator().manual_seed(7)
    calls = [((96, 32), {}), ((32, 96), {"dtype": torch.bfloat16}), ((3, 64, 64), {"method": "muon"}),
             ((48, 80), {"steps": 8, "start_step": 3})]
    for shape, kw in calls:
        for _ in range(2):
            G = torch.randn(shape, generator=g).cuda()
            if kw.get("start_step"):
                G = msign(G, steps=kw["start_step"])  # a continued iteration starts from a normalised iterate
            replayed = msign(G, **kw)
            with monkeypatch.context() as m:
                m.setenv(graphs.ENV_VAR, "0")
                eager = msign(G, **kw)
            assert torch.equal(replayed, eager), (shape, kw)
    assert graphs._entries and all(e is not None for e in graphs._entries.values())
    graphs.clear()


# ---- the CPU bf16 normalisation kernel (msign's first pass) ---------------------------------------------------
_needs_linalg_kernel = pytest.mark.skipif(kernels.load_kernel("linalg") is None,
                                          reason="no C compiler for weightgeom.kernels")


@pytest.fixture(params=["torch", "kernel"])
def normalise_path(request, monkeypatch):
    """msign's bf16 normalisation by torch's passes or by the C kernel (every matrix size takes the kernel)."""
    import importlib

    ms = importlib.import_module("weightgeom.linalg.msign")  # the module (the package exports the function msign)

    if request.param == "kernel":
        if kernels.load_kernel("linalg") is None:
            pytest.skip("no C compiler for weightgeom.kernels")
        monkeypatch.setattr(ms, "NORMALISE_KERNEL_MIN", 1)
    else:
        monkeypatch.setattr(ms, "NORMALISE_KERNEL_MIN", 1 << 62)
    return request.param


# hostile and ordinary inputs: (name, G as a function of a generator)
_NORMALISE_CASES = {
    "gaussian": lambda g: torch.randn(300, 260, generator=g),
    "tiny 1e-40 (subnormal)": lambda g: 1e-40 * torch.randn(300, 260, generator=g),
    "tiny 1e-23": lambda g: 1e-23 * torch.randn(300, 260, generator=g),
    "huge 1e37": lambda g: 1e37 * torch.randn(300, 260, generator=g),
    "zero": lambda g: torch.zeros(300, 260),
    "one spike": lambda g: torch.zeros(300, 260).index_put_((torch.tensor([7]), torch.tensor([9])), torch.tensor(3.0)),
    "batch with a zero matrix": lambda g: (torch.randn(3, 200, 120, generator=g)
                                           * torch.tensor([1.0, 0.0, 5.0]).view(3, 1, 1)),
}


@pytest.mark.parametrize("case", sorted(_NORMALISE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_normalisation_kernel_matches_torchs_passes(case, dtype, normalise_path):
    """msign's input normalised to bf16 (G / (‖G‖_F·safety)): the C kernel (norm summed in double, one rounding)
    and torch's passes (power-of-two prescale, norm of the bf16 copy, a bf16 multiply) agree to one bf16 rounding of
    the result's largest entry, for hostile scales too; a zero matrix stays exactly zero, never NaN."""
    from weightgeom.linalg.msign import _normalise

    G = _NORMALISE_CASES[case](torch.Generator().manual_seed(9)).to(dtype)
    got = _normalise(G, 1.01, torch.bfloat16, inplace=True)
    ref = G.double() / (torch.linalg.vector_norm(G.double(), dim=(-2, -1), keepdim=True) * 1.01).clamp_min(1e-300)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    err = (got.double() - ref).abs().amax(dim=(-2, -1))
    top = ref.abs().amax(dim=(-2, -1))
    # the kernel rounds once (2⁻⁹ of an entry); torch's passes round the prescaled copy, the bf16 scale and the
    # product (measured up to 0.0059 of the largest entry)
    tol = 2.0**-8 if normalise_path == "kernel" else 2.0**-7
    assert (err <= tol * top).all(), (case, float((err / top.clamp_min(1e-300)).max()))


def test_bf16_normalisation_kernel_keeps_nan_and_inf_semantics(normalise_path):
    """An inf or NaN entry: NaN where it was, the rest of its matrix zero (the scale is 0), the batch's other
    matrices untouched — the same on both paths."""
    from weightgeom.linalg.msign import _normalise

    G = torch.randn(2, 300, 260, generator=torch.Generator().manual_seed(10))
    G[0, 3, 4] = float("inf")
    G[0, 5, 6] = float("nan")
    got = _normalise(G, 1.01, torch.bfloat16, inplace=True)
    assert got[0, 3, 4].isnan() and got[0, 5, 6].isnan()
    rest = got[0].clone()
    rest[3, 4] = rest[5, 6] = 0
    assert torch.equal(rest, torch.zeros_like(rest))
    assert torch.isfinite(got[1]).all() and float(got[1].abs().max()) > 0


@_needs_linalg_kernel
def test_bf16_normalisation_kernel_bits_do_not_depend_on_threads_or_layout():
    """The kernel's norm is summed over fixed ranges added in order: 1 and 2 threads give the same bits (DDP ranks
    and single-process runs agree); a transposed view normalises as its row-major copy."""
    from thread_counts import outputs_per_thread_count

    code = ("import torch, sys; from weightgeom.linalg.msign import _normalise; "
            "torch.set_num_threads(int(sys.argv[1]));"
            "G = torch.randn(1536, 768, generator=torch.Generator().manual_seed(11));"
            "print(int(_normalise(G, 1.01, torch.bfloat16, inplace=True).view(torch.int16).double().sum()))")
    one, two = outputs_per_thread_count(code)
    assert one == two
    from weightgeom.linalg.msign import _normalise

    G = torch.randn(768, 1536, generator=torch.Generator().manual_seed(12))
    assert torch.equal(_normalise(G.mT, 1.01, torch.bfloat16, inplace=True),
                       _normalise(G.mT.contiguous(), 1.01, torch.bfloat16, inplace=True))


@pytest.mark.parametrize("shape", [(300, 260), (260, 300), (2, 300, 260)], ids=str)
def test_bf16_msign_through_either_normalisation_is_orthogonal(shape, normalise_path):
    """The whole bf16 msign (default Polar Express steps) is as orthogonal through the kernel as through torch's
    passes: singular values within BF16_SV_TOL of 1 (well-conditioned input)."""
    G = well_conditioned(*shape, dtype=torch.float32)
    s = torch.linalg.svdvals(msign(G, dtype=torch.bfloat16).double())
    assert float((s - 1).abs().max()) < BF16_SV_TOL


@_needs_linalg_kernel
def test_bf16_normalisation_kernel_leaves_forward_ad_to_torch():
    """Hostile trial 3: a forward-mode dual tensor went through the C kernel, which reads the primal only — the
    tangent was silently dropped (None). Now such tensors take torch's passes: a tangent, or torch's own error."""
    import torch.autograd.forward_ad as fwAD

    G = torch.randn(300, 256, generator=torch.Generator().manual_seed(13))
    with fwAD.dual_level():
        try:
            out = msign(fwAD.make_dual(G, torch.randn_like(G)), dtype=torch.bfloat16)
        except NotImplementedError:  # torch's out= path has no forward-mode rule: loud, as for small matrices
            return
        assert fwAD.unpack_dual(out).tangent is not None


_GOOD = {"device": "cpu", "dtype": "float32", "steps": 5, "source": "benchmark", "step_seconds": {}, "errors": {},
         "products": "ieee", "product_seconds": {"ieee": 2.0}}
BAD_CACHE = {  # a cache file this module did not write: measured again, never a crash
    "unknown products": json.dumps({**_GOOD, "products": "ieee_fast"}),
    "products a list": json.dumps({**_GOOD, "products": ["ieee"]}),
    "dtype a list": json.dumps({**_GOOD, "dtype": ["float32"]}),
    "steps Infinity": json.dumps({**_GOOD, "steps": float("inf")}),  # int(inf): OverflowError escaped before
    "steps 1e400": '{"dtype": "float32", "steps": 1e400, "products": "ieee"}',
    "steps NaN": json.dumps({**_GOOD, "steps": float("nan")}),
    "steps 10**30": json.dumps({**_GOOD, "steps": 10**30}),
    "steps 2.5": json.dumps({**_GOOD, "steps": 2.5}),
    "steps true": json.dumps({**_GOOD, "steps": True}),
    "steps 0": json.dumps({**_GOOD, "steps": 0}),
    "figures a list": json.dumps({**_GOOD, "product_seconds": [1, 2]}),
    "figure a string": json.dumps({**_GOOD, "product_seconds": {"ieee": "fast"}}),
    "not JSON": "\x00\xff garbage",
    "a JSON list": "[1, 2]",
    "empty": "",
}


@pytest.mark.parametrize("text", BAD_CACHE.values(), ids=BAD_CACHE.keys())
def test_a_cache_file_it_did_not_write_is_measured_again(fresh_choice, monkeypatch, text):
    fake = autotune.MsignChoice("cpu", torch.float32, 6, "benchmark")
    monkeypatch.setattr(autotune, "_measure", lambda device: fake)
    path = autotune._cache_file(torch.device("cpu"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    c = msign_choice("cpu")
    assert (c.source, c.steps) == ("benchmark", 6)
    autotune.clear_msign_choices()
    assert msign_choice("cpu").source == "cache"  # rewritten by the measurement

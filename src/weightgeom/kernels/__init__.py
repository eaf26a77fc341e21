"""Small fused CPU kernels in C, compiled on first use with the system C compiler and loaded with ``ctypes``.

Why: some optimizer steps are a handful of memory-bound passes over every weight matrix (magnitude–direction over
Adam is nine of them in eager PyTorch). One C loop per pass reads each matrix once; PyTorch's eager ops cannot fuse
them, and ``torch.compile`` takes minutes to build the same loops on a small CPU. A kernel here compiles in under a
second and is cached on disk, keyed by its source, the compiler, the flags and the CPU, so it never runs on a machine
it was not built for.

Where no compiler works (or ``WEIGHTGEOM_NO_KERNELS=1``), ``load_kernel`` returns None and callers use their eager
PyTorch path: same maths, slower. ``unavailable_reason`` says why. The cache lives in ``$WEIGHTGEOM_CACHE_DIR`` or
``$XDG_CACHE_HOME/weightgeom`` (default ``~/.cache/weightgeom``), under ``kernels/``.

The kernels release the GIL (``ctypes.CDLL``) and use OpenMP with ``torch.get_num_threads()`` threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path

import torch

from weightgeom._cache import cache_root
from weightgeom._numerics_env import kernels_enabled

__all__ = ["load_kernel", "unavailable_reason", "uses_openmp", "md_adam_step", "md_split", "md_finish", "any_nonfinite",
           "kernel_cache_dir", "lanczos", "split_bf16_kernel", "column_sumsq", "symsum", "scaled_bf16",
           "bf16_with_column_sumsq", "normalise_bf16", "split_with_column_sumsq", "near_deviation",
           "near_correction"]

CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-std=c11", "-shared", "-fPIC")

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}
_reasons: dict[str, str] = {}
_flags: dict[str, tuple[str, ...]] = {}

_P, _L, _D, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_double, ctypes.c_int
_SIGNATURES = {
    "md_adam": {
        "md_adam_step_{t}": ([_L, _L, _P, _P, _P, _P, _P, _D, _D, _D, _D, _D, _D, _D, _I, _I, _I, _P, _P, _P, _P, _P,
                              _P, _P, _P, _D, _D, _D, _D, _D, _D, _I, _P, _I], _I),
        "any_nonfinite_{t}": ([_L, _P, _I], _I),
        "md_split_{t}": ([_L, _L, _P, _P, _P, _P, _P, _P, _P, _I], _I),
        "md_finish_{t}": ([_L, _L, _P, _P, _I, _P, _P, _P, _I], _I),
    },
    "linalg": {
        "lanczos_{t}": ([_L, _L, _P, _P, _D, _P, _P, _I], _I),
        "split_bf16_f32": ([_L, _P, _P, _P, _I], None),
        "scale_bf16_f32": ([_L, _P, ctypes.c_float, _P, _I], None),
        "split_colsumsq_f32": ([_L, _L, _P, _L, _P, _P, _P, _I], _I),
        "near_deviation_f32": ([_L, _P, _P, _P, _P, _P, _I], _I),
        "near_correction_f32": ([_L, _P, _P, _P, _P, _P, _P, _I], None),
        "normalise_bf16_f32": ([_L, _P, _P, _D, _D, _I], _D),
        "normalise_bf16_bf16": ([_L, _P, _P, _D, _D, _I], _D),
        "symsum_f32": ([_L, _P, _L, _P, _L, _D, _I, _I], None),
        "colsumsq_{t}": ([_L, _L, _P, _L, _I, _P, _I], None),
    },
}


def kernel_cache_dir() -> Path:
    """Where compiled kernels are kept (``$WEIGHTGEOM_CACHE_DIR``, else ``$XDG_CACHE_HOME/weightgeom``)."""
    return cache_root() / "kernels"


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return cc
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags (Linux), else the platform string."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.platform() + platform.processor()


def _build(name: str) -> tuple[ctypes.CDLL | None, str]:
    try:
        return _build_unchecked(name)
    except OSError as e:  # an unwritable cache, a full disk, ...: no kernel, say why
        return None, f"building {name}.c failed: {e}"


def _build_unchecked(name: str) -> tuple[ctypes.CDLL | None, str]:
    if not kernels_enabled():
        return None, "disabled by WEIGHTGEOM_NO_KERNELS"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install gcc)"
    source = resources.files("weightgeom.kernels").joinpath(f"{name}.c").read_text()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"C compiler {cc!r} does not run: {e}"
    errors = []
    # with OpenMP first; a compiler without it (Apple clang) still gets the single-threaded kernel
    for flags in (CFLAGS, tuple(f for f in CFLAGS if f != "-fopenmp")):
        target, error = _compile(name, source, cc, version, flags)
        if target is None:
            errors.append(error)
            continue
        try:
            lib = ctypes.CDLL(str(target))
            for fn, (argtypes, restype) in _SIGNATURES[name].items():
                for t in ("f32", "f64"):
                    f = getattr(lib, fn.format(t=t))
                    f.argtypes = argtypes
                    f.restype = restype
        except (OSError, AttributeError) as e:
            errors.append(f"loading {target} failed: {e}")
            continue
        _flags[name] = flags
        return lib, ""
    return None, errors[0]


def _compile(name: str, source: str, cc: str, version: str, flags: tuple[str, ...]) -> tuple[Path | None, str]:
    """The cached shared object for these flags, compiled if missing; (None, why) if the compiler fails."""
    key = hashlib.sha256("\0".join([source, version, " ".join(flags), _cpu_signature(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    target = kernel_cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target, ""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        out_dir = target.parent
    except OSError:
        out_dir = Path(tempfile.gettempdir())
        target = out_dir / target.name
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / f"{name}.c"
        src.write_text(source)
        built = Path(tmp) / f"{name}.so"
        try:
            proc = subprocess.run([cc, *flags, str(src), "-o", str(built)], capture_output=True, text=True,
                                  timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"compiling {name}.c with {cc!r} failed: {e}"
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["(no message)"])[0]
            return None, f"compiling {name}.c with {cc!r} failed: {first}"
        os.replace(built, target)  # atomic: concurrent builders (torchrun ranks) each install a whole file
    return target, ""


def load_kernel(name: str = "md_adam") -> ctypes.CDLL | None:
    """The compiled kernel library ``name`` (built on first call, then cached), or None where it cannot be had — also
    inside a ``torch.compile`` trace, which cannot follow a ``ctypes`` call: the callers then take their torch path."""
    if torch.compiler.is_compiling():
        return None
    with _lock:
        if name not in _libs:
            lib, reason = _build(name)
            _libs[name] = lib
            _reasons[name] = reason
        return _libs[name]


def uses_openmp(name: str = "md_adam") -> bool:
    """Whether the loaded kernel was built with OpenMP (threads) rather than single-threaded."""
    return load_kernel(name) is not None and "-fopenmp" in _flags.get(name, ())


def unavailable_reason(name: str = "md_adam") -> str:
    """Why ``load_kernel(name)`` returned None ("" when it did not, or was not called yet)."""
    return _reasons.get(name, "")


def _reset() -> None:
    """Forget loaded kernels (tests: rebuild under another environment)."""
    with _lock:
        _libs.clear()
        _reasons.clear()
        _flags.clear()


# ---------------------------------------------------------------------------------------------------------------------
# Typed entry points: argument checks, then one C call.
# ---------------------------------------------------------------------------------------------------------------------
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
PARAM_CODE = {"softplus": 0, "exp": 1}
SPHERE_CODE = {"frobenius": 0, "row": 1, "col": 2}


def _check(what: str, t: torch.Tensor | None, numel: int, dtype: torch.dtype) -> int:
    if t is None:
        return 0
    if t.device.type != "cpu" or t.dtype != dtype or t.numel() != numel or not t.is_contiguous():
        raise ValueError(f"md kernel: {what} must be a contiguous CPU {dtype} tensor of {numel} elements, got "
                         f"{t.device.type} {t.dtype} {tuple(t.shape)}{'' if t.is_contiguous() else ' non-contiguous'}")
    return t.data_ptr()


def md_adam_step(G: torch.Tensor, D: torch.Tensor, W: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 *, beta1: float, beta2: float, step_size: float, bc2_sqrt: float, eps: float, decay: float = 1.0,
                 l2: float = 0.0, gain_row: tuple | None = None, gain_col: tuple | None = None,
                 parameterization: str = "softplus", gain_lr: float = 0.0,
                 gain_betas: tuple[float, float] = (0.9, 0.95), gain_eps: float = 1e-8, sphere: str = "frobenius",
                 radius: torch.Tensor | None = None) -> None:
    """One whole MD step of one matrix over an Adam(W) base, in two passes (maths: ``md_adam.c``'s header).

    Everything is updated in place: Ŵ (``D``) and its Adam moments, the gains θ and their Adam moments, and the
    model's ``W`` = γ_r Ŵ γ_c. The float64 reference is tests/test_md_fused.py's ``fused_step_reference``.

    Args:
        G: ∂L/∂W, (m, n), float32 or float64, contiguous, CPU; D, W, exp_avg, exp_avg_sq: same layout.
        beta1, beta2, eps: the base Adam's hyperparameters; step_size: lr/(1 − β₁ᵗ); bc2_sqrt: sqrt(1 − β₂ᵗ).
        decay: AdamW's decoupled factor 1 − lr·wd (1: none); l2: Adam's coupled weight decay (0: none).
        gain_row: None or (θ_r, exp_avg, exp_avg_sq, step t after this step's increment, grad): θ_r of m elements
            (1 for a scalar gain); ∂L/∂θ_r is written into ``grad``. gain_col: None or the same for θ_c (n).
        parameterization: ``"softplus"`` or ``"exp"``.
        gain_lr, gain_betas, gain_eps: the gains' Adam.
        sphere: ``"frobenius"`` (radius of 1 element), ``"row"`` (m) or ``"col"`` (n); radius in D's dtype.

    Raises:
        RuntimeError: the kernel is unavailable (``unavailable_reason``) or out of memory.
        ValueError: a tensor of the wrong device, dtype, size or layout (named), or an unknown option.
    """
    lib = load_kernel("md_adam")
    if lib is None:
        raise RuntimeError(f"md kernel unavailable: {unavailable_reason('md_adam')}")
    dt = D.dtype
    if dt not in _SUFFIX or D.ndim != 2:
        raise ValueError(f"md kernel: D must be a 2-D float32/float64 tensor, got {dt} {tuple(D.shape)}")
    m, n = D.shape
    ptrs = [_check(w, t, m * n, dt) for w, t in (("G", G), ("D", D), ("W", W), ("exp_avg", exp_avg),
                                                  ("exp_avg_sq", exp_avg_sq))]
    gains = []
    for what, gain, k in (("gain_row", gain_row, m), ("gain_col", gain_col, n)):
        if gain is None:
            gains.append((0, [0, 0, 0, 0], 0.0))
            continue
        theta, ga, gv, t, grad = gain
        kind = 2 if (what == "gain_row" and theta.numel() == 1 and m != 1) else 1
        size = 1 if kind == 2 else k
        parts = (("", theta), (".exp_avg", ga), (".exp_avg_sq", gv), (".grad", grad))
        gains.append((kind, [_check(f"{what}{s}", x, size, dt) for s, x in parts], float(t)))
    if sphere not in SPHERE_CODE:
        raise ValueError(f"md kernel: sphere {sphere!r} is not supported ({list(SPHERE_CODE)})")
    if (gain_row is not None or gain_col is not None) and parameterization not in PARAM_CODE:
        raise ValueError(f"md kernel: parameterization {parameterization!r} is not supported ({list(PARAM_CODE)})")
    rad = _check("radius", radius, {"frobenius": 1, "row": m, "col": n}[sphere], dt)
    if not rad:
        raise ValueError("md kernel: radius is required")
    (kr, pr, tr), (kc, pc, tc) = gains
    failed = getattr(lib, f"md_adam_step_{_SUFFIX[dt]}")(
        m, n, *ptrs, float(beta1), float(beta2), float(step_size), float(bc2_sqrt), float(eps), float(decay),
        float(l2), kr, kc, PARAM_CODE.get(parameterization, 0), *pr, *pc, float(gain_lr), float(gain_betas[0]),
        float(gain_betas[1]), float(gain_eps), tr, tc, SPHERE_CODE[sphere], rad, torch.get_num_threads())
    if failed:
        raise RuntimeError(f"md kernel: out of memory for the buffers of a {m}×{n} matrix")


def _lib_and_shape(D: torch.Tensor) -> tuple[ctypes.CDLL, int, int]:
    lib = load_kernel("md_adam")
    if lib is None:
        raise RuntimeError(f"md kernel unavailable: {unavailable_reason('md_adam')}")
    if D.dtype not in _SUFFIX or D.ndim != 2:
        raise ValueError(f"md kernel: D must be a 2-D float32/float64 tensor, got {D.dtype} {tuple(D.shape)}")
    return lib, D.shape[0], D.shape[1]


def md_split(G: torch.Tensor, D: torch.Tensor, gain_row: torch.Tensor | None, gain_col: torch.Tensor | None,
             out: torch.Tensor, row_sums: bool, col_sums: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Ĝ = γ_r G γ_c into ``out`` and the log-gain gradient sums of Ŵ⊙Ĝ, in one pass (``md_functional.
    split_gradient_log``'s maths and operation order; sums in float64).

    Args:
        G: ∂L/∂W, (m, n) float32/float64, contiguous, CPU; D: Ŵ, same layout; out: Ĝ's storage, same layout.
        gain_row, gain_col: the effective gains γ_r (m elements) and γ_c (n), in D's dtype; None: 1.
        row_sums, col_sums: which sums to return.

    Returns:
        (s_r of m elements or None, s_c of n elements or None), float64.

    Raises:
        RuntimeError: the kernel is unavailable or out of memory. ValueError: a tensor of the wrong device, dtype,
        size or layout (named).
    """
    lib, m, n = _lib_and_shape(D)
    dt = D.dtype
    ptrs = [_check(w, t, k, dt) for w, t, k in (("G", G, m * n), ("D", D, m * n), ("gain_row", gain_row, m),
                                                ("gain_col", gain_col, n), ("out", out, m * n))]
    s_r = torch.empty(m, dtype=torch.float64) if row_sums else None
    s_c = torch.empty(n, dtype=torch.float64) if col_sums else None
    failed = getattr(lib, f"md_split_{_SUFFIX[dt]}")(m, n, *ptrs, s_r.data_ptr() if s_r is not None else 0,
                                                     s_c.data_ptr() if s_c is not None else 0, torch.get_num_threads())
    if failed:
        raise RuntimeError(f"md kernel: out of memory for the buffers of a {m}×{n} matrix")
    return s_r, s_c


def md_finish(D: torch.Tensor, W: torch.Tensor, sphere: str, radius: torch.Tensor, gain_row: torch.Tensor | None,
              gain_col: torch.Tensor | None) -> None:
    """Ŵ (``D``) back on its sphere and W = γ_r Ŵ γ_c, in place, in two passes (``md_functional.project_to_sphere_``
    then ``compose``; norms summed in float64).

    Args:
        D: Ŵ, (m, n) float32/float64, contiguous, CPU; W: the model's tensor, same layout.
        sphere: ``"frobenius"`` (radius of 1 element), ``"row"`` (m) or ``"col"`` (n); radius in D's dtype.
        gain_row, gain_col: the new effective gains (m and n elements, D's dtype); None: 1.

    Raises:
        RuntimeError: the kernel is unavailable or out of memory. ValueError: a tensor of the wrong device, dtype,
        size or layout (named), or an unknown sphere.
    """
    lib, m, n = _lib_and_shape(D)
    dt = D.dtype
    if sphere not in SPHERE_CODE:
        raise ValueError(f"md kernel: sphere {sphere!r} is not supported ({list(SPHERE_CODE)})")
    ptrs = [_check(w, t, k, dt) for w, t, k in (("D", D, m * n), ("W", W, m * n))]
    rad = _check("radius", radius, {"frobenius": 1, "row": m, "col": n}[sphere], dt)
    if not rad:
        raise ValueError("md kernel: radius is required")
    g = [_check(w, t, k, dt) for w, t, k in (("gain_row", gain_row, m), ("gain_col", gain_col, n))]
    failed = getattr(lib, f"md_finish_{_SUFFIX[dt]}")(m, n, *ptrs, SPHERE_CODE[sphere], rad, *g,
                                                      torch.get_num_threads())
    if failed:
        raise RuntimeError(f"md kernel: out of memory for the buffers of a {m}×{n} matrix")


def any_nonfinite(t: torch.Tensor) -> bool:
    """Whether a contiguous CPU float32/float64 tensor holds a NaN or Inf: one threaded streaming read in C (about
    2.5× faster than a torch norm on CPU, and exact where a norm would overflow).

    Raises:
        RuntimeError: the kernel is unavailable (``unavailable_reason``).
        ValueError: another device, dtype or layout.
    """
    lib = load_kernel("md_adam")
    if lib is None:
        raise RuntimeError(f"md kernel unavailable: {unavailable_reason('md_adam')}")
    if t.dtype not in _SUFFIX:
        raise ValueError(f"md kernel: any_nonfinite covers float32 and float64 tensors, got {t.dtype}")
    ptr = _check("tensor", t, t.numel(), t.dtype)
    if not ptr:
        return False
    return bool(getattr(lib, f"any_nonfinite_{_SUFFIX[t.dtype]}")(t.numel(), ptr, torch.get_num_threads()))


def lanczos(G: torch.Tensor, v: torch.Tensor, k: int, noise: float) -> torch.Tensor:
    """The Lanczos coefficients (2k float64: α₀…α_{k−1}, β₀…β_{k−2}, 0) of one symmetric n×n matrix G from the unit
    vector v (n), with full reorthogonalisation and the breakdown floor ``noise``·max‖G q_j‖ (maths: ``linalg.c``;
    the torch reference is ``weightgeom.optim.manifold_muon._lanczos_coefficients``).

    Raises:
        RuntimeError: the kernel is unavailable (``unavailable_reason("linalg")``) or out of memory.
        ValueError: G or v of the wrong device, dtype, size or layout.
    """
    lib = load_kernel("linalg")
    if lib is None:
        raise RuntimeError(f"linalg kernel unavailable: {unavailable_reason('linalg')}")
    if G.ndim != 2 or G.shape[0] != G.shape[1] or G.dtype not in _SUFFIX or int(k) < 1:
        raise ValueError(f"lanczos kernel: G must be a square float32/float64 matrix and k ≥ 1, got {G.dtype} "
                         f"{tuple(G.shape)}, k={k!r}")
    n = G.shape[0]
    _check("G", G, n * n, G.dtype)
    _check("v", v, n, G.dtype)
    k = int(k)
    coef = torch.zeros(2 * k, dtype=torch.float64)
    Q = torch.empty(k, n, dtype=G.dtype)
    failed = getattr(lib, f"lanczos_{_SUFFIX[G.dtype]}")(n, k, G.data_ptr(), v.data_ptr(), float(noise),
                                                        coef.data_ptr(), Q.data_ptr(), torch.get_num_threads())
    if failed:
        raise RuntimeError(f"lanczos kernel: out of memory for n={n}")
    return coef


def split_bf16_kernel(X: torch.Tensor, lo: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hi, lo) = (bf16(X clamped to ±bf16's largest finite value), bf16(X − hi)) of a contiguous CPU float32 tensor
    in one pass (``linalg.c``); the same bits as ``weightgeom.linalg.split.split_bf16``'s torch path except NaN's sign
    and payload (a NaN stays a NaN). ``lo=False``: (hi, None).

    Raises:
        RuntimeError: the kernel is unavailable. ValueError: X is not a contiguous CPU float32 tensor.
    """
    lib = load_kernel("linalg")
    if lib is None:
        raise RuntimeError(f"linalg kernel unavailable: {unavailable_reason('linalg')}")
    _check("X", X, X.numel(), torch.float32)
    hi = torch.empty(X.shape, dtype=torch.bfloat16)
    low = torch.empty(X.shape, dtype=torch.bfloat16) if lo else None
    lib.split_bf16_f32(X.numel(), X.data_ptr(), hi.data_ptr(), low.data_ptr() if lo else None,
                       torch.get_num_threads())
    return hi, low


def scaled_bf16(X: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """bf16(X·scale) of a contiguous CPU float32 (batch of) matrices (..., m, n) and a float32 scale of shape
    (..., 1, 1) (or one value for all), in one pass (``linalg.c``): torch's ``torch.mul(X, scale, out=<bf16>)``
    bits (but for NaN's sign and payload) at ~1/4 of its time. None where the kernel is unavailable or the
    arguments do not fit (callers then use torch)."""
    if X.device.type != "cpu" or X.dtype != torch.float32 or not X.is_contiguous() or X.ndim < 2 \
            or scale.device.type != "cpu" or scale.dtype != torch.float32 or scale.numel() == 0:
        return None
    lead = X.shape[:-2]
    if scale.numel() != 1 and tuple(scale.shape) != (*lead, 1, 1):
        return None
    lib = load_kernel("linalg")
    if lib is None:
        return None
    out = torch.empty(X.shape, dtype=torch.bfloat16)
    mats = X.reshape(-1, *X.shape[-2:])
    outs = out.view(-1, *X.shape[-2:])
    scales = scale.reshape(-1).expand(mats.shape[0]).tolist()  # host values: a CPU tensor, no device sync
    for x, o, s in zip(mats.unbind(0), outs.unbind(0), scales):
        lib.scale_bf16_f32(x.numel(), x.data_ptr(), s, o.data_ptr(), torch.get_num_threads())
    return out


def bf16_with_column_sumsq(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(X in bf16 — torch's ``X.to(torch.bfloat16)`` bits but for NaN's payload —, Σ_i X_ij² per column in float32,
    summed in double: ``column_sumsq``'s bits) of a 2-D row-major CPU float32 matrix in one read pass (``linalg.c``):
    a bf16 Gram's factor and its exact diagonal. None where the kernel is unavailable, X does not fit, or memory runs
    out (callers then use torch)."""
    out = _split_column_pass(X, lo=False)
    return None if out is None else (out[0], out[2])


def split_with_column_sumsq(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(hi, lo, Σ_i X_ij² per column) of a 2-D row-major CPU float32 matrix in one read pass (``linalg.c``):
    ``split_bf16_kernel``'s pieces and ``column_sumsq``'s sums, bit for bit (``column_norms``' for matrices of at
    least its kernel's 65536 entries; below, torch sums in float32). None where the kernel is unavailable, X
    does not fit, or memory runs out (callers then use the separate passes)."""
    return _split_column_pass(X, lo=True)


def _split_column_pass(X: torch.Tensor, lo: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """``linalg.c``'s split_colsumsq_f32 on X: (hi, lo or None, column sums), or None."""
    if X.ndim != 2 or X.device.type != "cpu" or X.dtype != torch.float32 or X.numel() == 0 or X.stride(1) != 1 \
            or X.stride(0) < X.shape[1]:
        return None
    lib = load_kernel("linalg")
    if lib is None:
        return None
    m, n = X.shape
    hi = torch.empty(m, n, dtype=torch.bfloat16)
    low = torch.empty(m, n, dtype=torch.bfloat16) if lo else None
    sums = torch.empty(n, dtype=torch.float32)
    if lib.split_colsumsq_f32(m, n, X.data_ptr(), X.stride(0), hi.data_ptr(), None if low is None else low.data_ptr(),
                              sums.data_ptr(), torch.get_num_threads()):
        return None
    return hi, low, sums


def normalise_bf16(X: torch.Tensor, safety: float, eps: float) -> torch.Tensor | None:
    """bf16(X / (‖X‖_F·safety + eps)) per matrix of a contiguous CPU float32 or bf16 (batch of) matrices, in two passes
    (``linalg.c``: the norm summed in double, independent of the thread count; the quotient rounded once), a new
    tensor; a zero matrix stays zero. None where the kernel is unavailable or X does not fit (callers use torch)."""
    if X.device.type != "cpu" or X.dtype not in (torch.float32, torch.bfloat16) or X.ndim < 2 \
            or not X.is_contiguous() or X.numel() == 0:
        return None
    lib = load_kernel("linalg")
    if lib is None:
        return None
    fn = lib.normalise_bf16_f32 if X.dtype == torch.float32 else lib.normalise_bf16_bf16
    out = torch.empty(X.shape, dtype=torch.bfloat16)
    per = X.shape[-2] * X.shape[-1]
    xp, op = X.data_ptr(), out.data_ptr()
    for b in range(X.numel() // per):
        fn(per, xp + b * per * X.element_size(), op + b * per * 2, float(safety), float(eps), torch.get_num_threads())
    return out


def column_sumsq(X: torch.Tensor) -> torch.Tensor | None:
    """Σ_i X_ij² per column of a 2-D CPU float32/float64 matrix stored row- or column-major (a transposed view), summed
    in double in one read pass (``linalg.c``), in X's dtype; None where the kernel is unavailable or X's layout is
    neither (callers then use torch)."""
    if X.ndim != 2 or X.device.type != "cpu" or X.dtype not in _SUFFIX or X.numel() == 0:
        return None
    m, n = X.shape
    if X.stride(1) == 1 and X.stride(0) >= n:
        colmajor, ld = 0, X.stride(0)
    elif X.stride(0) == 1 and X.stride(1) >= m:
        colmajor, ld = 1, X.stride(1)
    else:
        return None
    lib = load_kernel("linalg")
    if lib is None:
        return None
    out = torch.empty(n, dtype=X.dtype)
    getattr(lib, f"colsumsq_{_SUFFIX[X.dtype]}")(m, n, X.data_ptr(), ld, colmajor, out.data_ptr(),
                                                 torch.get_num_threads())
    return out


def symsum(S: torch.Tensor, out: torch.Tensor, alpha: float = 1.0, accumulate: bool = False) -> torch.Tensor | None:
    """out = alpha·(S + Sᵀ), or with ``accumulate`` out ← (out + alpha·S) + alpha·Sᵀ, for one square CPU float32
    matrix S with unit column stride and a row-major out of its shape and dtype that shares no memory with it
    (``linalg.c``: 8×8 blocks transposed in vector registers); torch's bits, but for accumulating with alpha ≠ 1 (torch
    rounds out + alpha·S as one multiply-add).
    Returns out, or None where the kernel is unavailable or the arguments do not fit (callers then use torch)."""
    if S.ndim != 2 or S.shape[0] != S.shape[1] or S.device.type != "cpu" or S.dtype != torch.float32 \
            or out.shape != S.shape or out.dtype != S.dtype or out.device.type != "cpu" or S.numel() == 0 \
            or S.stride(1) != 1 or out.stride(1) != 1 or S.stride(0) < S.shape[1] or out.stride(0) < S.shape[1] \
            or out.untyped_storage().data_ptr() == S.untyped_storage().data_ptr():
        return None
    lib = load_kernel("linalg")
    if lib is None:
        return None
    lib.symsum_f32(S.shape[0], S.data_ptr(), S.stride(0), out.data_ptr(), out.stride(0), float(alpha),
                   int(bool(accumulate)), torch.get_num_threads())
    torch.autograd.graph.increment_version(out)  # written behind torch's back: saved tensors and memo entries see it
    return out


def _square_f32(T: torch.Tensor | None, n: int) -> bool:
    """T is None or a contiguous CPU float32 n×n matrix."""
    return T is None or (T.shape == (n, n) and T.dtype == torch.float32 and T.device.type == "cpu"
                         and T.is_contiguous())


def _column_scales(s: torch.Tensor | None, n: int) -> torch.Tensor | None | bool:
    """n column scales as a contiguous CPU float32 vector (None stays None), or False where s is not that."""
    if s is None:
        return None
    s = s.reshape(-1)
    if s.shape != (n,) or s.dtype != torch.float32 or s.device.type != "cpu":
        return False
    return s.contiguous()


def near_deviation(G: torch.Tensor, s: torch.Tensor | None, inplace: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, float, float] | None:
    """(E, E_hi, ‖E‖_F, max row sum of |E|) for E = S⁻¹GS⁻¹ − I (s: (n,) or (1, n) column scales; None: E = G − I) of
    one contiguous CPU float32 n×n Gram matrix, in one pass (``linalg.c``): torch's ``G / (s.mT * s)`` bits, E_hi
    its clamped bf16 copy; the norms summed in double (independent of the thread count; torch's path sums them in
    float32: they only choose the series order); ``inplace``: E written into G. None where the kernel or the
    arguments do not fit."""
    if G.ndim != 2 or G.shape[0] != G.shape[1] or not _square_f32(G, G.shape[0]) or G.numel() == 0:
        return None
    n = G.shape[0]
    s, lib = _column_scales(s, n), load_kernel("linalg")
    if s is False or lib is None:
        return None
    E = G if inplace else torch.empty_like(G)
    E_hi = torch.empty(n, n, dtype=torch.bfloat16)
    stats = torch.empty(2, dtype=torch.float64)
    if lib.near_deviation_f32(n, G.data_ptr(), None if s is None else s.data_ptr(), E.data_ptr(), E_hi.data_ptr(),
                              stats.data_ptr(), torch.get_num_threads()):
        return None
    if E is G:
        torch.autograd.graph.increment_version(G)  # written behind torch's back
    fro, row = stats.tolist()
    return E, E_hi, fro, row


def near_correction(E: torch.Tensor, E2: torch.Tensor | None, E3: torch.Tensor | None, s: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(Bo, d) of F = (−E/2 (+ 3/8·E2 (− 5/16·E3)))·(s_j / s_i), one pass (``linalg.c``): d = diag(F) (1, n) float32,
    Bo = bf16(F) with a zero diagonal — torch's expressions' bits (``F = E * -0.5; F.add_(E2, alpha=0.375)``, ...,
    ``F * (s / s.mT)``, ``F.to(torch.bfloat16)``). None where the kernel or the arguments do not fit."""
    if E.ndim != 2 or E.shape[0] != E.shape[1] or E.numel() == 0:
        return None
    n = E.shape[0]
    s, lib = _column_scales(s, n), load_kernel("linalg")
    if not all(_square_f32(T, n) for T in (E, E2, E3)) or s is False or lib is None:
        return None
    Bo = torch.empty(n, n, dtype=torch.bfloat16)
    d = torch.empty(1, n, dtype=torch.float32)
    ptr = [None if T is None else T.data_ptr() for T in (E2, E3, s)]
    lib.near_correction_f32(n, E.data_ptr(), *ptr, Bo.data_ptr(), d.data_ptr(), torch.get_num_threads())
    return Bo, d

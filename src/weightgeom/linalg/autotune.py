"""Per-device choice of msign's compute dtype and Polar Express step count, by a micro-benchmark at first use.

Why: a bf16 matmul is 2–4× faster than fp32 on a GPU or a CPU with bf16 units (AVX512-BF16, AMX) but 10–40×
slower on one without (AVX2, plain AVX512), so no fixed default dtype is right everywhere. The choice is made once
per device kind and cached on disk next to the compiled kernels (``weightgeom.kernels.kernel_cache_dir``'s parent,
``msign/``), keyed by the torch version, the device's name and the CPU's flags and thread count, and the instruction set
the process may use (ATen's CPU capability; the ISA caps ``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``, ...).

What is measured (well under a second on a 2-core CPU):

1. Accuracy, on a fixed probe matrix (128×384, singular values log-spaced in [1e-2, 1]): the orthogonality error
   e(D) = max |σᵢ/σ_max − 1| of the direction D after each Polar Express step, in each candidate dtype, and the same
   error of torch.optim.Muon's iteration (Keller Jordan's quintic, 5 steps, computed in float32 — at least as accurate
   as torch's bf16, so the bar is not lowered). Per dtype, ``steps`` is the fewest steps with e ≤ torch's.
2. Speed: the seconds of one polynomial step (3 matmuls) in each dtype, on a 192×768 matrix on a CPU and after
   warm-up calls on a 768×3072 one on a GPU (where a smaller step is launch-bound).

The dtype with the smallest ``steps × seconds per step`` wins; bf16 is only measured for accuracy where its step is
faster than fp32's.

3. On a CPU: manifold Muon's constraint products (``products``): IEEE float32 through torch's BLAS (``"ieee"``,
   MKL on x86), IEEE float32 through oneDNN (``"ieee_onednn"``, ``weightgeom.linalg.gemm``) or split-bf16
   (``"split_bf16"``, ``weightgeom.linalg.split``, where torch carries MKL's bf16→float32 gemm). A 768×1536·1536×768
   product XᵀA with A exactly bf16 (the commonest of them) is timed each way. oneDNN replaces torch's BLAS where it
   takes ≤ ``ONEDNN_WINS`` of its time (2-core AMD EPYC with AVX-512: ~0.5, MKL runs its AVX2 code on AMD CPUs; an
   Intel Xeon: ~1), and the split wins where it takes ≤ ``SPLIT_WINS`` of the faster IEEE time (2-core AMX Xeon:
   ~0.6; on CPUs without AMX a bf16 product is not enough faster). ``WEIGHTGEOM_PRODUCTS`` = ``ieee``,
   ``ieee_onednn`` or ``split_bf16`` forces one (where available, else ``ieee``); ``WEIGHTGEOM_SPLIT_PRODUCTS=1``
   (the older switch) uses the split wherever it is available, ``=0`` never (the IEEE kind is still measured).

``WEIGHTGEOM_MSIGN="float32"`` (or ``"bfloat16"``, ``"float64"``, optionally ``":STEPS"``, e.g.
``"bfloat16:6"``) forces a choice without measuring (tests use it; without ``:STEPS`` the preset's default, 10); the
constraint products are then measured alone, once per process and device, when a manifold group first asks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from weightgeom._cache import cache_root
from weightgeom._files import write_atomic
from weightgeom._numerics_env import MSIGN_VAR, PRODUCTS_VAR, SPLIT_VAR, msign_override, products_override
from weightgeom._numerics_env import PRODUCTS as _KINDS
from weightgeom.linalg.gemm import ieee_mm, onednn_available
from weightgeom.linalg.msign import MSIGN_PRESETS, default_dtype, msign
from weightgeom.linalg.precision import with_full_precision
from weightgeom.linalg.split import split_available, split_matmul

__all__ = ["MsignChoice", "msign_choice", "orthogonality_error", "ENV_VAR", "clear_msign_choices", "adopt_msign_choice",
           "adopted_msign_choice", "forced_msign_choice", "forced_products", "split_products_for", "products_for",
           "PRODUCTS", "PRODUCTS_ENV_VAR", "SPLIT_ENV_VAR", "SPLIT_WINS", "ONEDNN_WINS"]

ENV_VAR = MSIGN_VAR
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
_PROBE_SHAPE = (128, 384)
_SPEED_SHAPE = (192, 768)
# On a GPU a 192×768 step is launch-bound (~30 µs in any dtype) and its first calls in a dtype pay cuBLAS's lazy
# set-up, so the dtypes are compared on a GPT-2-sized matrix after warm-up calls: measured on an H200, the small shape
# with one warm-up call timed bf16 at 0.36 ms vs float32 0.11 ms and chose float32, which made our Muon 4× slower
# there (12 GPT-2-small layers: 41.9 ms vs 10.8 ms in bf16).
_SPEED_SHAPE_GPU = (768, 3072)
_GPU_WARMUP, _GPU_TIMED = 3, 5
_REFERENCE_STEPS = 5  # torch.optim.Muon's default ns_steps
# 2: the GPU speed shape and warm-up; 3: the constraint products; 4: oneDNN among them (older ones are measured again)
_CACHE_VERSION = 4
PRODUCTS = _KINDS
PRODUCTS_ENV_VAR = PRODUCTS_VAR
SPLIT_ENV_VAR = SPLIT_VAR
# oneDNN takes over the IEEE products where the probe takes at most this fraction of torch's BLAS time: a change of
# library changes the bits (not the accuracy), so only for a clear gain (AMD EPYC with AVX-512: 0.47–0.6).
ONEDNN_WINS = 0.8
# The split-bf16 constraint products are chosen where the probe product takes at most this fraction of its IEEE time:
# enough margin that the products with three pieces (the tangent projection) do not lose either.
SPLIT_WINS = 0.7
_SPLIT_PROBE = (1536, 768)
# Environment variables that cap the instruction set torch's CPU kernels use (oneDNN: the bf16 matmuls; MKL: the
# float32 ones): part of the disk cache's key.
_ISA_ENV_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")

_lock = threading.Lock()
_choices: dict[str, MsignChoice] = {}
# device -> (products, probe seconds), measured where WEIGHTGEOM_MSIGN forces the msign choice
_forced_products: dict[str, tuple[str, dict[str, float]]] = {}


@dataclass(frozen=True)
class MsignChoice:
    """The msign settings Muon uses on one device kind when the user sets neither ``msign_dtype`` nor ``ns_steps``.

    Attributes:
        device: device kind the choice is for (``"cpu"``, ``"cuda:0"``, ...).
        dtype: compute dtype.
        steps: Polar Express steps.
        source: ``"benchmark"`` (measured now), ``"cache"`` (measured earlier on this machine), ``"env"`` (forced by
            ``WEIGHTGEOM_MSIGN``), ``"rank0"`` (rank 0's choice, adopted by every rank of a distributed run) or
            ``"fallback"`` (measuring failed: msign's static default).
        step_seconds: measured seconds of one polynomial step per dtype name (192×768 matrix on a CPU, 768×3072 on
            a GPU).
        errors: orthogonality error of the probe direction per dtype name at the chosen steps, and ``"torch_muon"``
            (the bar).
        products: manifold Muon's constraint products on this device: ``"ieee"`` (float32, torch's BLAS),
            ``"ieee_onednn"`` (float32 through oneDNN, ``weightgeom.linalg.gemm``; CPUs only) or ``"split_bf16"``
            (``weightgeom.linalg.split``; CPUs only).
        product_seconds: the measured seconds of the probe product per kind (empty where not measured).
    """

    device: str
    dtype: torch.dtype
    steps: int
    source: str
    step_seconds: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    products: str = "ieee"
    product_seconds: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: dtype, steps, where the choice came from and the measured figures."""
        name = str(self.dtype).replace("torch.", "")
        parts = [f"{name}, {self.steps} Polar Express steps ({self.source})"]
        if self.step_seconds:
            parts.append("step " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in self.step_seconds.items()))
        if self.errors:
            parts.append("probe max|σ/σ_max − 1| " + ", ".join(f"{k} {v:.1e}" for k, v in self.errors.items()))
        prod = f"constraint products {self.products}"
        if self.product_seconds:
            prod += " (" + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in self.product_seconds.items()) + ")"
        parts.append(prod)
        return "; ".join(parts)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form (dtype as its name)."""
        d = asdict(self)
        d["dtype"] = str(self.dtype).replace("torch.", "")
        return d


def orthogonality_error(D: torch.Tensor) -> float:
    """max |σᵢ/σ_max − 1| over the min(m, n) singular values of the 2-D matrix D (0 for a semi-orthogonal D;
    scale-free). Computed in float64 from the eigenvalues of the smaller Gram matrix."""
    X = D.double()
    X = X if X.shape[-2] <= X.shape[-1] else X.mT
    S = torch.linalg.eigvalsh(X @ X.mT).clamp_min(0).sqrt()
    return float((S / S.max().clamp_min(1e-300)).sub(1).abs().max())


def _memo_key(device: torch.device) -> str:
    """In-process key of a choice: the device, and on a CPU the thread count (as the disk cache's key), so a process
    that changes ``torch.set_num_threads`` looks again instead of reusing another thread count's choice."""
    return f"{device}|threads={torch.get_num_threads()}" if device.type == "cpu" else str(device)


def adopt_msign_choice(device: torch.device | str, dtype: torch.dtype, steps: int,
                       products: str = "ieee", source: str = "rank0") -> MsignChoice:
    """Use (``dtype``, ``steps``, ``products``) for ``device`` in this process from now on, e.g. rank 0's choice
    broadcast to every rank so a distributed run computes every matrix's msign and constraint products alike
    (``weightgeom.train.distributed``). ``products`` ``"split_bf16"`` or ``"ieee_onednn"`` falls back to ``"ieee"``
    where it is not available in this process. ``source`` is the choice's :attr:`MsignChoice.source`."""
    device = torch.device(device)
    if dtype not in _DTYPES.values() or int(steps) < 1 or products not in PRODUCTS:
        raise ValueError(f"adopt_msign_choice: dtype={dtype} steps={steps!r} products={products!r} is invalid")
    if not _products_available(products, device):
        products = "ieee"
    choice = MsignChoice(str(device), dtype, int(steps), source, products=products)
    with _lock:
        _choices[_memo_key(device)] = choice
    return choice


@contextlib.contextmanager
def adopted_msign_choice(device: torch.device | str, dtype: torch.dtype, steps: int, products: str = "ieee",
                         source: str = "run") -> Iterator[MsignChoice]:
    """:func:`adopt_msign_choice` inside the block (a resumed run keeps its first session's choice); the choice this
    process had for ``device`` before comes back after it."""
    key = _memo_key(torch.device(device))
    with _lock:
        before = _choices.get(key)
    choice = adopt_msign_choice(device, dtype, steps, products, source)
    try:
        yield choice
    finally:
        with _lock:
            if before is None:
                _choices.pop(key, None)
            else:
                _choices[key] = before


def _products_available(products: str, device: torch.device) -> bool:
    if products == "split_bf16":
        return split_available(device)
    if products == "ieee_onednn":
        return onednn_available(device)
    return True


def clear_msign_choices() -> None:
    """Forget the choices made in this process (the disk cache stays); the next ``msign_choice`` looks again."""
    with _lock:
        _choices.clear()
        _forced_products.clear()


def forced_msign_choice(device: torch.device | str) -> MsignChoice | None:
    """The choice ``WEIGHTGEOM_MSIGN`` forces on ``device`` (``source`` ``"env"``), or None when it is unset or auto.

    Raises:
        ValueError: an invalid value, naming the variable.
    """
    return _forced(torch.device(device))


def _forced(device: torch.device) -> MsignChoice | None:
    forced = msign_override()
    if forced is None:
        return None
    name, steps = forced
    return MsignChoice(str(device), _DTYPES[name], steps or MSIGN_PRESETS["polar_express"].steps, "env")


def _device_key(device: torch.device) -> str:
    parts = [torch.__version__, str(device), f"v{_CACHE_VERSION}"]
    if device.type == "cuda":
        parts.append(torch.cuda.get_device_name(device))
    else:
        parts.append(str(torch.get_num_threads()))
        # what this process may use, not only what the CPU has: ATen's vector width and the ISA caps a user (or a
        # container) sets for oneDNN and MKL — an AVX2-capped process on an AMX CPU has AVX2's bf16 speed
        parts.append(str(torch.backends.cpu.get_cpu_capability()))
        parts += [f"{k}={os.environ.get(k, '')}" for k in _ISA_ENV_VARS]
        try:
            with open("/proc/cpuinfo") as f:
                parts += sorted({ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags"))})
        except OSError:
            parts.append(str(torch.backends.cpu.get_cpu_capability()))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def _cache_file(device: torch.device) -> Path:
    return cache_root() / "msign" / f"{device.type}-{_device_key(device)}.json"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_seconds(dtype: torch.dtype, device: torch.device, budget: float) -> float:
    """Median seconds of one polynomial step (XXᵀ, then two fused multiply-adds). CPU: a 192×768 matrix, at most 3
    timed calls, fewer once ``budget`` seconds are spent (bf16 may be very slow there). GPU: a 768×3072 matrix,
    ``_GPU_WARMUP`` untimed calls, then ``_GPU_TIMED`` timed ones (a few milliseconds in all)."""
    gpu = device.type != "cpu"
    g = torch.Generator().manual_seed(0)
    shape = _SPEED_SHAPE_GPU if gpu else _SPEED_SHAPE
    X = (torch.randn(*shape, generator=g) / math.sqrt(shape[1])).to(device=device, dtype=dtype)
    a, b, c = MSIGN_PRESETS["polar_express"].coeffs[3]
    times = []
    start = time.perf_counter()
    for i in range(_GPU_WARMUP + _GPU_TIMED if gpu else 3):
        _sync(device)
        t = time.perf_counter()
        A = X @ X.mT
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        torch.addmm(X, B, X, beta=a)
        _sync(device)
        if not gpu:
            times.append(time.perf_counter() - t)
            if time.perf_counter() - start > budget:
                break
        elif i >= _GPU_WARMUP:
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def _probe(device: torch.device) -> torch.Tensor:
    """128×384 matrix with singular values log-spaced in [1e-2, 1] and random singular vectors (fixed seed)."""
    g = torch.Generator().manual_seed(1234)
    m, n = _PROBE_SHAPE
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, m, generator=g, dtype=torch.float64))
    S = torch.logspace(-2, 0, m, dtype=torch.float64)
    return ((U * S) @ V.mT).float().to(device)


def _steps_to_reach(P: torch.Tensor, dtype: torch.dtype, max_steps: int, bar: float) -> tuple[int, float] | None:
    """Fewest Polar Express steps (≤ max_steps) whose direction has orthogonality error ≤ bar, and that error; None
    if none does. The iteration is continued step by step (``start_step``), so it costs max_steps steps at most."""
    X = P
    for k in range(max_steps):
        X = msign(X, steps=k + 1, start_step=k, dtype=dtype) if k else msign(P, steps=1, dtype=dtype)
        if k >= 2:  # the first steps only lift the small singular values; never within the bar
            e = orthogonality_error(X)
            if e <= bar:
                return k + 1, e
    return None


@with_full_precision  # the cached choice must not depend on the measuring process's float32 matmul mode
def _measure(device: torch.device) -> MsignChoice:
    max_steps = MSIGN_PRESETS["polar_express"].steps
    P = _probe(device)
    bar = orthogonality_error(msign(P, method="muon", steps=_REFERENCE_STEPS, dtype=torch.float32))
    candidates = [torch.float32, torch.bfloat16]
    seconds: dict[str, float] = {}
    for dt in candidates:
        seconds[str(dt).replace("torch.", "")] = _step_seconds(dt, device, budget=0.1)
    best: tuple[float, torch.dtype, int] | None = None
    errors: dict[str, float] = {"torch_muon": bar}
    for dt in candidates:
        name = str(dt).replace("torch.", "")
        if dt != torch.float32 and seconds[name] >= seconds["float32"]:
            continue  # slower per step and never fewer steps than fp32: cannot win, skip its accuracy probe
        reached = _steps_to_reach(P, dt, max_steps, bar)
        if reached is None:
            continue
        steps, errors[name] = reached
        cost = steps * seconds[name]
        if best is None or cost < best[0]:
            best = (cost, dt, steps)
    products, product_seconds = _measure_products(device)
    if best is None:  # no dtype reached the bar within the preset's steps: the static default, all steps
        return MsignChoice(str(device), default_dtype(device), max_steps, "fallback", seconds, errors, products,
                           product_seconds)
    return MsignChoice(str(device), best[1], best[2], "benchmark", seconds, errors, products, product_seconds)


@with_full_precision  # the IEEE side is timed at IEEE precision whatever the process's float32 matmul mode
def _measure_products(device: torch.device) -> tuple[str, dict[str, float]]:
    """(the constraint products' kind, the probe's seconds per kind measured): XᵀA for a 1536×768 X and an
    exactly-bf16 A, median of 5 calls after one warm-up each way (~50–100 ms on a 2-core CPU). Not a CPU, or neither
    oneDNN nor the split available: ("ieee", {})."""
    split, dnn = split_available(device), onednn_available(device)
    if device.type != "cpu" or not (split or dnn):
        return "ieee", {}
    g = torch.Generator().manual_seed(0)
    X = torch.randn(*_SPLIT_PROBE, generator=g)
    A = torch.randn(*_SPLIT_PROBE, generator=g).bfloat16()
    Af = A.float()

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return sorted(times)[2]

    def onednn() -> torch.Tensor:
        return ieee_mm(X.mT, Af, onednn=True)

    seconds = {"ieee": timed(lambda: X.mT @ Af)}
    if dnn:
        seconds["ieee_onednn"] = timed(onednn)
    if split:
        seconds["split_bf16"] = timed(lambda: split_matmul(X.mT, (A, None)))
    return _pick_products(seconds), seconds


def _pick_products(seconds: dict[str, float]) -> str:
    """The constraint products' kind from the probe's seconds per kind: oneDNN over torch's BLAS where it takes
    ≤ ``ONEDNN_WINS`` of its time, then the split over the faster IEEE kind where it takes ≤ ``SPLIT_WINS`` of it."""
    ieee = "ieee"
    if "ieee_onednn" in seconds and seconds["ieee_onednn"] <= ONEDNN_WINS * seconds["ieee"]:
        ieee = "ieee_onednn"
    if "split_bf16" in seconds and seconds["split_bf16"] <= SPLIT_WINS * seconds[ieee]:
        return "split_bf16"
    return ieee


def _products_env() -> str | None:
    """The constraint products forced by the environment (``WEIGHTGEOM_PRODUCTS``, then the older
    ``WEIGHTGEOM_SPLIT_PRODUCTS=1``), "no-split" for ``WEIGHTGEOM_SPLIT_PRODUCTS=0``, or None (measure); an invalid
    value raises ValueError naming the variable."""
    forced = products_override()
    return None if forced is None else forced[1]


def forced_products(device: torch.device | str) -> tuple[str, str] | None:
    """(``"VARIABLE=value"``, the kind it gives on ``device``) where the environment forces manifold Muon's
    constraint products there: one of ``PRODUCTS`` (``"ieee"`` where the forced kind is not available), or
    ``"no-split"`` for ``WEIGHTGEOM_SPLIT_PRODUCTS=0`` (any kind but the split). None when nothing is forced, or on a
    GPU (always ``"ieee"``).

    Raises:
        ValueError: an invalid value, naming the variable.
    """
    device = torch.device(device)
    forced = products_override()
    if forced is None or device.type != "cpu":
        return None
    var, kind = forced
    if kind != "no-split" and not _products_available(kind, device):
        kind = "ieee"
    return var, kind


def products_for(device: torch.device | str) -> str:
    """Manifold Muon's constraint products on ``device`` (one of ``PRODUCTS``): ``WEIGHTGEOM_PRODUCTS`` when set (a
    kind not available here gives ``"ieee"``), ``WEIGHTGEOM_SPLIT_PRODUCTS`` = 1 (the split wherever available) or 0
    (the measured IEEE kind), else the device's measured choice (``msign_choice(device).products``). Always
    ``"ieee"`` on a GPU."""
    device = torch.device(device)
    forced = _products_env()
    if device.type != "cpu":
        return "ieee"
    if forced is not None and forced != "no-split":
        return forced if _products_available(forced, device) else "ieee"
    choice = msign_choice(device)
    products, seconds = choice.products, choice.product_seconds
    key = _memo_key(device)
    with _lock:
        kept = _choices.get(key)  # a choice made or adopted in this process (rank 0's, a resumed run's)
    if choice.source == "env" and kept is not None:  # msign forced: the products still those of that choice
        products, seconds = kept.products, kept.product_seconds
    elif choice.source == "env":  # msign forced without measuring: the products are measured on their own, once
        with _lock:
            if key not in _forced_products:
                with torch.no_grad():
                    _forced_products[key] = _measure_products(device)
            products, seconds = _forced_products[key]
    if forced == "no-split" and products == "split_bf16":
        products = _pick_products({k: v for k, v in seconds.items() if k != "split_bf16"}) if "ieee" in seconds \
            else "ieee"
    return products if _products_available(products, device) else "ieee"


def split_products_for(device: torch.device | str) -> bool:
    """Whether manifold Muon's constraint products on ``device`` run split-bf16 (``products_for(device) ==
    "split_bf16"``)."""
    return products_for(device) == "split_bf16"


# A cached step count above this is not one this module wrote (Polar Express presets have ≤ 10): measured again.
_MAX_CACHED_STEPS = 100


def _load(path: Path, device: torch.device) -> MsignChoice | None:
    """The choice cached at ``path``, or None (measure again) for a missing, unreadable or malformed file: a dtype,
    products kind or step count this module would not write (steps an integer in [1, 100]), non-finite figures."""
    try:
        d = json.loads(path.read_text())
        steps = d.get("steps")
        if d.get("dtype") not in _DTYPES or isinstance(steps, bool) or not isinstance(steps, (int, float)) \
                or not (math.isfinite(steps) and steps == int(steps) and 1 <= steps <= _MAX_CACHED_STEPS):
            return None
        products = d.get("products", "ieee")
        if not isinstance(products, str) or products not in PRODUCTS:
            return None

        def figures(key: str) -> dict[str, float]:
            return {str(k): float(v) for k, v in d.get(key, {}).items() if math.isfinite(float(v))}

        return MsignChoice(str(device), _DTYPES[d["dtype"]], int(steps), "cache", figures("step_seconds"),
                           figures("errors"), products, figures("product_seconds"))
    except (OSError, ValueError, TypeError, AttributeError, OverflowError):
        return None


def _save(path: Path, choice: MsignChoice) -> None:
    try:
        write_atomic(path, json.dumps(choice.as_dict(), indent=1), fsync=False)
    except OSError:
        pass  # an unwritable cache: measure again next process


def msign_choice(device: torch.device | str = "cpu") -> MsignChoice:
    """The msign dtype and Polar Express step count for ``device``: forced by ``WEIGHTGEOM_MSIGN``, else cached in
    this process, else read from the disk cache, else measured now (see the module docstring) and cached.

    Args:
        device: the device msign runs on.

    Returns:
        The choice; never raises for a failed measurement (falls back to msign's static default, 10 steps).

    Raises:
        ValueError: ``WEIGHTGEOM_MSIGN`` holds something other than auto / a dtype name [:steps].
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    forced = _forced(device)
    if forced is not None:
        return forced
    key = _memo_key(device)
    with _lock:
        if key in _choices:
            return _choices[key]
        path = _cache_file(device)
        with _file_lock(path):  # processes starting together (torchrun ranks) share one measurement
            choice = _load(path, device)
            if choice is None:
                try:
                    with torch.no_grad():
                        choice = _measure(device)
                except (RuntimeError, torch.linalg.LinAlgError) as e:  # an unsupported dtype on this device, ...
                    choice = MsignChoice(str(device), default_dtype(device), MSIGN_PRESETS["polar_express"].steps,
                                         f"fallback ({str(e).splitlines()[0][:80]})")
                if choice.source == "benchmark":
                    _save(path, choice)
        _choices[key] = choice
        return choice


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive ``flock`` on ``path``'s ``.lock`` sibling while held; nothing (measure unlocked) where the cache
    directory cannot be written or the platform has no ``fcntl``."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 -- closed below
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
    finally:
        f.close()

"""Optimizer step time on GPT-2-small block shapes: torch.optim.Muon, our Muon, manifold Muon, AdamW; msign GFLOP/s.

One layer's matrices (attn.c_attn 2304×768, attn.c_proj 768×768, mlp.c_fc 3072×768, mlp.c_proj 768×3072; the
ratios do not depend on the number of layers). Every optimizer sees the same sequence of random gradients; steps are
interleaved round-robin so machine-load drift hits all alike; the median step time is reported. Manifold Muon keeps
its warm-started multiplier across steps (the warm-up steps build it), and its per-step stats (dual iterations,
tangent residual) are reported next to the time.

Targets: our Muon ≤ torch.optim.Muon's step at equal or better orthogonality of the update (max |σ/σ_max − 1|)
on every machine, ≤ 1/20 of it on a CPU without bf16 units (AVX2, plain AVX512: bf16 Newton–Schulz is emulated there;
every figure is printed with the CPU kind); manifold Muon ≤ 2.5× our Muon at tangent residual ≤ 1e-4; msign ≥ 85% of a
plain matmul's GFLOP/s. Our Muon's msign dtype and step count are the per-device choice
(``weightgeom.linalg.msign_choice``), printed in the header.

torch.optim.Muon and our bf16 row are timed in their own table (``--peer-shapes``, next to our default Muon on the
same matrices): on a CPU without bf16 units one step of theirs on one layer takes over a minute. ``--quick`` runs
every table on the 768×768 matrix only, one step, and skips the paper-dual rows and our bf16 row (it says so).

Usage::

    python -m weightgeom.benchmarks.optimizer_step --quick  # ≤ 3 min on 2 CPU cores: one 768×768 matrix, 1 step
    python -m weightgeom.benchmarks.optimizer_step --iters 5 --json optimizer_step.json
    python -m weightgeom.benchmarks.optimizer_step --device cuda --iters 20
    weightgeom bench optimizer_step --quick
"""

from __future__ import annotations

import json
import statistics
import sys
import warnings
from pathlib import Path

import torch

from weightgeom._cli_args import OneLineParser, nonneg_int, positive_int
from weightgeom._files import distinct_outputs, write_atomic
from weightgeom._paths import unwritable_reason
from weightgeom.benchmarks._common import (
    GPT2_SMALL_SHAPES,
    bench_command,
    hardware_tag,
    interleaved_medians,
    machine_info,
    matmul_gflops,
    steady_allocator,
    write_markdown,
)
from weightgeom.linalg import msign, msign_choice, orthogonality_error
from weightgeom.optim import DualAscent, Muon, compile_step
from weightgeom.optim.compiled import WARM_CALLS
from weightgeom.optim.muon import FarRetractionWarning

# --layers at most this many (GPT-2-XL has 48; more would only take memory and time).
MAX_LAYERS = 96
TARGET_MUON_VS_TORCH = 1 / 20
TARGET_MANIFOLD_VS_MUON = 2.5
TARGET_MSIGN_VS_MATMUL = 0.85
TOL = 1e-4
# The rows the manifold target applies to (the library's defaults); the other manifold rows are for comparison.
TARGET_ROWS = ("stiefel (default)", "dgram (default)")
# --quick: every table on the smallest of the layer's four matrices; our bf16 row and the paper-dual rows skipped.
QUICK_SHAPES = ("attn.c_proj",)
QUICK_PEER_SHAPES = ("attn.c_proj",)
_SLOW_DUAL = "≈ 10–20× our Muon on a CPU"
QUICK_SKIPPED = {"stiefel (paper dual)": _SLOW_DUAL, "dgram (paper dual)": _SLOW_DUAL,
                 "stiefel (fast dual+proj)": "a comparison row", "dgram (fast dual+proj)": "a comparison row",
                 "muon (ours, muon preset bf16)": "as slow as torch.optim.Muon on a CPU without bf16 units"}
# Rows computing in bf16 on the CPU: timed on the peer shapes (fewer under --quick), next to our default Muon.
PEER_ROWS = ("torch.optim.Muon", "muon (ours, muon preset bf16)")

# name -> (factory kind, kwargs). "default": the library's manifold defaults (one dual iteration from the predicted
# multiplier, msign in the per-device dtype and step count like our Muon, then the float32 tangent projection rescaled
# to unit spectral norm); "fp32 msign": the same in float32 throughout (what a CPU without bf16 units runs);
# "paper dual": the manifold-assignment paper's dual settings (K = 20, α = 0.1 linear, 10-step float32 msign, no
# projection: the dual ascent itself must reach the tolerance) with G normalised and Λ warm-started;
# "fast dual+proj": 4 dual steps with a 5-step msign inside the loop + one accurate final msign, α = 0.3 constant,
# then the projection (the dual residual before projection is reported too).
# "fp32 msign" rows keep the per-device choice's step count (an explicit msign_dtype alone would take the preset's 10)
_CHOICE_STEPS = "choice"
_PAPER_DUAL = {"dual": DualAscent(tol=TOL, steps=20, lr=0.1, schedule="linear", project=False), "ns_steps": 10}
_FAST_DUAL = {"dual": DualAscent(tol=TOL, steps=4, ns_steps=5, lr=0.3, schedule="constant", project=True)}
CONFIGS: dict[str, tuple[str, dict]] = {
    "torch.optim.Muon": ("torch_muon", {}),
    "muon (ours, default)": ("ours", {}),
    "muon (ours, muon preset fp32)": ("ours", {"msign_method": "muon"}),
    "muon (ours, muon preset bf16)": ("ours", {"msign_method": "muon", "msign_dtype": torch.bfloat16}),
    "stiefel (default)": ("ours", {"manifold": "stiefel"}),
    "dgram (default)": ("ours", {"manifold": "dgram"}),
    "stiefel (default, fp32 msign)": ("ours", {"manifold": "stiefel", "msign_dtype": torch.float32,
                                               "ns_steps": _CHOICE_STEPS}),
    "dgram (default, fp32 msign)": ("ours", {"manifold": "dgram", "msign_dtype": torch.float32,
                                             "ns_steps": _CHOICE_STEPS}),
    "stiefel (paper dual)": ("ours", {"manifold": "stiefel", **_PAPER_DUAL}),
    "dgram (paper dual)": ("ours", {"manifold": "dgram", **_PAPER_DUAL}),
    "stiefel (fast dual+proj)": ("ours", {"manifold": "stiefel", **_FAST_DUAL}),
    "dgram (fast dual+proj)": ("ours", {"manifold": "dgram", **_FAST_DUAL}),
    "adamw (torch, foreach)": ("torch_adamw", {}),
    "adamw (ours)": ("ours", {"algorithm": "adamw", "lr": 1e-3}),
}

COMPILED_ROWS: dict[str, tuple[str, dict]] = {
    "muon (ours, default, compiled)": ("ours_compiled", {"on_nonfinite": "skip"}),
    "stiefel (default, compiled)": ("ours_compiled", {"manifold": "stiefel", "on_nonfinite": "skip"}),
    "dgram (default, compiled)": ("ours_compiled", {"manifold": "dgram", "on_nonfinite": "skip"}),
}
"""The rows ``--compiled`` adds: the same optimizers stepped through ``weightgeom.optim.compile_step`` (one
``torch.compile(fullgraph=True)`` graph per step; CUDA graphs on CUDA), compiled before the timing starts."""


def build(kind: str, kw: dict, params: list[torch.nn.Parameter], names: list[str]) -> torch.optim.Optimizer:
    """The optimizer of one CONFIGS row over ``params``."""
    if kind == "torch_muon":
        return torch.optim.Muon(params, lr=0.02, weight_decay=0.0)
    if kind == "torch_adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, foreach=True)
    kind = "ours" if kind == "ours_compiled" else kind
    if kw.get("ns_steps") == _CHOICE_STEPS:
        kw = {**kw, "ns_steps": msign_choice(params[0].device).steps}
    return Muon([{"params": params, "names": names}], **{"lr": 0.02, **kw})


def stepper_of(kind: str, opt: torch.optim.Optimizer):
    """The step function a row is timed with: ``opt.step``, or for a compiled row ``compile_step(opt)``."""
    if kind != "ours_compiled":
        return opt.step

    return compile_step(opt)


def msign_flops(m: int, n: int, steps: int) -> float:
    """Flops of a ``steps``-step msign on an m×n matrix (wide orientation r×c, r = min): 4r²c + 2r³ per step."""
    r, c = min(m, n), max(m, n)
    return steps * (4.0 * r * r * c + 2.0 * r**3)


def run_rows(rows: dict[str, tuple[str, dict]], shapes: list[tuple[str, tuple[int, int]]], iters: int, warmup: int,
             dev: str, seed: int = 0, cpu_seconds: dict[str, float] | None = None, layers: int = 1,
             progress: str | None = None) -> tuple[dict[str, float], dict[str, list], dict[str, float]]:
    """Time the optimizers of ``rows`` on one matrix per shape and layer (``layers`` copies of the shapes, as
    transformer.h.{i}; same random gradients for all, interleaved steps).

    Returns:
        (median seconds per step, per-step ``last_stats`` lists, orthogonality error of each optimizer's first
        update ΔW = W₁ − W₀ (max over matrices; weight decay is 0, so ΔW ∝ the direction)).
    """
    g = torch.Generator().manual_seed(seed)
    layer_shapes = [s for _ in range(layers) for _, s in shapes]
    init = [(0.02 * torch.randn(s, generator=g)).to(dev) for s in layer_shapes]
    n_steps = warmup + iters
    grads = [[(1e-3 * torch.randn(s, generator=g)).to(dev) for s in layer_shapes] for _ in range(n_steps)]
    names = [f"transformer.h.{i}.{k}.weight" for i in range(layers) for k, _ in shapes]
    opts, params, counters, stats, deltas, steps = {}, {}, {}, {}, {}, {}
    for key, (kind, kw) in rows.items():
        ps = [torch.nn.Parameter(w.clone()) for w in init]
        params[key], opts[key], counters[key], stats[key] = ps, build(kind, kw, ps, names), [0], []
        steps[key] = stepper_of(kind, opts[key])

    def stepper(key: str):
        def run() -> None:
            i = counters[key][0] % n_steps
            for p, gr in zip(params[key], grads[i]):
                p.grad = gr
            first = counters[key][0] == 0
            before = [p.detach().clone() for p in params[key]] if first else None
            steps[key]()
            if first:  # ΔW kept; its SVD is taken after the timing
                deltas[key] = [p.detach() - b for p, b in zip(params[key], before)]
            counters[key][0] += 1
            st = getattr(opts[key], "last_stats", None)
            if st:
                stats[key].append(st)

        return run

    for key, (kind, _) in rows.items():  # a compiled row compiles before the timing, not in it
        if kind == "ours_compiled":
            for _ in range(WARM_CALLS):
                stepper(key)()
    times = interleaved_medians({k: stepper(k) for k in rows}, iters=iters, warmup=warmup, device=dev,
                                cpu_seconds=cpu_seconds, progress=progress)
    ortho = {k: max(orthogonality_error(d) for d in ds) for k, ds in deltas.items()}
    return times, stats, ortho


ORDER_STEPS = (5, 6, 8, 10)
"""Polar Express step counts the bf16 evaluation-order table compares (5–6: Muon's per-device choice on bf16 CPUs;
10: the published algorithm and the retractions)."""
ORDERS = {"ours (fused)": "polar_express", "published": "polar_express_paper"}
"""The two bf16 evaluations of the same Polar Express polynomial: ours (normalised in float32, X ← a·X + (b·S + c·S²)·X
as two fused multiply-adds) and the published one (normalised in bf16, X ← (a·I + (b·I + c·S)·S)·X)."""


def momentum_like(m: int, n: int, g: torch.Generator) -> torch.Tensor:
    """A gradient-momentum-like test matrix: random singular vectors, singular values i^−½ (a heavy top, a long
    tail), scaled to 1e-3."""
    k = min(m, n)
    U = torch.linalg.qr(torch.randn(m, k, generator=g))[0]
    V = torch.linalg.qr(torch.randn(n, k, generator=g))[0]
    return 1e-3 * (U * torch.arange(1, k + 1, dtype=torch.float32) ** -0.5) @ V.T


def evaluation_orders(shapes: list[tuple[str, tuple[int, int]]], dev: str, tag: str, default_steps: int,
                      reps: int) -> dict:
    """Print and return the bf16 orthogonality error max|σ/σ_max − 1| (worst over the shapes, momentum-like inputs)
    of each evaluation order after each of ``ORDER_STEPS`` steps, and its time per call at ``default_steps``."""
    g = torch.Generator().manual_seed(3)
    inputs = {name: momentum_like(m, n, g).to(dev) for name, (m, n) in shapes}
    errors: dict[str, dict[int, float]] = {o: {} for o in ORDERS}
    seconds: dict[str, float] = {}
    counts = sorted({*ORDER_STEPS, default_steps})
    for label, method in ORDERS.items():
        for k in counts:
            errors[label][k] = max(orthogonality_error(msign(G, method=method, steps=k, dtype=torch.bfloat16))
                                   for G in inputs.values())
        t = interleaved_medians({n: lambda G=G, method=method: msign(G, method=method, steps=default_steps,
                                                                     dtype=torch.bfloat16)
                                 for n, G in inputs.items()}, iters=reps, warmup=1, device=dev)
        seconds[label] = sum(t.values())
    print(f"\nmsign evaluation order in bfloat16 [{tag}]: max|σ/σ_max − 1| after k Polar Express steps (worst of "
          f"{', '.join(n for n, _ in shapes)}; momentum-like inputs, σᵢ ∝ i^−½), ms per call at {default_steps} steps")
    print(f"{'order':16s} " + " ".join(f"{f'k={k}':>9s}" for k in counts) + f" {'ms':>9s}")
    for label in ORDERS:
        print(f"{label:16s} " + " ".join(f"{errors[label][k]:9.2e}" for k in counts)
              + f" {1e3 * seconds[label]:9.2f}")
    best = min(ORDERS, key=lambda o: errors[o][default_steps])
    print(f"  at the default step count here ({default_steps}) the more orthogonal order is {best}; our Muon uses "
          f"ours (fused){'' if best == 'ours (fused)' else ' — the published order measures better here'}")
    return {"errors": {o: {str(k): v for k, v in e.items()} for o, e in errors.items()},
            "ms": {o: 1e3 * t for o, t in seconds.items()}, "default_steps": default_steps, "best": best}


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=positive_int, default=3, help="timed steps per optimizer (median reported)")
    ap.add_argument("--warmup", type=nonneg_int, default=2, help="untimed steps first (they also warm-start Λ)")
    ap.add_argument("--quick", action="store_true",
                    help=f"≤ 3 min on a 2-core CPU: 1 warm-up + 1 timed step on {'/'.join(QUICK_SHAPES)} only, "
                         f"torch.optim.Muon 1 step on {'/'.join(QUICK_PEER_SHAPES)}; no paper-dual or bf16 rows of "
                         "ours")
    ap.add_argument("--only", default="", help="comma-separated substrings of config names to run")
    ap.add_argument("--layers", type=positive_int, default=1,
                    help=f"GPT-2-small layers in the step table (default 1, at most {MAX_LAYERS}; 12 = the whole "
                         "model, where same-shape matrices are batched: plain Muon everywhere, manifold Muon on a "
                         "GPU)")
    ap.add_argument("--peer-shapes", default="",
                    help="comma list of the shapes (of " + ", ".join(GPT2_SMALL_SHAPES) + ") the bf16 rows "
                         "(torch.optim.Muon, our bf16 preset) are timed on, next to our default Muon (default: all; "
                         "--quick: " + ",".join(QUICK_PEER_SHAPES) + ")")
    ap.add_argument("--json", default="", help="write the results to this JSON file")
    ap.add_argument("--compiled", action="store_true",
                    help="add rows stepping our Muon, Stiefel and DGram through weightgeom.optim.compile_step "
                         "(torch.compile, fullgraph; compiled before the timing, which takes minutes on a CPU)")
    ap.add_argument("--markdown", default="", metavar="FILE",
                    help="put the step-time tables into FILE as markdown (replacing this benchmark's block for this "
                         "device kind, e.g. in docs/benchmarks.md)")
    args = ap.parse_args(argv)
    try:  # two output flags naming one file: one would be written over the other
        distinct_outputs([("--json", args.json), ("--markdown", args.markdown)])
    except ValueError as e:
        ap.error(str(e))
    rows_all = {**CONFIGS, **(COMPILED_ROWS if args.compiled else {})}
    selected = {k: v for k, v in rows_all.items() if not args.only or any(s in k for s in args.only.split(","))}
    if not selected:
        ap.error(f"argument --only: {args.only!r} matches no row; rows: {', '.join(CONFIGS)}")
    # the random start matrices are far from the manifolds: the first-step retraction warning is expected here
    warnings.filterwarnings("ignore", category=FarRetractionWarning)
    all_shapes = list(GPT2_SMALL_SHAPES.items())
    peer_names = [s.strip() for s in args.peer_shapes.split(",") if s.strip()] or (
        list(QUICK_PEER_SHAPES) if args.quick else list(GPT2_SMALL_SHAPES))
    bad = [s for s in peer_names if s not in GPT2_SMALL_SHAPES]
    if bad:
        ap.error(f"--peer-shapes: unknown shape(s) {bad}; choose from {list(GPT2_SMALL_SHAPES)}")
    if args.layers > MAX_LAYERS:
        ap.error(f"argument --layers: {args.layers} is more than {MAX_LAYERS} (GPT-2-small has 12, GPT-2-XL 48)")
    if args.json:
        problem = ("exists and is a directory" if Path(args.json).is_dir() else
                   unwritable_reason(Path(args.json).absolute().parent, "--json folder"))
        if problem:
            ap.error(f"argument --json: {args.json}: {problem}" if "--json folder" not in problem else problem)
    dev = args.device
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as e:
        ap.error(f"--device {dev!r} is not usable here: {str(e).splitlines()[0]}")
    shapes = [(k, GPT2_SMALL_SHAPES[k]) for k in QUICK_SHAPES] if args.quick else all_shapes
    peer_shapes = [(k, GPT2_SMALL_SHAPES[k]) for k in peer_names]
    peer_iters, peer_warmup = (1, 0) if args.quick else (args.iters, args.warmup)
    iters, warmup = (1, 1) if args.quick else (args.iters, args.warmup)
    steady_allocator()  # steady timings: see its docstring
    tag = hardware_tag(dev)
    info = machine_info(dev)
    print("machine:", json.dumps(info))
    print(f"hardware: {tag}")
    choice = msign_choice(dev)
    print(f"msign default here: {choice.describe()}")

    skipped = [k for k in selected if args.quick and k in QUICK_SKIPPED]
    main_rows = {k: v for k, v in selected.items() if k not in PEER_ROWS and k not in skipped}
    peer_rows = {k: v for k, v in selected.items() if k in PEER_ROWS and k not in skipped}
    if peer_rows and "muon (ours, default)" not in peer_rows:
        peer_rows = {"muon (ours, default)": CONFIGS["muon (ours, default)"], **peer_rows}
    results = {"machine": info, "hardware": tag, "msign_choice": choice.as_dict(), "iters": iters,
               "layers": args.layers, "warmup": warmup, "shapes": dict(shapes), "rows": {},
               "peer": {"shapes": dict(peer_shapes), "layers": args.layers, "iters": peer_iters, "warmup": peer_warmup,
                        "rows": {}}}

    base = None
    if main_rows:
        times, stats, _ = run_rows(main_rows, shapes, iters, warmup, dev, layers=args.layers,
                                   progress="step-time table")
        base = times.get("muon (ours, default)")
        which = (" (--quick: 1 of a layer's 4 matrices)" if args.quick and args.layers == 1 else
                 " (one GPT-2-small layer)" if args.layers == 1 else f" × {args.layers} layers")
        print(f"\nstep time [{tag}], {', '.join(f'{a} {b}×{c}' for a, (b, c) in shapes)}{which}, "
              f"median of {iters} after {warmup} warm-up")
        print(f"{'optimizer':34s} {'ms/step':>9s} {'÷ our Muon':>10s}  dual iters (mean/max), residual (max) after "
              f"warm-up")
        for key, t in times.items():
            extra = ""
            row = {"ms": 1e3 * t}
            timed = stats[key][warmup:]
            if timed:
                # (a compiled or host-free step keeps its stats as 0-dim tensors on the device: read once, here)
                its = [int(s["dual_iters"]) for st in timed for s in st.values()]
                res = [float(s["tangent_residual"]) for st in timed for s in st.values()]
                dres = [float(s.get("dual_residual", s["tangent_residual"])) for st in timed for s in st.values()]
                row.update(dual_iters_mean=statistics.mean(its), dual_iters_max=max(its), residual_max=max(res),
                           dual_residual_max=max(dres))
                extra = f"  {statistics.mean(its):.1f}/{max(its)}, {max(res):.1e} (dual {max(dres):.1e})"
            if base:
                row["vs_our_muon"] = t / base
            r_base = f"{t / base:10.2f}" if base else " " * 10
            print(f"{key:34s} {1e3 * t:9.1f} {r_base}{extra}")
            results["rows"][key] = row
    for key in skipped:
        print(f"{key:34s} {'skipped':>9s}  (--quick: {QUICK_SKIPPED[key]}; run without --quick)")

    if peer_rows:
        # The bf16 rows: on a CPU without bf16 units (AVX2, plain AVX512) a bf16 matmul is 10–40× slower than fp32,
        # so torch.optim.Muon's step on one GPT-2-small layer takes over a minute there: timed on fewer shapes/steps.
        pcpu: dict[str, float] = {}
        ptimes, _, ortho = run_rows(peer_rows, peer_shapes, peer_iters, peer_warmup, dev, seed=1, cpu_seconds=pcpu,
                                    layers=args.layers, progress="vs torch.optim.Muon")
        cm = pcpu.get("torch.optim.Muon")
        tm = ptimes.get("torch.optim.Muon")
        few = " (fewer shapes/steps than the table above: bf16 is slow on this CPU)" if (
            args.quick or len(peer_shapes) < len(all_shapes)) else ""
        lay = f" × {args.layers} layers" if args.layers > 1 else ""
        print(f"\nvs torch.optim.Muon [{tag}], {', '.join(f'{a} {b}×{c}' for a, (b, c) in peer_shapes)}{lay}, "
              f"median of {peer_iters} after {peer_warmup} warm-up{few}")
        print(f"{'optimizer':34s} {'ms/step':>9s} {'÷ torch Muon':>12s} {'CPU ms':>9s} {'÷ (CPU)':>8s}  "
              f"max|σ/σ_max − 1| of the first update")
        for key, t in ptimes.items():
            c = pcpu[key]
            row = {"ms": 1e3 * t, "cpu_ms": 1e3 * c, "orthogonality_error": ortho.get(key)}
            if tm:
                row["vs_torch_muon"] = t / tm
            if cm and dev == "cpu":
                row["vs_torch_muon_cpu_time"] = c / cm
            r_torch = f"{t / tm:12.3f}" if tm else " " * 12
            r_cpu = f"{c / cm:8.3f}" if cm and dev == "cpu" else " " * 8
            print(f"{key:34s} {1e3 * t:9.1f} {r_torch} {1e3 * c:9.1f} {r_cpu}  {ortho.get(key, float('nan')):.2e}")
            results["peer"]["rows"][key] = row

    # msign throughput vs a plain matmul of the same kind (the Gram product r×c @ c×r), in the default dtype here
    dtype, steps = choice.dtype, choice.steps
    print(f"\nmsign (polar_express, {steps} steps, {str(dtype).replace('torch.', '')}: the default here) achieved "
          f"GFLOP/s vs a plain matmul [{tag}]:")
    results["msign"] = {}
    reps = 1 if args.quick else 3
    g = torch.Generator().manual_seed(2)
    for name, (m, n) in shapes:
        G = (1e-3 * torch.randn(m, n, generator=g)).to(dev)
        r, c = min(m, n), max(m, n)
        t = interleaved_medians({"msign": lambda G=G: msign(G, dtype=dtype, steps=steps)}, iters=reps, warmup=1,
                                device=dev)
        gf = msign_flops(m, n, steps) / t["msign"] / 1e9
        mm = matmul_gflops(r, c, r, dtype=dtype, device=dev, iters=reps)
        print(f"  {name:12s} {m}×{n}: msign {gf:7.1f} GFLOP/s, matmul {mm:7.1f} GFLOP/s, ratio {gf / mm:5.2f} "
              f"(target ≥ {TARGET_MSIGN_VS_MATMUL})")
        results["msign"][name] = {"msign_gflops": gf, "matmul_gflops": mm, "ratio": gf / mm}

    results["msign_order"] = evaluation_orders(shapes, dev, tag, choice.steps, reps)

    print(f"\ntargets [{tag}]:")
    prow = results["peer"]["rows"]
    if "torch.optim.Muon" in prow and "muon (ours, default)" in prow:
        ours, theirs = prow["muon (ours, default)"], prow["torch.optim.Muon"]
        ok = ours["vs_torch_muon"] <= 1.0 and ours["orthogonality_error"] <= theirs["orthogonality_error"]
        cpu_ratio = f" (process CPU time {ours['vs_torch_muon_cpu_time']:.3f})" if "vs_torch_muon_cpu_time" in ours \
            else ""
        print(f"  our Muon / torch.optim.Muon = {ours['vs_torch_muon']:.3f}{cpu_ratio} at orthogonality error "
              f"{ours['orthogonality_error']:.1e} vs {theirs['orthogonality_error']:.1e}  (target ≤ 1 at equal or "
              f"better orthogonality: {'met' if ok else 'NOT met'}; on a CPU without bf16 units ≤ "
              f"{TARGET_MUON_VS_TORCH:.3f})")
    for key in main_rows:
        if key in TARGET_ROWS and base:
            row = results["rows"][key]
            ok = row.get("residual_max", 1.0) <= TOL
            print(f"  {key} / our Muon = {row['vs_our_muon']:.2f}  (target ≤ {TARGET_MANIFOLD_VS_MUON}, residual "
                  f"{row.get('residual_max', float('nan')):.1e} {'≤' if ok else '>'} {TOL:g})")
    if args.json:
        write_atomic(args.json, json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    if args.markdown:
        print(write_markdown(args.markdown, "optimizer_step", tag, bench_command("optimizer_step", argv),
                             markdown_tables(results)))
    return 0


def markdown_tables(results: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """The step-time tables of a run (``results`` as ``--json`` writes them) as markdown tables."""
    def f(x: object, spec: str) -> str:
        return format(x, spec) if isinstance(x, (int, float)) else "—"

    shapes = ", ".join(f"{a} {b}×{c}" for a, (b, c) in results["shapes"].items())
    rows = [[k, f(r.get("ms"), ".1f"), f(r.get("vs_our_muon"), ".2f"), f(r.get("residual_max"), ".1e")]
            for k, r in results["rows"].items()]
    peer = results["peer"]
    prow = [[k, f(r.get("ms"), ".1f"), f(r.get("vs_torch_muon"), ".3f"), f(r.get("vs_torch_muon_cpu_time"), ".3f"),
             f(r.get("orthogonality_error"), ".2e")] for k, r in peer["rows"].items()]
    pshapes = ", ".join(f"{a} {b}×{c}" for a, (b, c) in peer["shapes"].items())
    layers = f" × {results['layers']} layers" if results["layers"] > 1 else ""
    return [(f"step time, {shapes}{layers}, median of {results['iters']} steps", ["optimizer", "ms/step",
                                                                                   "÷ our Muon", "tangent residual"],
             rows),
            (f"against torch.optim.Muon, {pshapes}{layers}, median of {peer['iters']} steps",
             ["optimizer", "ms/step", "÷ torch.optim.Muon", "÷ (process CPU time)", "orthogonality error"], prow)]


if __name__ == "__main__":
    sys.exit(main())

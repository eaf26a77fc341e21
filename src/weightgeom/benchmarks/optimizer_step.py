"""Optimizer step time on GPT-2-small block shapes: torch.optim.Muon, our Muon, manifold Muon, AdamW; msign GFLOP/s.

One layer's matrices (attn.c_attn 2304×768, attn.c_proj 768×768, mlp.c_fc 3072×768, mlp.c_proj 768×3072; the
ratios do not depend on the number of layers). Every optimizer sees the same sequence of random gradients; steps are
interleaved round-robin so machine-load drift hits all alike; the median step time is reported. Manifold Muon keeps
its warm-started multiplier across steps (the warm-up steps build it), and its per-step stats (dual iterations,
tangent residual) are reported next to the time.

Targets (issue #1): our Muon ≤ 1/20 of torch.optim.Muon's step (premise: bf16 Newton–Schulz is slow on a CPU
without bf16 units — check ``cpu_amx_bf16`` in the header); manifold Muon ≤ 4× our Muon at tangent residual ≤ 1e-4;
msign ≥ 85% of a plain matmul's GFLOP/s.

Usage::

    python -m weightgeom.benchmarks.optimizer_step --quick  # 1 warm-up + 1 timed step each (~5 min on 2 CPU cores)
    python -m weightgeom.benchmarks.optimizer_step --iters 5 --json optimizer_step.json
    python -m weightgeom.benchmarks.optimizer_step --device cuda --iters 20
    weightgeom bench optimizer_step --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from weightgeom.benchmarks._common import GPT2_SMALL_SHAPES, interleaved_medians, machine_info, matmul_gflops
from weightgeom.linalg import MSIGN_PRESETS, msign
from weightgeom.optim import Muon

TARGET_MUON_VS_TORCH = 1 / 20
TARGET_MANIFOLD_VS_MUON = 4.0
TARGET_MSIGN_VS_MATMUL = 0.85
TOL = 1e-4

# name -> (factory kind, kwargs). "paper dual": the manifold-assignment paper's dual settings
# (K = 20, α = 0.1 linear, 10-step msign);
# "fast": 5-step msign inside the loop + one accurate final msign, α = 0.3 constant, then tangent projection
# (residual at rounding level by construction; the dual residual before projection is reported too).
CONFIGS: dict[str, tuple[str, dict]] = {
    "torch.optim.Muon": ("torch_muon", {}),
    "muon (ours, default)": ("ours", {}),
    "muon (ours, muon preset fp32)": ("ours", {"msign_method": "muon"}),
    "muon (ours, muon preset bf16)": ("ours", {"msign_method": "muon", "msign_dtype": torch.bfloat16}),
    "stiefel (paper dual)": ("ours", {"manifold": "stiefel", "dual_tol": TOL}),
    "dgram (paper dual)": ("ours", {"manifold": "dgram", "dual_tol": TOL}),
    "stiefel (fast dual+proj)": ("ours", {"manifold": "stiefel", "dual_tol": TOL, "dual_steps": 4,
                                          "dual_ns_steps": 5, "dual_lr": 0.3, "dual_schedule": "constant",
                                          "dual_project": True}),
    "dgram (fast dual+proj)": ("ours", {"manifold": "dgram", "dual_tol": TOL, "dual_steps": 4, "dual_ns_steps": 5,
                                        "dual_lr": 0.3, "dual_schedule": "constant", "dual_project": True}),
    "adamw (torch, foreach)": ("torch_adamw", {}),
    "adamw (ours)": ("ours", {"algorithm": "adamw", "lr": 1e-3}),
}


def build(kind: str, kw: dict, params: list[torch.nn.Parameter], names: list[str]) -> torch.optim.Optimizer:
    """The optimizer of one CONFIGS row over ``params``."""
    if kind == "torch_muon":
        return torch.optim.Muon(params, lr=0.02, weight_decay=0.0)
    if kind == "torch_adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, foreach=True)
    return Muon([{"params": params, "names": names}], **{"lr": 0.02, **kw})


def msign_flops(m: int, n: int, steps: int) -> float:
    """Flops of a ``steps``-step msign on an m×n matrix (wide orientation r×c, r = min): 4r²c + 2r³ per step."""
    r, c = min(m, n), max(m, n)
    return steps * (4.0 * r * r * c + 2.0 * r**3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=3, help="timed steps per optimizer (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (they also warm-start Λ)")
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 1 timed step; fewer msign repeats")
    ap.add_argument("--only", default="", help="comma-separated substrings of config names to run")
    ap.add_argument("--json", default="", help="write the results to this JSON file")
    args = ap.parse_args(argv)
    if args.quick:
        args.iters, args.warmup = 1, 1
    dev = args.device
    info = machine_info(dev)
    print("machine:", json.dumps(info))

    g = torch.Generator().manual_seed(0)
    shapes = list(GPT2_SMALL_SHAPES.items())
    init = [(0.02 * torch.randn(s, generator=g)).to(dev) for _, s in shapes]
    n_steps = args.warmup + args.iters
    grads = [[(1e-3 * torch.randn(s, generator=g)).to(dev) for _, s in shapes] for _ in range(n_steps)]
    names = [f"transformer.h.0.{k}.weight" for k, _ in shapes]

    rows = {k: v for k, v in CONFIGS.items() if not args.only or any(s in k for s in args.only.split(","))}
    opts, params, counters, stats = {}, {}, {}, {}
    for key, (kind, kw) in rows.items():
        ps = [torch.nn.Parameter(w.clone()) for w in init]
        params[key], opts[key], counters[key], stats[key] = ps, build(kind, kw, ps, names), [0], []

    def stepper(key: str):
        def run() -> None:
            i = counters[key][0] % n_steps
            for p, gr in zip(params[key], grads[i]):
                p.grad = gr
            opts[key].step()
            counters[key][0] += 1
            st = getattr(opts[key], "last_stats", None)
            if st:
                stats[key].append(st)

        return run

    times = interleaved_medians({k: stepper(k) for k in rows}, iters=args.iters, warmup=args.warmup, device=dev)

    base = times.get("muon (ours, default)")
    tm = times.get("torch.optim.Muon")
    print(f"\nstep time, one GPT-2-small layer ({', '.join(f'{a} {b}×{c}' for a, (b, c) in shapes)}), median of "
          f"{args.iters} after {args.warmup} warm-up")
    print(f"{'optimizer':34s} {'ms/step':>9s} {'÷ our Muon':>10s} {'÷ torch Muon':>12s}  dual iters (mean/max), "
          f"residual (max) after warm-up")
    results = {"machine": info, "iters": args.iters, "warmup": args.warmup, "rows": {}}
    for key, t in times.items():
        extra = ""
        row = {"ms": 1e3 * t}
        timed = stats[key][args.warmup:]
        if timed:
            its = [s["dual_iters"] for st in timed for s in st.values()]
            res = [s["tangent_residual"] for st in timed for s in st.values()]
            dres = [s.get("dual_residual", s["tangent_residual"]) for st in timed for s in st.values()]
            row.update(dual_iters_mean=statistics.mean(its), dual_iters_max=max(its), residual_max=max(res),
                       dual_residual_max=max(dres))
            extra = f"  {statistics.mean(its):.1f}/{max(its)}, {max(res):.1e} (dual {max(dres):.1e})"
        r_base = f"{t / base:10.2f}" if base else " " * 10
        r_torch = f"{t / tm:12.3f}" if tm else " " * 12
        if base:
            row["vs_our_muon"] = t / base
        if tm:
            row["vs_torch_muon"] = t / tm
        print(f"{key:34s} {1e3 * t:9.1f} {r_base} {r_torch}{extra}")
        results["rows"][key] = row

    # msign throughput vs a plain matmul of the same kind (the Gram product r×c @ c×r)
    print("\nmsign (polar_express, float32 on CPU / bf16 on CUDA) achieved GFLOP/s vs a plain matmul:")
    steps = MSIGN_PRESETS["polar_express"].steps
    dtype = torch.float32 if torch.device(dev).type == "cpu" else torch.bfloat16
    results["msign"] = {}
    reps = 1 if args.quick else 3
    for (name, (m, n)), G in zip(shapes, grads[0]):
        r, c = min(m, n), max(m, n)
        t = interleaved_medians({"msign": lambda G=G: msign(G, dtype=dtype)}, iters=reps, warmup=1, device=dev)
        gf = msign_flops(m, n, steps) / t["msign"] / 1e9
        mm = matmul_gflops(r, c, r, dtype=dtype, device=dev, iters=reps)
        print(f"  {name:12s} {m}×{n}: msign {gf:7.1f} GFLOP/s, matmul {mm:7.1f} GFLOP/s, ratio {gf / mm:5.2f} "
              f"(target ≥ {TARGET_MSIGN_VS_MATMUL})")
        results["msign"][name] = {"msign_gflops": gf, "matmul_gflops": mm, "ratio": gf / mm}

    print("\ntargets:")
    if base and tm:
        print(f"  our Muon / torch.optim.Muon = {base / tm:.3f}  (target ≤ {TARGET_MUON_VS_TORCH:.3f})")
    for key in rows:
        if "dual" in key and base:
            row = results["rows"][key]
            ok = row.get("residual_max", 1.0) <= TOL
            print(f"  {key} / our Muon = {row['vs_our_muon']:.2f}  (target ≤ {TARGET_MANIFOLD_VS_MUON}, residual "
                  f"{row.get('residual_max', float('nan')):.1e} {'≤' if ok else '>'} {TOL:g})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

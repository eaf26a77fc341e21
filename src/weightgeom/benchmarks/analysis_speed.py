"""Continuity-analysis speed on a 30-layer, hidden-576 Llama-style checkpoint (SmolLM-135M shapes), against full SVD.

Checkpoint: HF Llama names, all seven projections per layer — q_proj (576, 576), k_proj / v_proj (192, 576) (9 heads,
3 KV heads, head_dim 64), o_proj (576, 576), gate_proj / up_proj (1536, 576), down_proj (576, 1536) — 210 matrices,
~106 M weights. Weights are N(0, 0.02²) plus a few rank-one components whose directions drift slowly with depth
(so adjacent layers are partly continuous and the top singular gaps are small, as in trained models). It is written
to a temporary safetensors directory and loaded before the clock starts ("excluding loading").

Timed in one run:
    fast: ``analyze_full(metrics=cv, cu, gram, method="randomized")`` — top vectors by randomised SVD, SVD-free Gram
          alignment in both spaces, random levels (target ≤ 30 s on the 2-core CPU).
    svd:  the same C_v, C_u and Gram alignments from full ``torch.linalg.svd`` of every matrix (Gram alignment in
          its SVD form Σ σ_i² σ'_j² ⟨v_i, v'_j⟩² / (‖σ‖₄² ‖σ'‖₄²)), and the max |difference| to the fast values.

Threads: the default is one torch thread. On the shared 2-core CPU, with other jobs running (load average 9–12),
two OpenMP threads spin-wait on each other and the same run took 31.9 s instead of 9.0 s; ``--threads 0`` keeps
torch's default (use it on a quiet many-core machine).

Measured here (x86_64 2 cores shared, load ≈ 10, torch 2.13 CPU, ``--threads 1``): fast 9.0 s,
full SVD 53.5 s (5.9×); max |fast − SVD| C_v 4.3e-3, C_u 3.8e-3 (synthetic tops are near-degenerate by design),
Gram alignments 2.7e-7.

Usage::

    python -m weightgeom.benchmarks.analysis_speed                        # one torch thread
    python -m weightgeom.benchmarks.analysis_speed --threads 0            # torch's default thread count
    python -m weightgeom.benchmarks.analysis_speed --quick                # 8 layers, SVD reference included
    python -m weightgeom.benchmarks.analysis_speed --layers 8 --skip-svd  # quicker look

Prints a small table and one JSON line.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from weightgeom._cli_args import OneLineParser
from weightgeom._files import write_atomic
from weightgeom.analysis import analyze_full, load
from weightgeom.benchmarks._common import hardware_tag

TARGET_S = 30.0
SHAPES = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (192, 576), "self_attn.v_proj": (192, 576),
          "self_attn.o_proj": (576, 576), "mlp.gate_proj": (1536, 576), "mlp.up_proj": (1536, 576),
          "mlp.down_proj": (576, 1536)}
ROLE_OF = {"self_attn.q_proj": "Q", "self_attn.k_proj": "K", "self_attn.v_proj": "V", "self_attn.o_proj": "O",
           "mlp.gate_proj": "Gate", "mlp.up_proj": "Up", "mlp.down_proj": "Down"}


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm()


def make_checkpoint(layers: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Synthetic Llama-style state dict with depth-drifting rank-one structure (see module docstring)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for key, (m, n) in SHAPES.items():
        u = [_unit(torch.randn(m, generator=g)) for _ in range(3)]
        v = [_unit(torch.randn(n, generator=g)) for _ in range(3)]
        for i in range(layers):
            W = 0.02 * torch.randn(m, n, generator=g)
            for r in range(3):  # drift: a small random step per layer
                u[r] = _unit(u[r] + 0.3 * _unit(torch.randn(m, generator=g)))
                v[r] = _unit(v[r] + 0.3 * _unit(torch.randn(n, generator=g)))
                W += (0.9 - 0.05 * r) * (m**0.5 + n**0.5) * 0.02 * torch.outer(u[r], v[r])
            sd[f"model.layers.{i}.{key}.weight"] = W
    return sd


def svd_reference(loaded, layers: int) -> tuple[dict, float]:
    """C_v, C_u, Gram alignments from full SVDs of every matrix. Returns ({(role, l): {metric: value}}, seconds)."""
    t0 = time.perf_counter()
    out = {}
    for key in SHAPES:
        W = torch.stack([loaded.tensors[f"model.layers.{i}.{key}.weight"] for i in range(layers)]).float()
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        s2 = S.double() ** 2
        for a in range(layers - 1):
            b = a + 1
            d = {"cv": float((Vh[a, 0] * Vh[b, 0]).sum().abs()), "cu": float((U[a, :, 0] * U[b, :, 0]).sum().abs())}
            den = torch.sqrt((s2[a] ** 2).sum() * (s2[b] ** 2).sum())
            cin = (Vh[a].double() @ Vh[b].double().T) ** 2
            cout = (U[a].double().T @ U[b].double()) ** 2
            d["gram_in"] = float((s2[a][:, None] * cin * s2[b][None, :]).sum() / den)
            d["gram_out"] = float((s2[a][:, None] * cout * s2[b][None, :]).sum() / den)
            out[(ROLE_OF[key], a)] = d
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="layers of the checkpoint (default 30; --quick: 8)")
    ap.add_argument("--quick", action="store_true",
                    help="8 layers (about a minute on a 2-core CPU, SVD reference included); target scaled by 8/30")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 = torch's default)")
    ap.add_argument("--method", default="randomized", choices=("randomized", "power", "svd"))
    ap.add_argument("--skip-svd", action="store_true", help="skip the full-SVD reference")
    ap.add_argument("--json", default=None, help="also write the JSON result to this file")
    args = ap.parse_args(argv)
    if args.layers is None:
        args.layers = 8 if args.quick else 30
    if args.layers < 2:
        ap.error(f"--layers must be ≥ 2 (continuity compares adjacent layers), got {args.layers}")
    target = TARGET_S * args.layers / 30  # the target is for the 30-layer checkpoint; time scales with the layers
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        sd = make_checkpoint(args.layers)
        save_file(sd, str(Path(tmp) / "model.safetensors"))
        del sd
        t_make = time.perf_counter() - t0
        t0 = time.perf_counter()
        loaded = load(tmp)
        t_load = time.perf_counter() - t0
    n_mat = sum(1 for t in loaded.tensors.values() if t.ndim == 2)
    print(f"checkpoint: {args.layers} layers, {n_mat} matrices, "
          f"{sum(t.numel() for t in loaded.tensors.values()) / 1e6:.1f} M weights (made {t_make:.1f} s, "
          f"loaded {t_load:.1f} s); torch threads {torch.get_num_threads()}", file=sys.stderr)
    t0 = time.perf_counter()
    res = analyze_full(loaded, metrics=("cv", "cu", "gram"), method=args.method, progress=True)
    t_fast = time.perf_counter() - t0
    result = {"benchmark": "analysis_speed", "layers": args.layers, "matrices": n_mat, "method": args.method,
              "threads": torch.get_num_threads(), "load_s": round(t_load, 2), "fast_s": round(t_fast, 2),
              "target_s": round(target, 2), "pass": t_fast <= target,
              "cpu": platform.processor() or platform.machine(), "hardware": hardware_tag(),
              "torch": torch.__version__}
    if not args.skip_svd:
        ref, t_svd = svd_reference(loaded, args.layers)
        diffs = {k: 0.0 for k in ("cv", "cu", "gram_in", "gram_out")}
        for _, row in res.pairs.iterrows():
            r = ref[(row["role"], int(row["layer"]))]
            for k in diffs:
                diffs[k] = max(diffs[k], abs(float(row[k]) - r[k]))
        result.update({"svd_s": round(t_svd, 2), "speedup": round(t_svd / t_fast, 2),
                       "max_abs_diff_vs_svd": {k: float(f"{v:.2e}") for k, v in diffs.items()}})
    means = res.pairs.groupby("role", sort=False)[["cv", "cu", "gram_in", "gram_out"]].mean().round(3)
    print(means.to_string(), file=sys.stderr)
    print(f"[{hardware_tag()}] fast analysis {t_fast:.1f} s (target ≤ {target:.1f} s for {args.layers} layers)"
          + (f"; full SVD {result['svd_s']:.1f} s; max |fast − svd| {result['max_abs_diff_vs_svd']}"
             if "svd_s" in result else ""), file=sys.stderr)
    line = json.dumps(result)
    print(line)
    if args.json:
        write_atomic(args.json, line + "\n")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

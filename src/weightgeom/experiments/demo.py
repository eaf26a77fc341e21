"""``weightgeom demo``: the main CPU job.

Currently: msign presets against the exact SVD polar factor (the foundation every optimizer builds on).
"""

from __future__ import annotations

import argparse
import time

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from weightgeom.linalg import msign, msign_reference

    g = torch.Generator().manual_seed(args.seed)
    print(f"{'shape':>12} {'method':>14} {'max|O-UVᵀ|':>12} {'ms':>8}")
    for shape in [(768, 768), (2304, 768), (768, 3072)]:
        G = torch.randn(*shape, generator=g)
        ref = msign_reference(G)
        for method in ("polar_express", "muon"):
            t0 = time.perf_counter()
            O = msign(G, method)
            ms = (time.perf_counter() - t0) * 1e3
            err = (O.double() - ref).abs().max().item()
            print(f"{str(shape):>12} {method:>14} {err:12.2e} {ms:8.1f}")
    return 0

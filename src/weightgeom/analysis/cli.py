"""``weightgeom analyze PATH``: continuity analysis of a checkpoint (HF directory, torch .pt, GGUF, run directory)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``weightgeom analyze``."""
    from weightgeom.analysis.api import DEFAULT_METRICS, METRICS

    p.add_argument("path", help="HF model directory (safetensors), .safetensors, torch checkpoint (.pt; ours or "
                                "{'model': state_dict}), weightgeom run directory, or llama.cpp .gguf file")
    p.add_argument("--out", default=None, help="output directory for CSV/JSON/PNG (default: analysis_<name>)")
    p.add_argument("--roles", default=None,
                   help="role map as JSON text or a .json file: {\"Q\": \"blocks.{i}.attn.wq.weight\", ...}")
    p.add_argument("--metrics", nargs="+", choices=METRICS, default=list(DEFAULT_METRICS),
                   help="cv, cu (top singular vectors), gram (σ²-weighted Gram alignment, input and output space), "
                        "idx (index-matched, full SVD: slow). Default: %(default)s")
    p.add_argument("--method", choices=("randomized", "power", "svd"), default="randomized",
                   help="top-singular-vector method (default: %(default)s)")
    p.add_argument("--reference", default=None, help="initial weights W0 (same kinds as PATH): adds accumulated-"
                                                     "update continuity delta_* and the dominance ratio")
    p.add_argument("--check-svd", action="store_true", help="also compute v1/u1 by full SVD and report the error")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--gguf-keep-permutation", action="store_true",
                   help="do not undo llama.cpp's Q/K row permutation (adjacent-layer metrics are invariant to it)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is much faster on an oversubscribed machine)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    """Run the analysis, print the summary table, write the files. Returns 0, or 2 on a clear user error."""
    from weightgeom.analysis.api import analyze_full
    from weightgeom.analysis.loaders import load
    from weightgeom.analysis.report import format_summary, write_report

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    roles = args.roles
    if roles and not roles.lstrip().startswith("{"):
        rp = Path(roles)
        if not rp.is_file():
            print(f"weightgeom analyze: --roles is neither JSON text nor an existing file: {roles}", file=sys.stderr)
            return 2
        roles = rp.read_text()
    path = Path(args.path)
    out = Path(args.out) if args.out else Path(f"analysis_{path.stem or path.name}")
    try:
        t0 = time.perf_counter()
        if not args.quiet:
            print(f"loading {path} ...", file=sys.stderr)
        src = load(path, undo_permute=False if args.gguf_keep_permutation else None)
        ref = load(args.reference) if args.reference else None
        t_load = time.perf_counter() - t0
        if not args.quiet:
            print(f"loaded {len(src.tensors)} tensors ({src.format}) in {t_load:.1f} s; analysing ...", file=sys.stderr)
        res = analyze_full(src, roles, reference=ref, metrics=args.metrics, method=args.method,
                           check_svd=args.check_svd, progress=not args.quiet)
    except (ValueError, FileNotFoundError) as e:
        print(f"weightgeom analyze: {e}", file=sys.stderr)
        return 2
    res.meta["time_load_s"] = t_load
    print(format_summary(res))
    paths = write_report(res, out, plots=not args.no_plots, title=f"Continuity: {'/'.join(path.resolve().parts[-2:])}")
    print(f"analysis {res.meta['time_total_s']:.1f} s (+ load {t_load:.1f} s); wrote {len(paths)} files to {out}/: "
          + ", ".join(p.name for p in paths))
    return 0

"""``weightgeom analyze PATH``: continuity analysis of a checkpoint (HF directory, torch .pt, GGUF, run directory)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from weightgeom._cli_args import positive_int
from weightgeom._paths import unwritable_reason

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``weightgeom analyze``."""
    from weightgeom.analysis.metric_names import DEFAULT_METRICS, METRICS

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
    p.add_argument("--gram", choices=("auto", "exact", "sketch"), default="auto",
                   help="Gram alignment: exact (k×k products, k = min(m, n): ≈ 3·m·n·k multiply-adds per matrix), "
                        "sketch (exact on the top-16 singular subspaces of both layers plus a 32-probe estimate of "
                        "the rest, ≈ 750·m·n, within 5e-3 of exact) or auto (sketch where min(m, n) ≥ 2048, e.g. an "
                        "8B model's projections). Default: %(default)s")
    p.add_argument("--reference", default=None, help="initial weights W0 (same kinds as PATH): adds accumulated-"
                                                     "update continuity delta_* and the dominance ratio")
    p.add_argument("--check-svd", action="store_true", help="also compute v1/u1 by full SVD and report the error")
    p.add_argument("--spectra", action="store_true",
                   help="per-layer power-law exponent α of the eigenvalue density (WeightWatcher-style) in layers.csv "
                        "(one eigvalsh of the smaller-side Gram per matrix); σ_max and stable rank are always there")
    p.add_argument("--suggest", action="store_true",
                   help="per role and adjacent pair, the energy of W_l+1 that layer l's top-k singular basis keeps in "
                        "the role's space (k = 1, 8, 64, with the random level k/d), and the layer runs where a "
                        "shared basis would lose least: suggest.csv, suggest.png")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--gguf-keep-permutation", action="store_true",
                   help="do not undo llama.cpp's Q/K row permutation (adjacent-layer metrics are invariant to it)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is much faster on an oversubscribed machine)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _fail(msg: str) -> int:
    """Print one error line (``weightgeom analyze: ...``) on stderr and return exit code 2."""
    print(f"weightgeom analyze: {msg}".replace("\n", " "), file=sys.stderr)
    return 2


def _load_inputs(args: argparse.Namespace, path: Path):
    """Open PATH and the optional --reference (file tensors are read one at a time later, by the analysis); returns
    (src, ref, seconds)."""
    from weightgeom.analysis.loaders import open_lazy

    t0 = time.perf_counter()
    if not args.quiet:
        print(f"opening {path} ...", file=sys.stderr)
    src = open_lazy(path, undo_permute=False if args.gguf_keep_permutation else None)
    ref = open_lazy(args.reference) if args.reference else None
    return src, ref, time.perf_counter() - t0


def _warn_skipped(res) -> None:
    """One stderr line naming the matrices left out (NaN/Inf, all-zero or empty); the analysis of the others went
    on."""
    from weightgeom.analysis.api import skip_kind

    skipped = res.meta.get("skipped") or []
    if skipped:
        shown = ", ".join(f"{d['tensor']} ({d['reason']})" for d in skipped[:5])
        more = f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        what, pron = ("matrix", "it") if len(skipped) == 1 else ("matrices", "them")
        kinds = {skip_kind(d["reason"]) for d in skipped}
        kind = " or ".join(sorted(kinds))
        why = " (NaN/Inf)" if "non-finite" in kinds else ""
        print(f"weightgeom analyze: warning: skipped {len(skipped)} {kind} {what}{why}: {shown}{more}; "
              f"the layer pairs that would include {pron} are left out, the rest is analysed", file=sys.stderr)


def _report_interrupt(res, out: Path) -> None:
    """One stderr line after Ctrl-C: which roles' CSV/JSON are in ``out`` and which roles are missing."""
    if res is None:
        print("weightgeom analyze: interrupted before the first role was finished; nothing written", file=sys.stderr)
        return
    done, missing = res.meta.get("roles_done", []), res.meta.get("roles_missing", [])
    print(f"weightgeom analyze: interrupted; {out}/ holds the finished roles ({', '.join(done)}: pairs.csv, "
          f"layers.csv, summary.csv, analysis.json); missing: {', '.join(missing) or 'none'} (no plots)",
          file=sys.stderr)


def _first_line(e: BaseException) -> str:
    """The first line of an exception's text (its type name when empty), at most 200 characters."""
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def _out_of_memory(e: BaseException) -> bool:
    """True for ``MemoryError`` and PyTorch's allocator failures (``RuntimeError: ... can't allocate memory``)."""
    if isinstance(e, MemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in ("can't allocate memory", "not enough memory",
                                                                    "Cannot allocate memory", "out of memory"))


RUN_DIR_MARKERS = ("status.json", "metrics.jsonl", ".weightgeom.lock", "sweep.json")
"""Files that make a directory a training run's or a sweep's (one writer: the analysis never writes into one)."""


def _unusable_out(out: Path) -> str:
    """Why ``--out`` cannot take the report ("" when it can): a file in the way, a run or sweep directory (its one
    writer is the trainer), or a nearest existing directory that cannot be written (``unwritable_reason``). Creates
    nothing."""
    marker = next((m for m in RUN_DIR_MARKERS if (out / m).exists()), None)
    if marker:
        return (f"--out {out}: is a training run or sweep directory ({marker}); the analysis writes only into its "
                "own directory — choose another --out")
    return unwritable_reason(out)


def _role_map_text(roles: str | None) -> str | None:
    """``--roles`` as JSON text: the text itself, or the contents of the file it names (a regular file only, read
    with a size bound, so a FIFO or ``/dev/zero`` is one line, not a hang).

    Raises:
        ValueError: neither JSON text nor a file; a FIFO, device or directory; too large; not UTF-8.
        OSError: the file cannot be read (with its path).
    """
    from weightgeom._files import is_regular, read_text_bounded

    if not roles or roles.lstrip().startswith("{"):
        return roles
    try:
        if not is_regular(roles, "--roles"):
            raise ValueError(f"--roles is neither JSON text nor an existing file: {roles}")
        return read_text_bounded(roles, what="--roles")
    except OSError as e:
        raise OSError(f"--roles {roles}: cannot read ({e.strerror or e})") from None


def run(args: argparse.Namespace) -> int:
    """Run the analysis, print the summary table, write the files.

    Returns:
        0, or 2 on a user error (unreadable, truncated, corrupt or unsafe file; bad role map; no analysable matrix;
        an output directory that cannot be written) with one line on stderr naming the file or input.
    """
    from weightgeom.analysis.api import analyze_full
    from weightgeom.analysis.report import format_summary, write_report

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        roles = _role_map_text(args.roles)
    except (OSError, ValueError) as e:
        return _fail(str(e))
    if args.gram != "auto" and "gram" not in args.metrics:  # an explicit choice that would silently do nothing
        return _fail(f"--gram {args.gram} chooses how the gram metric is computed, but --metrics "
                     f"{' '.join(args.metrics)} does not include gram: add it or drop --gram")
    path = Path(args.path)
    out = Path(args.out) if args.out else Path(f"analysis_{path.stem or path.name}")
    problem = _unusable_out(out)  # before reading anything: a long analysis must not end in "cannot write"
    if problem:
        return _fail(problem)
    try:
        src, ref, t_load = _load_inputs(args, path)
    except (ValueError, FileNotFoundError) as e:  # the loaders' messages name the file
        return _fail(str(e))
    except OSError as e:  # permission denied, a directory where a file was expected, ...
        return _fail(f"{e.filename or path}: cannot read ({e.strerror or e})")
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        return _fail(f"{path}: not enough memory to load it ({_first_line(e)})")
    if not args.quiet:
        print(f"opened {len(src.tensors)} tensors ({src.format}) in {t_load:.1f} s; analysing (each matrix read "
              "when its turn comes) ...", file=sys.stderr)
    partial: dict = {}

    def save_partial(r) -> None:  # after every role: the finished roles' CSV/JSON stay readable after Ctrl-C
        r.meta["time_load_s"] = t_load
        write_report(r, out, plots=False)
        partial["res"] = r

    try:
        res = analyze_full(src, roles, reference=ref, metrics=args.metrics, method=args.method,
                           check_svd=args.check_svd, progress=not args.quiet, on_role_done=save_partial,
                           spectra=args.spectra, suggest=args.suggest, gram=args.gram)
    except KeyboardInterrupt:
        _report_interrupt(partial.get("res"), out)
        raise
    except ValueError as e:  # a loader's read error already names its file (a GGUF tensor of an unreadable type)
        return _fail(str(e) if str(e).startswith(f"{path}") else f"{path}: {e}")
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        return _fail(f"{path}: not enough memory to analyse it ({_first_line(e)})")
    _warn_skipped(res)
    res.meta["time_load_s"] = t_load
    print(format_summary(res))
    if args.suggest:
        from weightgeom.analysis.report import format_suggestions, shared_basis_runs

        print(format_suggestions(shared_basis_runs(res.pairs), pairs=res.pairs))
    from weightgeom.analysis.report import format_reading

    print(format_reading(res))
    try:
        paths = write_report(res, out, plots=not args.no_plots,
                             title=f"Continuity: {'/'.join(path.resolve().parts[-2:])}")
    except OSError as e:
        return _fail(f"cannot write the report to {out}/: {e.strerror or e}"
                     + (f" ({e.filename})" if getattr(e, "filename", None) else ""))
    print(f"analysis {res.meta['time_total_s']:.1f} s (+ load {t_load:.1f} s); wrote {len(paths)} files to {out}/: "
          + ", ".join(p.name for p in paths))
    from weightgeom.analysis.report import format_legend

    print()
    print(format_legend(res, suggest=args.suggest))  # the same legend as examples/analyze_checkpoint.py
    return 0

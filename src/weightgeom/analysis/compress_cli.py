"""``weightgeom compress MODEL`` (shared bases across layers) and ``weightgeom eval MODEL`` (perplexity).

Both call the Python API (:func:`weightgeom.analysis.compress.compress`,
:func:`weightgeom.analysis.perplexity.perplexity`); bad input is one line on stderr and exit code 2. Only the standard
library is imported at module level (``--help`` needs no torch).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from weightgeom.cli import positive_int

__all__ = ["add_compress_arguments", "run_compress", "add_eval_arguments", "run_eval", "add_arguments", "run"]

ROLE_NAMES = ("Q", "K", "V", "O", "Gate", "Up", "Down", "MLP")


def _fraction(text: str) -> float:
    """argparse type: a number strictly between 0 and 1."""
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction strictly between 0 and 1, got {text!r}")
    return v


def _fail(cmd: str, msg: str) -> int:
    print(f"weightgeom {cmd}: {msg}".replace("\n", " "), file=sys.stderr)
    return 2


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


# ------------------------------------------------------------------------------------------------------- compress
def add_compress_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``weightgeom compress``."""
    p.add_argument("path", help="HF model directory (safetensors), .safetensors, torch checkpoint (weights only), "
                                "weightgeom run directory, or llama.cpp .gguf file")
    p.add_argument("--out", required=True, help="output directory (compressed.json, tensors/*.safetensors, "
                                                "savings.csv); must not hold a compressed checkpoint already")
    p.add_argument("--share", choices=("input", "output", "auto", "none"), default="auto",
                   help="space of each group's shared basis: input (right basis V, W ≈ C Vᵀ), output (left basis U, "
                        "W ≈ U C), auto (each role's more continuous space, from the continuity analysis), none "
                        "(per-layer truncated SVD, no sharing). Default: %(default)s")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--rank", type=positive_int, help="basis rank r per group")
    size.add_argument("--savings", type=_fraction,
                      help="fraction of each role's parameters to save (the rank per group is the largest that saves "
                           "at least this much)")
    p.add_argument("--layers-per-group", type=positive_int, default=4,
                   help="consecutive layers sharing one basis (default: %(default)s)")
    p.add_argument("--roles", nargs="+", default=None, metavar="ROLE",
                   help=f"roles to compress, from {', '.join(ROLE_NAMES)} (default: every recognised role but V)")
    p.add_argument("--basis", choices=("svd", "random"), default="svd",
                   help="svd: the group's top singular vectors; random: a seeded random orthonormal basis "
                        "(baseline). Default: %(default)s")
    p.add_argument("--seed", type=int, default=0, help="seed of --basis random (default: %(default)s)")
    p.add_argument("--role-map", default=None,
                   help="role map as JSON text or a .json file, as analyze --roles: {\"Q\": \"blocks.{i}.wq.weight\"}")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run_compress(args: argparse.Namespace) -> int:
    """Compress, print the parameters table, write the checkpoint.

    Returns:
        0, or 2 with one line on stderr on bad input (missing or unsafe file, unknown role, no recognised role, a
        rank larger than the matrices allow, an unusable or already used --out); 130 after Ctrl-C with the finished
        roles kept.
    """
    from weightgeom.analysis.cli import _out_of_memory, _role_map_text, _unusable_out

    bad = [r for r in (args.roles or []) if r not in ROLE_NAMES]
    if bad:
        return _fail("compress", f"unknown role {bad[0]!r}; choose from {', '.join(ROLE_NAMES)}")
    if args.basis == "random" and args.share == "none":
        return _fail("compress", "--basis random needs a shared space (--share input, output or auto)")
    path, out = Path(args.path), Path(args.out)
    problem = _unusable_out(out)
    if problem:
        return _fail("compress", problem)
    if (out / "compressed.json").exists():
        return _fail("compress", f"--out {out}: already holds a compressed checkpoint (compressed.json); choose "
                                 "another --out or remove it")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from weightgeom.analysis.compress import CompressConfig, compress
    from weightgeom.analysis.loaders import open_lazy

    try:
        role_map = _role_map_text(args.role_map)
        cfg = CompressConfig(share=args.share, rank=args.rank, savings=args.savings,
                             layers_per_group=args.layers_per_group,
                             roles=tuple(args.roles) if args.roles else None, basis=args.basis, seed=args.seed)
        cfg.check()
        t0 = time.perf_counter()
        if not args.quiet:
            print(f"opening {path} ...", file=sys.stderr)
        src = open_lazy(path)
    except (ValueError, FileNotFoundError) as e:
        return _fail("compress", _first_line(e))
    except OSError as e:
        return _fail("compress", f"{e.filename or path}: cannot read ({e.strerror or e})")
    partial: dict = {}
    try:
        res = compress(src, out, cfg, role_map=role_map, progress=not args.quiet,
                       on_role_done=lambda r: partial.update(res=r))
    except KeyboardInterrupt:
        done = sorted({g["role"] for g in partial["res"].index["groups"]}) if "res" in partial else []
        print(f"weightgeom compress: interrupted; {out}/ holds the finished roles ({', '.join(done) or 'none'}), "
              "marked incomplete in compressed.json", file=sys.stderr)
        raise
    except ValueError as e:
        msg = _first_line(e)
        return _fail("compress", msg if msg.startswith(str(path)) else f"{path}: {msg}")
    except FileExistsError as e:
        return _fail("compress", _first_line(e))
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        return _fail("compress", f"{path}: not enough memory ({_first_line(e)})")
    t = res.table.copy()
    t["saved_frac"] = t["saved_frac"].map(lambda x: f"{x:.1%}")
    t["energy_lost"] = t["energy_lost"].map(lambda x: f"{x:.4f}")
    print(t.to_string(index=False))
    if args.share == "auto":
        print("auto spaces (C_v / C_u over their random levels): " + ", ".join(
            f"{r} {v['space']} ({v.get('input', float('nan')):.1f}× / {v.get('output', float('nan')):.1f}×)"
            for r, v in res.spaces.items()))
    print(f"compressed in {time.perf_counter() - t0:.1f} s; wrote {out}/compressed.json, {out}/savings.csv and "
          f"{len(res.index['groups'])} group files in {out}/tensors/")
    return 0


# ----------------------------------------------------------------------------------------------------------- eval
def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``weightgeom eval``."""
    p.add_argument("path", help="HF model directory, .gguf file (through transformers, offline), weightgeom checkpoint "
                                "or run directory, or a weightgeom compress output directory")
    p.add_argument("--text", default=None,
                   help="UTF-8 text file to evaluate on (default: the held-out last 10%% of the bundled Shakespeare)")
    p.add_argument("--tokens", type=positive_int, default=None,
                   help="token budget: predicted tokens (default 2048; the time is linear in it)")
    p.add_argument("--context", type=positive_int, default=None,
                   help="window length in tokens (default 512, capped at the model's context)")
    p.add_argument("--base", default=None,
                   help="for a compress output: the uncompressed model (default: the path its index records)")
    p.add_argument("--compare", action="store_true",
                   help="for a compress output: also evaluate the uncompressed base and print both")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run_eval(args: argparse.Namespace) -> int:
    """Print the perplexity (and with ``--compare`` the base's).

    Returns:
        0, or 2 with one line on stderr (missing or unreadable file, a model of no supported kind, an incomplete
        compressed checkpoint, a text with fewer than 2 tokens).
    """
    from weightgeom._files import is_regular, read_text_bounded

    path = Path(args.path)
    if not path.exists():
        return _fail("eval", f"{path}: no such file or directory")
    text = None
    if args.text is not None:
        try:
            if not is_regular(args.text, "--text"):
                return _fail("eval", f"--text {args.text}: not a regular file")
            text = read_text_bounded(args.text, limit=512 * 2**20, what="--text")
        except (OSError, ValueError) as e:
            return _fail("eval", f"--text {args.text}: cannot read ({getattr(e, 'strerror', None) or _first_line(e)})")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from weightgeom.analysis.perplexity import DEFAULT_TOKENS, load_causal_lm, perplexity

    tokens = args.tokens or DEFAULT_TOKENS
    try:
        t0 = time.perf_counter()
        if not args.quiet:
            print(f"loading {path} ...", file=sys.stderr)
        lm = load_causal_lm(path, base=args.base)
        if not args.quiet:
            print(f"loaded {lm.name} ({lm.kind}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        results = [perplexity(lm, text, tokens=tokens, context=args.context, progress=not args.quiet)]
        if args.compare:
            from weightgeom.analysis.compress import INDEX_FILE, compressed_source

            if not (path / INDEX_FILE).exists():
                return _fail("eval", f"--compare needs a compress output directory; {path} is not one")
            base = load_causal_lm(args.base or compressed_source(path))
            results.insert(0, perplexity(base, text, tokens=tokens, context=args.context, progress=not args.quiet))
    except (ValueError, FileNotFoundError) as e:
        return _fail("eval", _first_line(e))
    except OSError as e:
        return _fail("eval", f"{e.filename or path}: cannot read ({e.strerror or e})")
    for r in results:
        print(f"{r.model}: perplexity {r.ppl:.4f} (NLL {r.nll:.4f} nats/token) over {r.tokens} tokens, {r.windows} "
              f"windows of ≤ {r.context}, {r.seconds:.1f} s")
    if len(results) == 2:
        print(f"compressed / uncompressed perplexity: {results[1].ppl / results[0].ppl:.3f}×")
    return 0


# the top-level dispatcher's interface for ``weightgeom compress`` (``weightgeom eval``: weightgeom.analysis.eval_cli)
add_arguments, run = add_compress_arguments, run_compress

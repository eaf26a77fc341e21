"""``weightgeom compress MODEL`` (shared bases across layers) and ``weightgeom eval MODEL`` (perplexity).

Both call the Python API (:func:`weightgeom.analysis.compress.compress`,
:func:`weightgeom.analysis.perplexity.perplexity`); bad input is one line on stderr and exit code 2. Only the standard
library is imported at module level (``--help`` needs no torch).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from weightgeom._cli_args import positive_int

__all__ = ["add_compress_arguments", "run_compress", "add_eval_arguments", "run_eval", "add_arguments", "run"]

ROLE_NAMES = ("Q", "K", "V", "O", "Gate", "Up", "Down", "MLP")


def _number(text: str, ok: Callable[[float], bool], expected: str) -> float:
    """argparse type body: ``text`` as a float for which ``ok`` holds, else one line naming what was expected
    (a word, or NaN, never passes: every comparison with NaN is false)."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not ok(v):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return v


def _fraction(text: str) -> float:
    """argparse type: a number strictly between 0 and 1."""
    return _number(text, lambda v: 0 < v < 1, "a fraction strictly between 0 and 1")


def _holdout(text: str) -> float:
    """argparse type: a fraction in [0, 1) (``--calibration-holdout``)."""
    return _number(text, lambda v: 0 <= v < 1, "a fraction from 0 up to (not including) 1")


def _above_one(text: str) -> float:
    """argparse type: a number greater than 1 (``--max-ratio``)."""
    return _number(text, lambda v: v > 1, "a ratio greater than 1")


def _fail(cmd: str, msg: str) -> int:
    print(f"weightgeom {cmd}: {msg}".replace("\n", " "), file=sys.stderr)
    return 2


def _first_line(e: BaseException, limit: int = 600) -> str:
    """The first line of an exception's message, cut at a word (with " …") when longer than ``limit``."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    if len(line) <= limit:
        return line
    return line[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " …"


ROLE_MAP_HINT = ("--role-map '{\"Q\": \"blocks.{i}.attn.wq.weight\"}' ({i} = layer index, or \"re:<regex>\" with "
                 "one group for the layer)")
ENERGY_WARN = 0.9
"""A role losing more than this fraction of its weight energy (Σ‖W − Ŵ‖²/Σ‖W‖²) gets a warning line."""


def _role_map_arg(text: str | None) -> dict | None:
    """``--role-map``: JSON text or a JSON file naming ``{role: pattern}``, every role one of :data:`ROLE_NAMES`.

    Raises:
        ValueError: one line naming ``--role-map`` (not JSON, not an object, an unknown role, a bad pattern, a file
            that cannot be read).
    """
    import json
    import re

    from weightgeom.analysis.cli import _role_map_text
    from weightgeom.analysis.roles import parse_role_map

    if text is None:
        return None
    try:
        raw = _role_map_text(text)
    except (OSError, ValueError) as e:  # the analysis' reader names its own option, --roles
        raise ValueError(_first_line(e).replace("--roles", "--role-map")) from None
    try:
        m = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"--role-map: not valid JSON ({e.msg}, line {e.lineno} column {e.colno}); e.g. "
                         f"{ROLE_MAP_HINT}") from None
    if not isinstance(m, dict) or not m:
        raise ValueError(f"--role-map: expected a non-empty {{role: pattern}} object; e.g. {ROLE_MAP_HINT}")
    bad = [r for r in m if r not in ROLE_NAMES]
    if bad:
        raise ValueError(f"--role-map: unknown role {bad[0]!r}; choose from {', '.join(ROLE_NAMES)}")
    try:
        parse_role_map(m)
    except ValueError as e:
        raise ValueError(f"--role-map: {_first_line(e).removeprefix('role map: ')}") from None
    except re.error as e:
        raise ValueError(f"--role-map: a pattern is not a valid regular expression ({e})") from None
    return m


def _os_failure(e: OSError, path: Path, out: Path) -> str:
    """One line for an ``OSError`` during a compress: a file under ``--out`` that could not be written (a full disk,
    a read-only filesystem) is named with what to do, never the source model; otherwise the file that could not be
    read."""
    from weightgeom._cli_args import os_error_line

    reason = os_error_line(OSError(e.errno, e.strerror) if e.errno is not None else e)
    if e.filename is None:
        return f"{path} → {out}: cannot read or write ({reason})"
    where, o = Path(os.path.abspath(e.filename)), Path(os.path.abspath(out))
    if where == o or o in where.parents:
        return (f"--out {out}: cannot write {e.filename} ({reason}); what was finished is kept — free some space "
                "or make --out writable, then run the same command again to finish it")
    return f"{e.filename}: cannot read ({reason})"


def _compress_output(out: Path) -> bool:
    """Whether ``out`` is (or is becoming) a compress output: it holds ``compressed.json``, or nothing but the lock a
    compress takes. Its lock is then the compress's own (:func:`~weightgeom.analysis.compress.check_out` refuses a
    live owner and takes over a stale one), not the mark of a training run."""
    from weightgeom.analysis.compress import INDEX_FILE
    from weightgeom.train.rundir import LOCK_NAME

    try:
        names = [e.name for e in out.iterdir()] if out.is_dir() else []
    except OSError:
        return False
    return INDEX_FILE in names or bool(names) and all(n.startswith(LOCK_NAME) for n in names)


def _no_roles_line(msg: str) -> str:
    """The loaders' "no projection roles recognised …" line for compress: a few of the names seen, then how to pass
    ``--role-map`` (the analysis' hint names ``weightgeom analyze --roles``)."""
    from weightgeom.analysis.roles import ROLE_MAP_HELP

    head = msg.replace(ROLE_MAP_HELP, "").rstrip(" .")
    before, sep, seen = head.partition(" Seen: ")
    if sep:
        names = seen.split(", ")
        head = f"{before} Seen: {', '.join(names[:3])}{', …' if len(names) > 3 else ''}"
    return f"{head} — name the roles with {ROLE_MAP_HINT}"


def _interrupted(out: Path) -> int:
    """After Ctrl-C: one line saying what ``out`` holds (the roles its index lists) and how to finish; exit 130."""
    from weightgeom._files import read_json

    roles = None
    try:
        idx = read_json(out / "compressed.json", what="compressed index")
        groups = idx.get("groups") if isinstance(idx, dict) else None
        if isinstance(groups, list):
            roles = list(dict.fromkeys(str(g.get("role")) for g in groups if isinstance(g, dict)))
    except (OSError, ValueError):
        pass
    if roles is None:
        msg = f"interrupted before anything was written to {out}"
    elif roles:
        msg = (f"interrupted; {out}/ keeps the finished roles ({', '.join(roles)}), marked incomplete — run the same "
               "command again to finish it")
    else:
        msg = f"interrupted before any role was finished; run the same command again to finish {out}/"
    print(f"weightgeom compress: {msg}", file=sys.stderr)
    return 130


# ------------------------------------------------------------------------------------------------------- compress
def add_compress_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``weightgeom compress``."""
    p.add_argument("path", help="HF model directory (safetensors), .safetensors, torch checkpoint (weights only), "
                                "weightgeom run directory, or llama.cpp .gguf file")
    p.add_argument("--out", required=True, help="output directory (compressed.json, tensors/*.safetensors, "
                                                "savings.csv): new or empty, outside the model's folder; an "
                                                "interrupted compress of the same model and settings is finished")
    p.add_argument("--share", choices=("input", "output", "auto", "none"), default="auto",
                   help="space of each group's shared basis: input (right basis V, W ≈ C Vᵀ), output (left basis U, "
                        "W ≈ U C), auto (per role, whichever of input, output and per-layer has the lowest "
                        "calibration loss; with --calibration none: the more continuous space), none (per-layer "
                        "truncated SVD, no sharing). Default: %(default)s")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="UTF-8 text the fits are calibrated on: every mode minimises the error of the layers' outputs "
                        "on it (SVD-LLM whitening; shared bases with least-squares coefficients). Default: the bundled "
                        "Shakespeare without the held-out tail eval uses (for a model that cannot be run: weight-only, "
                        "with a note); 'none': weight-only fits")
    p.add_argument("--calibration-tokens", type=positive_int, default=None,
                   help="calibration budget in tokens (default 4096)")
    p.add_argument("--calibration-holdout", type=_holdout, default=None, metavar="F",
                   help="--share auto: score each space on the last F of the calibration tokens after fitting it on "
                        "the rest (the choice then does not favour the fit that overfits most); the chosen space is "
                        "fitted on all of them. 0: score on the fitted tokens (default 0.25)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--rank", type=positive_int, help="basis rank r per group")
    size.add_argument("--savings", type=_fraction,
                      help="fraction of the parameters to save: of each role's own (--budget role), or of all the "
                           "compressed roles' together (--budget model); the rank per group is the largest that saves "
                           "at least its share")
    p.add_argument("--budget", choices=("role", "model"), default="role",
                   help="role: every compressed role saves --savings of its own parameters; model: --savings is of "
                        "all the compressed roles' parameters together, allotted per role by measured calibration "
                        "loss (the roles that lose least per parameter saved give most; a role may be kept whole) — "
                        "the table at the end shows each role's share; needs calibration. Default: %(default)s")
    p.add_argument("--layers-per-group", type=positive_int, default=4,
                   help="consecutive layers sharing one basis (default: %(default)s)")
    p.add_argument("--roles", nargs="+", default=None, metavar="ROLE",
                   help=f"roles to compress, from {', '.join(ROLE_NAMES)} (default: every recognised role but V)")
    p.add_argument("--basis", choices=("svd", "random"), default="svd",
                   help="svd: the group's top singular vectors; random: a seeded random orthonormal basis "
                        "(baseline). Default: %(default)s")
    p.add_argument("--seed", type=int, default=0, help="seed of --basis random (default: %(default)s)")
    p.add_argument("--role-map", default=None,
                   help="role map as JSON text or a .json file: {\"Q\": \"blocks.{i}.wq.weight\"} ({i} = layer "
                        f"index, or \"re:<regex>\"); roles from {', '.join(ROLE_NAMES)}")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run_compress(args: argparse.Namespace) -> int:
    """Compress, print the parameters table, write the checkpoint.

    Returns:
        0, or 2 with one line on stderr on bad input (missing or unsafe file, a compress output as the model, unknown
        role, bad --role-map, no recognised role, a rank larger than the matrices allow or one that saves nothing, an
        --out that is the model's folder or inside it, not empty, or already finished); 130 after Ctrl-C with the
        finished roles kept (the same command finishes them).
    """
    from weightgeom._paths import unwritable_reason
    from weightgeom.analysis.cli import _out_of_memory, _unusable_out

    bad = [r for r in (args.roles or []) if r not in ROLE_NAMES]
    if bad:
        return _fail("compress", f"unknown role {bad[0]!r}; choose from {', '.join(ROLE_NAMES)}")
    if args.basis == "random" and args.share == "none":
        return _fail("compress", "--basis random needs a shared space (--share input, output or auto)")
    if args.budget == "model" and args.savings is None:
        return _fail("compress", "--budget model allots a whole-model --savings across roles; give --savings, not "
                                 "--rank")
    if args.budget == "model" and args.calibration == "none":
        return _fail("compress", "--budget model allots the savings by measured calibration loss; drop "
                                 "--calibration none (or use --budget role)")
    path, out = Path(args.path), Path(args.out)
    problem = unwritable_reason(out) if _compress_output(out) else _unusable_out(out)
    if problem:
        return _fail("compress", problem)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from weightgeom.analysis.compress import CompressConfig, _plural, check_out, compress
    from weightgeom.analysis.compress_choice import compress_calibrated

    try:
        role_map = _role_map_arg(args.role_map)
        from weightgeom.analysis.calibration import DEFAULT_CALIBRATION, calibration_text
        from weightgeom.analysis.compress_fit import CALIBRATION_HOLDOUT, CALIBRATION_TOKENS

        calib = None if args.calibration == "none" else (args.calibration or DEFAULT_CALIBRATION)
        if calib is not None and calib != DEFAULT_CALIBRATION:
            calibration_text(calib)  # a missing or empty --calibration file: one line before anything is read
        cfg = CompressConfig(share=args.share, rank=args.rank, savings=args.savings,
                             layers_per_group=args.layers_per_group,
                             roles=tuple(args.roles) if args.roles else None, basis=args.basis, seed=args.seed,
                             calibration=calib, calibration_tokens=args.calibration_tokens or CALIBRATION_TOKENS,
                             calibration_holdout=(CALIBRATION_HOLDOUT if args.calibration_holdout is None
                                                  else args.calibration_holdout), budget=args.budget)
        cfg.check()
        try:
            old = check_out(out, path, cfg, role_map)  # before anything is read or written
        except ValueError as first:
            if args.calibration is not None or cfg.calibration is None:
                raise
            from dataclasses import replace

            # finishing an interrupted compress that fell back to weight-only fits (a model that cannot be run)
            try:
                old = check_out(out, path, replace(cfg, calibration=None), role_map)
            except ValueError:
                raise first from None
            cfg = replace(cfg, calibration=None)
    except (ValueError, FileNotFoundError, FileExistsError) as e:  # before OSError, which these two are
        return _fail("compress", _first_line(e))
    except OSError as e:
        return _fail("compress", f"{e.filename or path}: cannot read ({e.strerror or e})")
    t0 = time.perf_counter()
    if not args.quiet:
        done = list(dict.fromkeys(g["role"] for g in old["groups"])) if old is not None else []
        print(f"resuming the interrupted compress in {out} (finished roles: {', '.join(done) or 'none'}); opening "
              f"{path} ..." if old is not None else f"opening {path} ...", file=sys.stderr)
    try:
        try:
            run = compress_calibrated if cfg.calibration is not None else compress
            res = run(path, out, cfg, role_map=role_map, progress=not args.quiet)
        except ValueError as e:
            if args.calibration is not None or not str(e).startswith("calibration needs a model"):
                raise
            from dataclasses import replace

            if cfg.budget == "model":
                raise ValueError(f"--budget model needs a model it can run for calibration ({_first_line(e)}); use "
                                 "--budget role") from None
            if not args.quiet:
                print(f"weightgeom compress: note: {path} is not a model that can be run for calibration (eval reads "
                      "HF directories, .gguf files and weightgeom checkpoints); fitting weight-only",
                      file=sys.stderr)
            cfg = replace(cfg, calibration=None)
            res = compress(path, out, cfg, role_map=role_map, progress=not args.quiet)
    except KeyboardInterrupt:
        return _interrupted(out)
    except FileExistsError as e:
        return _fail("compress", _first_line(e))
    except (ValueError, FileNotFoundError) as e:
        msg = str(e).strip()
        msg = _no_roles_line(msg) if "no projection roles recognised" in msg else _first_line(e)
        return _fail("compress", msg if msg.startswith((str(path), "--")) else f"{path}: {msg}")
    except (MemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        return _fail("compress", f"{path}: not enough memory ({_first_line(e)})")
    except OSError as e:
        return _fail("compress", _os_failure(e, path, out))
    t = res.table.copy()
    t["saved_frac"] = t["saved_frac"].map(lambda x: f"{x:.1%}")
    t["energy_lost"] = t["energy_lost"].map(lambda x: f"{x:.4f}")
    if "calib_loss" in t.columns:
        t["calib_loss"] = t["calib_loss"].map(lambda x: f"{x:.4f}")
    print(t.to_string(index=False))
    if cfg.budget == "model" or args.share == "auto" and cfg.calibration is not None:
        from weightgeom.analysis.compress_choice import format_choice_table

        if cfg.budget == "model":
            print(f"budget: {cfg.savings:.0%} of the compressed roles' parameters together, allotted per role by the "
                  "calibration loss per parameter saved (savings column; whole = kept uncompressed)")
        cal = res.index.get("calibration", {})
        held = cal.get("held_tokens") or 0
        where = (f"{held} calibration tokens the fits did not see, each fitted on the other "
                 f"{cal.get('tokens', 0) - held}; the choice then fitted on all {cal.get('tokens', '?')}" if held else
                 f"the {cal.get('tokens', '?')} calibration tokens it was fitted on")
        if args.share == "auto":
            print("auto: per role the space with the lowest calibration loss (relative layer-output error on "
                  f"{where}), continuity ratios beside:")
        print(format_choice_table(res.spaces))
    elif args.share == "auto":
        print("auto spaces (C_v / C_u over their random levels): " + ", ".join(
            f"{r} {v['space']} ({v.get('input', float('nan')):.1f}× / {v.get('output', float('nan')):.1f}×)"
            for r, v in res.spaces.items()))
    lossy = [f"{row.role} {row.energy_lost:.0%}" for row in res.table.itertuples()
             if row.role != "total" and row.energy_lost > ENERGY_WARN]
    if lossy:
        print(f"weightgeom compress: warning: {'roles' if len(lossy) > 1 else 'role'} {', '.join(lossy)} lose more "
              f"than {ENERGY_WARN:.0%} of their weight energy; the model will be far from the original — raise "
              "--rank or lower --savings", file=sys.stderr)
    n = len(res.index["groups"])
    print(f"compressed in {time.perf_counter() - t0:.1f} s; wrote {out}/compressed.json, {out}/savings.csv and "
          f"{_plural(n, 'group file')} in {out}/tensors/")
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
                   help="for a compress output: also evaluate the uncompressed base, print both and say whether the "
                        "compressed model is broken (NLL above ln(vocabulary size), uniform guessing, or perplexity "
                        "more than --max-ratio times the base's)")
    p.add_argument("--max-ratio", type=_above_one, default=None, metavar="R",
                   help="with --compare: call the compressed model broken above R times the base's perplexity")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run_eval(args: argparse.Namespace) -> int:
    """Print the perplexity (and with ``--compare`` the base's).

    Returns:
        0, or 2 with one line on stderr (missing, unreadable or pickled file, a model of no supported kind or without
        a tokenizer, --compare or --base for a model that is not a compress output, an incomplete compressed
        checkpoint or one whose base is missing, changed or loops back, a missing or empty text, a text with fewer
        than 2 tokens).
    """
    from weightgeom._files import is_regular, read_text_bounded

    path = Path(args.path)
    if not path.exists():
        return _fail("eval", f"{path}: no such file or directory")
    compressed = path.is_dir() and (path / "compressed.json").is_file()
    if args.max_ratio is not None and not args.compare:
        return _fail("eval", "--max-ratio is for --compare (it judges the compressed model against its base)")
    for flag, given in (("--compare", args.compare), ("--base", args.base is not None)):
        if given and not compressed:
            return _fail("eval", f"{flag} is for a weightgeom compress output directory; {path} is not one (no "
                                 "compressed.json)")
    text = None
    if args.text is not None:
        try:
            if not is_regular(args.text, "--text"):
                return _fail("eval", f"--text {args.text}: no such file")
            text = read_text_bounded(args.text, limit=512 * 2**20, what="--text")
        except (OSError, ValueError) as e:
            return _fail("eval", f"--text {args.text}: cannot read ({getattr(e, 'strerror', None) or _first_line(e)})")
        if not text.strip():
            return _fail("eval", f"--text {args.text}: empty (nothing to evaluate)")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from weightgeom.analysis.compress import _plural, compressed_source
    from weightgeom.analysis.perplexity import DEFAULT_TOKENS, load_causal_lm, perplexity

    tokens = args.tokens or DEFAULT_TOKENS
    try:
        results, vocabs = [], []  # the model's, then (--compare) its base's
        models = [(path, args.base)] + ([(None, None)] if args.compare else [])
        for model, base in models:
            model = model or Path(compressed_source(path, args.base))  # --compare: the uncompressed base
            t0 = time.perf_counter()
            if not args.quiet:
                print(f"loading {model} ...", file=sys.stderr)
            lm = load_causal_lm(model, base=base)
            if not args.quiet:
                print(f"loaded {lm.name} ({lm.kind}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            results.append(perplexity(lm, text, tokens=tokens, context=args.context, progress=not args.quiet))
            vocabs.append(_vocab_size(lm))
            del lm
    except (ValueError, FileNotFoundError) as e:
        return _fail("eval", _first_line(e))
    except OSError as e:
        return _fail("eval", f"{e.filename or path}: cannot read ({e.strerror or e})")
    for r in results[::-1]:
        short = f" (all the text holds; {tokens} requested)" if r.tokens < tokens else ""
        print(f"{r.model}: perplexity {r.ppl:.4f} (NLL {r.nll:.4f} nats/token) over {_plural(r.tokens, 'token')}"
              f"{short}, {_plural(r.windows, 'window')} of ≤ {r.context}, {r.seconds:.1f} s")
    if len(results) == 2:
        print(f"compressed / uncompressed perplexity: {results[0].ppl / results[1].ppl:.3f}×")
        print(_verdict(results[0], results[1], vocabs[0], args.max_ratio))
    return 0


def _vocab_size(lm) -> int | None:
    """The size of a causal LM's output vocabulary (its output embedding's rows), or None when it has none."""
    get = getattr(lm.model, "get_output_embeddings", None)
    emb = get() if callable(get) else None
    w = getattr(emb, "weight", None)
    if w is None:
        w = getattr(getattr(lm.model, "lm_head", None), "weight", None)
    return int(w.shape[0]) if w is not None else None


def _verdict(comp, base, vocab: int | None, max_ratio: float | None) -> str:
    """One plain line: whether the compressed model is broken (its NLL above ln(vocab), what guessing uniformly over
    the vocabulary scores, or its perplexity above ``max_ratio`` × the base's) or usable."""
    import math

    ratio = comp.ppl / base.ppl
    if vocab and base.nll >= math.log(vocab):
        return (f"the uncompressed model itself is no better than guessing uniformly (NLL {base.nll:.3f} ≥ ln({vocab}) "
                f"= {math.log(vocab):.3f}): the comparison says nothing about the compression")
    if vocab and comp.nll > math.log(vocab):
        return (f"the compressed model is BROKEN: its NLL {comp.nll:.3f} nats/token is above ln({vocab}) = "
                f"{math.log(vocab):.3f}, worse than guessing uniformly over the vocabulary — compress less (lower "
                "--savings) or use --share auto with calibration")
    if max_ratio is not None and ratio > max_ratio:
        return (f"the compressed model is BROKEN by your --max-ratio {max_ratio:g}: its perplexity is {ratio:.2f}× "
                "the uncompressed model's")
    limit = f"within --max-ratio {max_ratio:g}" if max_ratio is not None else (
        f"better than uniform guessing (NLL {comp.nll:.3f} < ln({vocab}) = {math.log(vocab):.3f})" if vocab else
        "no vocabulary size to compare with")
    return f"the compressed model is usable: perplexity {ratio:.2f}× the uncompressed model's, {limit}"


# the top-level dispatcher's interface for ``weightgeom compress`` (``weightgeom eval``: weightgeom.analysis.eval_cli)
add_arguments, run = add_compress_arguments, run_compress

"""``weightgeom data``: prepare token datasets and inspect them.

weightgeom data prepare INPUT... --out DIR [--tokenizer gpt2|char] [--val-fraction 0.1] [--text-field text]
                                 [--encoding-errors strict|replace] [--force] [--quiet]
weightgeom data prepare --shakespeare --out DIR --tokenizer char
weightgeom data info DIR [--sample N]

Exit codes: 0 done; 2 bad input — one line on stderr naming the file, key or option at fault (a missing or
unsupported input, a text file that is not UTF-8, an existing output without --force, an output folder that cannot
be written, a dataset folder with a missing / empty / truncated .bin file, a bad meta.json, a meta.pkl that would run
code, token ids not below the vocabulary size). Nothing already in the output folder is changed by a failed prepare.
"""

from __future__ import annotations

import argparse
import sys

from weightgeom._cli_args import os_error_line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``prepare`` and ``info`` sub-subcommands."""
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION")
    p = sub.add_parser(
        "prepare",
        help="tokenise text / JSONL / parquet files or folders into train.bin + val.bin + meta.json",
        description="Tokenise text (.txt/.md), JSONL (.jsonl, field 'text'), parquet (column 'text') files or folders "
        "into nanoGPT-style train.bin/val.bin (tail split) and meta.json. Nothing is downloaded.",
    )
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="files or folders (recursively); .gz text/JSONL is read")
    p.add_argument("--shakespeare", action="store_true", help="use the bundled Shakespeare corpus as the input")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--tokenizer", choices=("gpt2", "char"), default="gpt2", help="GPT-2 BPE (offline) or characters")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of tokens (from the end) for val.bin")
    p.add_argument("--text-field", default="text", help="JSONL field / parquet column with the text (default: text)")
    p.add_argument("--encoding-errors", choices=("strict", "replace"), default="strict",
                   help="text/JSONL that is not UTF-8: refuse (strict, default) or replace bad bytes with U+FFFD")
    p.add_argument("--force", action="store_true", help="overwrite existing train.bin/val.bin/meta.json")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    i = sub.add_parser("info", help="describe a token dataset folder", description="Print a token dataset's metadata.")
    i.add_argument("path", help="folder with train.bin and val.bin")
    i.add_argument("--sample", type=int, default=200, help="decode this many leading train tokens (0: none)")


def _prepare(args: argparse.Namespace) -> int:
    from .corpora import shakespeare_text
    from .prepare import prepare, write_token_dataset

    if args.shakespeare and args.inputs:
        raise ValueError("give either INPUT files or --shakespeare, not both")
    if args.shakespeare:
        meta = write_token_dataset(
            lambda: [shakespeare_text()],
            args.out,
            args.tokenizer,
            args.val_fraction,
            force=args.force,
            progress=not args.quiet,
            extra_meta={"sources": ["shakespeare (shksprdata/texts/*_gut.txt)"]},
        )
    else:
        if not args.inputs:
            raise ValueError("no INPUT given (files or folders), or use --shakespeare")
        meta = prepare(
            args.inputs, args.out, args.tokenizer, args.val_fraction, args.text_field, args.force, not args.quiet,
            encoding_errors=args.encoding_errors,
        )
    print(
        f"wrote {args.out}: train {meta['train_tokens']:,} + val {meta['val_tokens']:,} tokens "
        f"({meta['dtype']}, vocab {meta['vocab_size']}, tokenizer {meta['tokenizer']}, {meta['documents']} documents)"
    )
    return 0


def _info(args: argparse.Namespace) -> int:
    from .tokens import TokenDataset

    ds = TokenDataset(args.path)
    largest = ds.check_token_ids()  # ids ≥ the recorded vocabulary: refused, naming the file
    print(ds)
    for k, v in ds.meta.items():
        if k != "tokenizer_config":
            print(f"  {k}: {v}")
    if not ds.meta and ds.vocab_source is not None:
        print(f"  vocab_size: {ds.vocab_size} (from {ds.vocab_source.name}, read as plain data)")
    print(f"  max token id: {largest}" + ("" if ds.vocab_size else " (no meta.json: vocabulary size unknown)"))
    tok = ds.tokenizer()
    if tok is not None and args.sample > 0:
        n = min(args.sample, ds.num_tokens("train"))
        print("  sample:", repr(tok.decode(ds.memmap("train")[:n].tolist())))
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``weightgeom data ACTION``; returns 0 on success, 2 on a usage or input error (one line on stderr)."""
    action = getattr(args, "data_command", None)
    if action is None:
        print("weightgeom data: choose an action: prepare | info (see weightgeom data --help)", file=sys.stderr)
        return 2
    try:
        return _prepare(args) if action == "prepare" else _info(args)
    except OSError as e:  # a missing input, an unwritable or full output folder, an unreadable file
        print(f"weightgeom data {action}: error: {os_error_line(e)}", file=sys.stderr)
        return 2
    except (ValueError, ImportError) as e:
        print(f"weightgeom data {action}: error: {e}", file=sys.stderr)
        return 2

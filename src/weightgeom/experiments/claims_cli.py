"""``weightgeom claims REPORT…``: the papers' claims table from the ``claims.json`` of one or more reports.

``weightgeom report`` writes ``claims.json`` next to each ``report.md``; this command merges them (a claim tested by
several sweeps is headed by its longest runs' finding) and prints the README's claims table, or writes it into a
README between its markers (``--readme``), writes the results page (``--page``) and the merged record
(``--record``). The repository's README table and ``docs/results.md`` are generated this way, so they cannot differ
from the reports.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``weightgeom claims``."""
    p.add_argument("reports", nargs="+", metavar="REPORT",
                   help="report directories (holding claims.json, as weightgeom report writes it), directories "
                        "above them, or claims.json files")
    p.add_argument("--record", default=None, metavar="FILE", help="write the merged findings to FILE (JSON)")
    p.add_argument("--readme", default=None, metavar="FILE",
                   help="replace the claims table between the markers in FILE (a README)")
    p.add_argument("--page", default=None, metavar="FILE", help="write the results page (markdown) to FILE")


def _reason(e: OSError) -> str:
    """The system's reason for an ``OSError`` without the path it names (``No space left on device (ENOSPC)``)."""
    from weightgeom._cli_args import os_error_line

    return os_error_line(OSError(e.errno, e.strerror or str(e)) if e.errno is not None else e)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``weightgeom claims``."""
    import json
    from pathlib import Path

    from weightgeom._files import distinct_outputs, read_text_bounded, write_atomic
    from weightgeom.experiments.report.claims_page import (
        CLAIMS_FILE,
        merge,
        read_claims,
        readme_table,
        record,
        replace_block,
        results_page,
    )
    from weightgeom.experiments.report.inputs import Problems

    writes = [(flag, value) for flag, value in (("--readme", args.readme), ("--page", args.page),
                                                  ("--record", args.record)) if value]
    try:
        distinct_outputs(writes)  # --readme X --page X would write the page over the whole README
    except ValueError as e:
        print(f"weightgeom claims: {e}", file=sys.stderr)
        return 2
    files: list[Path] = []
    for given in args.reports:
        p = Path(given)
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = sorted(p.rglob(CLAIMS_FILE))
            if not found:
                print(f"weightgeom claims: no {CLAIMS_FILE} under {given} (run weightgeom report on it first)",
                      file=sys.stderr)
                return 2
            files += found
        else:
            print(f"weightgeom claims: {given} does not exist", file=sys.stderr)
            return 2
    files = list({str(f.resolve()): f for f in files}.values())  # a file given twice is read once
    problems = Problems()
    found_all = [f for path in files for f in read_claims(path, problems)]
    for line in problems.lines[:10]:
        print(f"weightgeom claims: warning: {line}", file=sys.stderr)
    if len(problems.lines) > 10:
        print(f"weightgeom claims: warning: and {len(problems.lines) - 10} more", file=sys.stderr)
    if writes and not found_all:
        print(f"weightgeom claims: no finding could be read from {len(files)} claims.json; nothing written",
              file=sys.stderr)
        return 2
    for flag, value in writes:
        if Path(value).is_symlink() or Path(value).is_dir():
            what = "a symbolic link" if Path(value).is_symlink() else "a directory"
            print(f"weightgeom claims: {flag} {value} is {what}; give the file itself", file=sys.stderr)
            return 2
    merged = merge(found_all)
    table = readme_table(merged)
    contents = {}
    if args.readme:
        readme = Path(args.readme)
        try:  # a regular file only (a FIFO never blocks), bounded, UTF-8
            text = read_text_bounded(readme, what="--readme")
        except OSError as e:
            print(f"weightgeom claims: --readme {readme}: cannot read it ({_reason(e)})", file=sys.stderr)
            return 2
        except ValueError as e:  # a FIFO, device or directory, too large, not UTF-8: the reader names the path
            print(f"weightgeom claims: {e}; give the README (a UTF-8 text file) holding the claims-table markers",
                  file=sys.stderr)
            return 2
        try:
            contents["--readme"] = replace_block(text, table)
        except ValueError as e:
            print(f"weightgeom claims: --readme {readme}: {e}", file=sys.stderr)
            return 2
    if args.page:
        contents["--page"] = results_page(merged)
    if args.record:
        contents["--record"] = json.dumps(record(found_all), indent=1, ensure_ascii=False) + "\n"
    for flag, value in writes:
        try:
            write_atomic(Path(value), contents[flag])
        except OSError as e:  # write_atomic: the file named is left as it was
            print(f"weightgeom claims: {flag} {value}: cannot write it ({_reason(e)}); it is left as it was — free "
                  f"some space or choose a writable {flag}, then run the command again", file=sys.stderr)
            return 2
    if not (args.readme or args.page or args.record):
        print(table)
    tested = sum(bool(fs) for fs in merged.values())
    print(f"claims: {tested} of {len(merged)} tested, from {len(files)} claims.json", file=sys.stderr)
    return 0

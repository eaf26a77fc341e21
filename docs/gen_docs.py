"""Generators and checks for the documentation site (``mkdocs.yml``, ``docs/``); not part of the public API.

Two jobs, each with a command (run from a checkout, in its ``.venv``):

* ``docs/guarantees.md`` is generated from the hostile-input table of the tests (``tests/test_hostile.py``, rows in
  ``tests/hostile_cases/``): :func:`render_guarantees`. Regenerate it with
  ``.venv/bin/python docs/gen_docs.py guarantees --write``; ``tests/test_docs.py`` fails while it is stale.
* every public symbol (the names in ``__all__`` of each subpackage in :data:`API_PACKAGES`) has a docstring and an
  entry (``::: path``) on its subpackage's page ``docs/api/<name>.md``: :func:`api_problems`, run by the mkdocs hook
  ``docs/hooks.py`` (so ``mkdocs build --strict`` fails) and by ``tests/test_docs.py``;
  ``.venv/bin/python docs/gen_docs.py check-api`` prints the problems.

Needs the ``docs`` extra (griffe, through mkdocstrings) for the API check; the guarantees page needs the repository's
``tests/`` folder.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import importlib.util
import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["API_PACKAGES", "MATHJAX_SITE_PATH", "mathjax_script",
           "ROOT", "GUARANTEES_PATH", "REGENERATE_GUARANTEES", "AREAS", "render_guarantees",
           "public_symbols", "api_problems", "main"]

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (this file is ``docs/gen_docs.py`` of a checkout; it is not part of the installed package,
which never reads outside itself)."""

GUARANTEES_PATH = ROOT / "docs" / "guarantees.md"
"""Where the generated guarantees page lives."""

REGENERATE_GUARANTEES = ".venv/bin/python docs/gen_docs.py guarantees --write"
"""The one command that rewrites ``docs/guarantees.md`` from the hostile-input table."""

MATHJAX_SITE_PATH = "assets/mathjax/tex-svg-full.js"
"""Where the site serves MathJax from (mkdocs.yml's ``extra_javascript``; docs/hooks.py copies it there)."""


def mathjax_script() -> Path:
    """MathJax 3's ``tex-svg-full.js`` (TeX input, SVG output, every extension built in: it loads nothing more) from
    the installed ``django-static-mathjax`` package.

    Raises:
        FileNotFoundError: the package is not installed (it is in the ``docs`` extra).
    """
    spec = importlib.util.find_spec("mathjax")
    base = Path(spec.origin).parent if spec and spec.origin else None
    script = base / "static" / "mathjax" / "es5" / "tex-svg-full.js" if base else None
    if script is None or not script.is_file():
        raise FileNotFoundError("MathJax not found: the docs site serves its own copy from the django-static-mathjax "
                                'package — pip install -e ".[docs]"')
    return script


API_PACKAGES = ("optim", "manifolds", "linalg", "analysis", "diagnostics", "train", "models", "data")
"""Subpackages of ``weightgeom`` with a page in the API reference (``docs/api/<name>.md``)."""

AREAS: dict[str, tuple[str, str]] = {
    "loader": (
        "Model files (`weightgeom analyze`)",
        "Model files load as tensors only (safetensors, `torch.load(weights_only=True)`, GGUF). A file that would "
        "need Python's full unpickler is refused with one line naming it and the object it pickles, before anything "
        "in it runs. A FIFO, device, socket or directory where a file belongs is refused before anything blocks on "
        "it, and metadata files are read with a size bound.",
    ),
    "checkpoint": (
        "Checkpoints",
        "weightgeom's checkpoints hold tensors plus plain data and load with `torch.load(weights_only=True)`, "
        "optimizer state included; they are written atomically, and stale `.tmp` files of a killed writer are "
        "removed.",
    ),
    "rundir": (
        "Run directories (`weightgeom train`)",
        "One process writes a run directory at a time: a lock records the owner's pid, host and start time. "
        "`--fresh` moves an earlier run into `previous/<UTC time>/` inside it; nothing is deleted. A folder of your "
        "own files, or one holding other runs, is refused before anything in it is written or moved. Ctrl-C "
        "(exit 130) or SIGTERM (exit 143) marks a run failed and releases its lock.",
    ),
    "sweep": (
        "Sweeps (`weightgeom sweep`)",
        "One sweep writes a sweep directory at a time, and its workers die with it. A sweep re-run with other "
        "settings (recipe, config, `--steps`, `--set`) is refused with one line naming the first difference: it "
        "never reports old runs under new settings.",
    ),
    "optim": (
        "Optimizer steps (Python API)",
        "A step is all or nothing: `Muon` and `MagnitudeDirection` (eager and fused paths) check every group's "
        "gradients before any parameter or state changes and name the parameter with a NaN or Inf; parameters a "
        "step cannot handle, listed twice or changed under the state are refused by name; `load_state_dict` "
        "refuses a state dict that does not fit before loading any of it. The geometry is computed in IEEE float32 "
        "whatever `torch.set_float32_matmul_precision` asks for. These are library promises: the answer is an "
        "exception (the message is the one line), not an exit code, except where a row runs `weightgeom train`.",
    ),
    "data": (
        "Datasets (`weightgeom data`, training data)",
        "A dataset's nanoGPT `meta.pkl` is read as plain data, or refused. Token ids outside the vocabulary, "
        "broken dataset folders, text that is not UTF-8 and special files are refused before training with one "
        "line naming the file; a failed `data prepare` leaves an existing dataset byte for byte as it was.",
    ),
    "report": (
        "Reports (`weightgeom report`)",
        "A sweep directory may come from someone else: every value from its run and sweep files reaches `report.md` "
        "escaped, and every file weightgeom writes replaces a symbolic link planted at its name instead of writing "
        "through it. A file with values of the wrong type, special files and huge files are left out with one "
        "warning naming them, and the report still comes out.",
    ),
}
"""Area of a hostile-input row (``Hostile.area``) -> (section title, what holds in that area)."""

_INTRO = """\
# What weightgeom guarantees

<!-- Generated from tests/hostile_cases/ by `{command}`; do not edit by hand. -->

These promises hold for every command and for the Python API:

- **Bad input gets one clear line naming what is wrong, and exit code 2**, never a traceback. This covers config
  keys, file formats, token ids outside the vocabulary, run names that would escape the output directory, and
  unwritable or full disks.
- **Nothing already written is lost.** Files are written to a temporary file beside them and renamed into place (a
  symbolic link planted at the name is replaced, its target never written); earlier runs move to `previous/`, never
  deleted; a refused command leaves every file as it was.
- **Untrusted files never run code.** Model files, checkpoints and dataset metadata load as tensors or plain data
  only; a file that would need Python's full unpickler is refused, naming it, before anything in it runs.

Exit codes: 0 done, 2 bad input or I/O error, 3 diverged (`status.json` says why), 130 interrupted (Ctrl-C),
143 stopped by SIGTERM. See [Training](training.md) for run directories and [Experiments](experiments.md) for sweeps.

Each row below is one case of the hostile-input table in `tests/test_hostile.py` (the rows live in
`tests/hostile_cases/`), run with the rest of the test suite on every change:
`.venv/bin/python -m pytest -q tests/test_hostile.py -k ROW` runs one. *What weightgeom answers* quotes the parts of
the message the test checks (`…` where it names your file, key or value).
"""

# Where the promise begins in a row's sentence (outside parentheses): what comes before is what the user does.
_PROMISE = re.compile(
    r" (?:is|are)(?: each| still| then)? (?:refused|left out|replaced|removed|kept|skipped|read|loaded|analysed|"
    r"shown|one line)\b|(?<!constructor) (?:gets?|exits?|refuses|makes|trains|loads|stops|says|reports|unwinds|"
    r"takes|warns|leaves)\b|, writes\b|: "
)
_LEADING_VERB = re.compile(r"^(?:is|are|gets|get) ")


def _hostile_cases() -> list[Any]:
    """The rows of ``tests/test_hostile.py`` in its order (imports it with ``tests/`` on ``sys.path``)."""
    tests = ROOT / "tests"
    if not (tests / "test_hostile.py").is_file():
        raise FileNotFoundError(f"{tests / 'test_hostile.py'} not found: the guarantees page is generated from a "
                                "checkout of the repository")
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    return list(importlib.import_module("test_hostile").CASES)


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _text(node: ast.AST, values: dict[str, Any]) -> str | None:
    """A string literal (f-strings with ``…`` for their fields) or a closure variable holding a string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = [p.value if isinstance(p, ast.Constant) else "…" for p in node.values]
        return "".join(parts)
    if isinstance(node, ast.Name) and isinstance(values.get(node.id), str):
        return values[node.id]
    return None


class _Answer:
    """What a row's check asserts about weightgeom's answer, read from its source."""

    def __init__(self) -> None:
        self.stems: list[str] = []
        self.codes: list[int] = []  # exit codes of one-line errors
        self.raises: list[str] = []  # exception classes a Python-API row expects
        self.top_codes: list[int] = []  # `res.rc == N` in the row's own function

    def add_stem(self, s: str | None) -> None:
        if s and len(re.findall(r"\w", s)) >= 2 and s not in self.stems:
            self.stems.append(s)


def _module_functions(module: Any) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(inspect.getsource(module))
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _visit(node: ast.AST, funcs: dict[str, ast.FunctionDef], values: dict[str, Any], ans: _Answer,
           seen: set[str], depth: int) -> bool:
    """Collect from ``node`` (and the module's helpers it calls, up to ``depth``); True if it checks an answer."""
    found = False
    for n in ast.walk(node):
        if isinstance(n, ast.Compare) and depth == 3 and isinstance(n.left, ast.Attribute) and n.left.attr == "rc":
            for op, right in zip(n.ops, n.comparators):
                if isinstance(op, ast.Eq) and isinstance(right, ast.Constant) and isinstance(right.value, int):
                    ans.top_codes.append(right.value)
        if not isinstance(n, ast.Call):
            continue
        name = _call_name(n)
        if name == "assert_one_line_error":
            found = True
            for a in n.args[1:]:
                ans.add_stem(_text(a, values))
            rc = next((k.value for k in n.keywords if k.arg == "rc"), None)
            ans.codes.append(rc.value if isinstance(rc, ast.Constant) and isinstance(rc.value, int) else 2)
        elif name == "raises" and n.args:
            found = True
            exc = n.args[0]
            exc_name = exc.id if isinstance(exc, ast.Name) else exc.attr if isinstance(exc, ast.Attribute) else ""
            if exc_name and exc_name not in ans.raises:
                ans.raises.append(exc_name)
            for k in n.keywords:
                if k.arg == "match":
                    ans.add_stem(_text(k.value, values))
        elif name in funcs and name not in seen and depth > 0:
            if _visit(funcs[name], funcs, values, ans, seen | {name}, depth - 1):
                found = True
                for a in n.args:  # the strings a checking helper is handed are what it looks for
                    ans.add_stem(_text(a, values))
    return found


def _answer(case: Any) -> _Answer:
    """Read the message stems, exit codes and exceptions that ``case.check`` asserts."""
    fn: Callable = case.check
    while isinstance(fn, functools.partial):
        fn = fn.func
    values: dict[str, Any] = {}
    if getattr(fn, "__closure__", None):
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__):
            try:
                values[var] = cell.cell_contents
            except ValueError:  # an empty cell
                pass
    ans = _Answer()
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        funcs = _module_functions(sys.modules[fn.__module__])
    except (OSError, TypeError, SyntaxError):
        return ans
    _visit(tree, funcs, values, ans, {fn.__name__}, 3)
    return ans


def _cell(text: str) -> str:
    """Markdown table cell: no line breaks, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _code(stem: str) -> str:
    stem = " ".join(stem.split())
    return f"`` {stem} ``" if "`" in stem else f"`{stem}`"


def _split(what: str) -> tuple[str, str]:
    """A row's sentence as (what the user does, the promise)."""
    for m in _PROMISE.finditer(what):
        before = what[:m.start()]
        if m.start() > 0 and before.count("(") == before.count(")"):
            break
    else:
        return _capital(what), ""
    promise = _LEADING_VERB.sub("", what[m.start():].lstrip(",: ").strip())
    return _capital(before.rstrip(",")), _capital(promise)


def _capital(text: str) -> str:
    """``text`` with a capital first letter where its first word is a plain lower-case word (not ``torch.x``)."""
    first = text.split(" ", 1)[0].rstrip(",")
    return text[:1].upper() + text[1:] if re.fullmatch(r"[a-z]+", first) else text


def _exit(ans: _Answer, what: str) -> str:
    """The exit code(s) a row promises: its one-line errors' (2 unless stated) and any its sentence names."""
    codes = set(ans.codes) | {int(c) for c in re.findall(r"\bexits? (?:code )?(\d+)", what)}
    if codes:
        return ", ".join(str(c) for c in sorted(codes))
    if ans.raises:
        return "— (raises)"
    if 0 in ans.top_codes:
        return "0"
    return ", ".join(str(c) for c in sorted(set(ans.top_codes))) or "—"


def _row(case: Any) -> str:
    ans = _answer(case)
    does, promise = _split(case.what)
    if not promise and case.what.lower().startswith("the same"):
        promise = "As in the row above."
    answer = promise if not promise or promise[-1] in ".!)" else promise + "."
    if ans.raises:
        answer += f" Raises {', '.join(f'`{e}`' for e in ans.raises)}."
    stems = [s for s in ans.stems if "|" not in s]
    if stems:
        answer += f" The message contains {', '.join(_code(s) for s in stems)}."
    return f"| `{case.area}-{case.id}` | {_cell(does)} | {_cell(answer.strip()) or '—'} | {_exit(ans, case.what)} |"


def render_guarantees(cases: Sequence[Any] | None = None) -> str:
    """The markdown page ``docs/guarantees.md``: the promises, then one table per area of the hostile-input table.

    Args:
        cases: the rows (``Hostile`` objects); None: every row of ``tests/test_hostile.py``.

    Returns:
        The page, ending in one newline.

    Raises:
        ValueError: a row's area has no entry in :data:`AREAS`.
    """
    cases = _hostile_cases() if cases is None else list(cases)
    unknown = sorted({c.area for c in cases} - set(AREAS))
    if unknown:
        raise ValueError(f"hostile-input area(s) {unknown} have no section: add them to docs/gen_docs.py's AREAS")
    out = [_INTRO.format(command=REGENERATE_GUARANTEES)]
    for area, (title, summary) in AREAS.items():
        rows = [c for c in cases if c.area == area]
        if not rows:
            continue
        out += [f"## {title}", "", summary, "",
                "| row | what you do | what weightgeom answers | exit code |", "|---|---|---|---|"]
        out += [_row(c) for c in rows]
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


@functools.lru_cache(maxsize=1)
def _loader() -> Any:
    """One griffe loader over this checkout's ``src`` per process (loading the package takes seconds)."""
    import griffe

    return griffe.GriffeLoader(search_paths=[str(ROOT / "src")], docstring_parser="google")


def _api_page(package: str, docs_dir: Path) -> Path:
    return docs_dir / "api" / f"{package}.md"


def public_symbols(package: str, loader: Any = None) -> dict[str, Any]:
    """The public names of ``weightgeom.<package>`` (its ``__all__``) -> their griffe objects (aliases resolved).

    Lazy exports (``weightgeom._lazy``) are found in their submodules, and a name shadowed by a submodule of the
    same name (``weightgeom.linalg.msign``) is the function, as at runtime.

    Args:
        package: a subpackage name such as ``"optim"``.
        loader: a ``griffe.GriffeLoader`` to use (None: this process's loader over this checkout's ``src``).

    Returns:
        name -> griffe object, or -> the string saying why it could not be found.
    """
    import griffe

    loader = _loader() if loader is None else loader
    module = importlib.import_module(f"weightgeom.{package}")
    lazy = module.__dict__.get("_lazy_exports", {})
    pkg = loader.load(f"weightgeom.{package}")
    out: dict[str, Any] = {}
    for name in module.__all__:
        try:
            getattr(module, name)
        except AttributeError as e:
            out[name] = f"weightgeom.{package}.__all__ names {name!r}, which does not exist ({e})"
            continue
        try:
            if name in lazy:
                path = f"{importlib.util.resolve_name(lazy[name], module.__name__)}.{name}"
                obj = loader.modules_collection.get_member(path)
            else:
                obj = pkg.members[name]
            if obj.is_alias:
                obj = obj.final_target
            if obj.is_module and name in obj.members:  # the submodule of the same name: its public object
                obj = obj.members[name]
                obj = obj.final_target if obj.is_alias else obj
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError) as e:
            out[name] = f"weightgeom.{package}.{name}: not found by the documentation's static loader ({e!r})"
            continue
        out[name] = obj
    return out


_DIRECTIVE = re.compile(r"^:::\s+(\S+)", re.MULTILINE)


def api_problems(docs_dir: Path | None = None) -> list[str]:
    """Every public symbol without a docstring or without an entry in the API reference, one line each.

    A symbol is documented when its page ``docs/api/<package>.md`` has a ``::: PATH`` line for it: its public path
    (``weightgeom.optim.Muon``) or the path of its definition (``weightgeom.optim.muon.Muon``).

    Args:
        docs_dir: the mkdocs ``docs_dir`` (None: this checkout's ``docs``).

    Returns:
        The problems (empty when all is well).
    """
    docs_dir = ROOT / "docs" if docs_dir is None else Path(docs_dir)
    loader = _loader()
    problems: list[str] = []
    for package in API_PACKAGES:
        page = _api_page(package, docs_dir)
        listed = set(_DIRECTIVE.findall(page.read_text(encoding="utf-8"))) if page.is_file() else set()
        if not page.is_file():
            problems.append(f"{page}: missing (the API page of weightgeom.{package})")
        for name, obj in public_symbols(package, loader).items():
            if isinstance(obj, str):
                problems.append(obj)
                continue
            public = f"weightgeom.{package}.{name}"
            if not (obj.docstring and obj.docstring.value.strip()):
                problems.append(f"{public} ({obj.path}) has no docstring")
            if page.is_file() and not listed & {public, obj.path}:
                problems.append(f"{public} is missing from the API reference: add '::: {obj.path}' to "
                                f"{page.relative_to(docs_dir.parent) if docs_dir.parent in page.parents else page}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """``python docs/gen_docs.py guarantees [--write]`` | ``check-api``.

    Returns:
        The exit code: 0, or 1 when ``check-api`` finds problems.
    """
    parser = argparse.ArgumentParser(prog="python docs/gen_docs.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("guarantees", help="print docs/guarantees.md (or --write it)")
    g.add_argument("--write", action="store_true", help=f"write {GUARANTEES_PATH.relative_to(ROOT)}")
    sub.add_parser("check-api", help="list public symbols without a docstring or an API-reference entry")
    args = parser.parse_args(argv)
    if args.command == "guarantees":
        page = render_guarantees()
        if args.write:
            GUARANTEES_PATH.write_text(page, encoding="utf-8")
            print(f"wrote {GUARANTEES_PATH.relative_to(ROOT)}", file=sys.stderr)
        else:
            sys.stdout.write(page)
        return 0
    problems = api_problems()
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

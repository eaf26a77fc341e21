"""The code base stays ``ruff`` clean (configuration in pyproject.toml)."""

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    exe = Path(sys.executable).with_name("ruff")  # the test environment's own ruff first
    exe = str(exe) if exe.exists() else shutil.which("ruff")
    assert exe is not None, "ruff is missing: it is a test dependency (pip install -e '.[test]')"
    out = subprocess.run([exe, "check", "--no-cache", "src", "tests"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# CLI modules import the package's heavy modules inside run(): building the parser must not import torch.
_CLI_FILES = ("cli.py", "benchmarks_cli.py", "report_cli.py", "claims_cli.py", "compress_cli.py", "eval_cli.py",
              "demo.py")
# The optimizer core (docs/ARCHITECTURE.md: linalg → manifolds → optim → kernels) must not reach up into these.
_ABOVE_CORE = ("train", "experiments", "analysis", "diagnostics", "data", "models", "benchmarks")
_CORE = ("linalg", "manifolds", "optim", "kernels")


def _package_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported weightgeom module, inside a function) for every import of the package in ``path``."""
    import ast

    tree = ast.parse(path.read_text(), str(path))
    pkg = path.relative_to(ROOT / "src").parent.parts
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((child.lineno, a.name, in_function) for a in child.names if a.name.startswith("weightgeom"))
            elif isinstance(child, ast.ImportFrom):
                mod = child.module or ""
                if child.level:
                    mod = ".".join([*pkg[:len(pkg) - child.level + 1], *([mod] if mod else [])])
                if mod.startswith("weightgeom"):
                    out.append((child.lineno, mod, in_function))
            visit(child, inner)

    visit(tree, False)
    return out


def test_package_imports_sit_at_module_top_and_follow_the_layers():
    """No import of the package inside a function outside the CLI modules (a lazy import hides a dependency, e.g.
    an optimizer reaching into the trainer), and the optimizer core never imports the layers above it."""
    lazy, upward = [], []
    for path in sorted((ROOT / "src" / "weightgeom").rglob("*.py")):
        rel = path.relative_to(ROOT / "src" / "weightgeom")
        for line, mod, in_function in _package_imports(path):
            where = f"{rel}:{line} imports {mod}"
            if in_function and path.name not in _CLI_FILES:
                lazy.append(where)
            parts = mod.split(".")
            if rel.parts[0] in _CORE and len(parts) > 1 and parts[1] in _ABOVE_CORE:
                upward.append(where)
    assert not lazy, "imports inside functions:\n" + "\n".join(lazy)
    assert not upward, "the optimizer core imports a layer above it:\n" + "\n".join(upward)


# ------------------------------------------------------------------------------------------- the module graph
# The layers of docs/ARCHITECTURE.md, lowest first: a module imports only from its own layer or lower ones. The
# package's top-level modules named ``_x`` (and schema.py) are internal helpers every layer may use; models/ and
# data/ sit beside linalg/. ``cli.py``, ``benchmarks_cli.py``, ``__main__.py`` and ``benchmarks/`` are the top: no
# library module imports them.
_LAYERS = {"kernels": 1, "linalg": 2, "models": 2, "data": 2, "manifolds": 3, "optim": 4, "diagnostics": 5,
           "train": 6, "analysis": 7, "experiments": 8, "benchmarks": 9, "benchmarks_cli": 9, "cli": 9, "__main__": 9}
_TOP = frozenset({"benchmarks", "benchmarks_cli", "cli", "__main__"})
_STRING_MODULE = re.compile(r"^(weightgeom(?:\.[A-Za-z_]\w*)+)(?::[A-Za-z_]\w*)?$")


@functools.lru_cache(maxsize=1)
def _modules() -> dict[str, Path]:
    """Dotted name → file of every Python module of the package."""
    out = {}
    for path in sorted((ROOT / "src" / "weightgeom").rglob("*.py")):
        rel = path.relative_to(ROOT / "src").with_suffix("")
        out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    return out


def _lazy_exports(package: str) -> dict[str, str]:
    """A package's lazily exported names → the dotted module each comes from (``weightgeom._lazy``)."""
    import importlib.util

    exports = importlib.import_module(package).__dict__.get("_lazy_exports", {})
    return {name: importlib.util.resolve_name(mod, package) for name, mod in exports.items()}


def _owner(module: str) -> str:
    """The subpackage (or top-level module) a dotted module belongs to: ``weightgeom.optim.muon`` → ``optim``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@functools.lru_cache(maxsize=1)
def _edges() -> tuple[tuple[str, str, int, str, tuple[str, ...]], ...]:
    """(importer, imported module, line, how, names) for every dependency of one package module on another: ``import``
    statements anywhere (inside functions too, not under ``if TYPE_CHECKING``: how = "import"), and string constants
    naming a module (``"weightgeom.x.y"`` or ``"weightgeom.x.y:attr"``, imported by name at run time: how = "string").
    A name imported from a package that exports it lazily is an edge to the submodule it comes from."""
    import ast

    mods = _modules()
    lazy = {m: _lazy_exports(m) for m, p in mods.items() if p.name == "__init__.py"}

    def resolve(name: str) -> str:
        while name not in mods and "." in name:
            name = name.rpartition(".")[0]
        return name

    out = []
    for mod, path in mods.items():
        pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]

        def visit(node: ast.AST, mod=mod, pkg=pkg) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue  # annotations only: no import at run time
                if isinstance(child, ast.Import):
                    out.extend((mod, resolve(a.name), child.lineno, "import", ()) for a in child.names
                               if a.name.startswith("weightgeom"))
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        base = ".".join([*pkg[:len(pkg) - child.level + 1], *([base] if base else [])])
                    if base.startswith("weightgeom"):
                        for a in child.names:
                            full = f"{base}.{a.name}"
                            target = full if full in mods else lazy.get(base, {}).get(a.name, resolve(base))
                            out.append((mod, target, child.lineno, "import", (a.name,)))
                elif isinstance(child, ast.Constant) and isinstance(child.value, str):
                    m = _STRING_MODULE.match(child.value)
                    if m and m.group(1) in mods and m.group(1) != mod:
                        out.append((mod, m.group(1), child.lineno, "string", ()))
                visit(child)

        visit(ast.parse(path.read_text(), str(path)))
    return tuple(out)


def _where(importer: str, line: int) -> str:
    return f"{_modules()[importer].relative_to(ROOT / 'src' / 'weightgeom')}:{line}"


def test_no_private_name_crosses_a_subpackage():
    """A subpackage's private names (``_foo``, and modules named ``_foo`` inside it) are its own: another subpackage
    imports only public names. The package's top-level ``_x`` modules are internal to the package, shared by all."""
    bad = []
    for importer, target, line, how, names in _edges():
        if how != "import" or _owner(importer) == _owner(target):
            continue
        private = [p for p in target.split(".")[2:] if p.startswith("_") and not p.startswith("__")]
        private += [n for n in names if n.startswith("_") and not n.startswith("__")]
        if private:
            bad.append(f"{_where(importer, line)} imports {', '.join(private)} from {target}")
    assert not bad, "private names imported across subpackages (make them public in their module):\n" + "\n".join(bad)


def test_every_import_follows_the_layers():
    """Each module imports (by statement or by name in a string) only from its own layer or lower ones
    (docs/ARCHITECTURE.md); no library module imports ``benchmarks/`` or ``cli.py``. A package's ``__init__``
    façade may name what its own submodules define (``weightgeom/__init__.py`` exports ``msign`` lazily)."""
    bad = []
    for importer, target, line, how, _ in _edges():
        a, b = _owner(importer), _owner(target)
        if importer == "weightgeom":
            continue
        upward = _LAYERS.get(b, 0) > _LAYERS.get(a, 0)
        if upward or (b in _TOP and a not in _TOP):
            by = " by name" if how == "string" else ""
            bad.append(f"{_where(importer, line)} ({a or 'top'}) imports {target} ({b}){by}")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def test_cycle_finder_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_visible_or_by_name():
    """No two modules depend on each other, counting imports inside functions and modules imported by a name in a
    string (``importlib.import_module("weightgeom...")``, a ``"module:attribute"`` registry entry)."""
    graph: dict[str, set[str]] = {}
    for importer, target, _, _, _ in _edges():
        if importer != target:
            graph.setdefault(importer, set()).add(target)
    assert not _cycles(graph), "import cycles:\n" + "\n".join(" ↔ ".join(c) for c in _cycles(graph))


def _architecture_tree() -> dict[str, str]:
    """Path (relative to src/weightgeom) → role, from the module tree at the top of docs/ARCHITECTURE.md: each
    package a line ``NAME/`` and each module a line ``NAME.py  role`` (or ``.c``), indented two spaces per level
    below ``src/weightgeom/``; a role's continuation lines are indented further."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("```\nsrc/weightgeom/\n", 1)[1].split("```", 1)[0]
    entries: dict[str, str] = {}
    stack: list[str] = []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        name, _, role = line.strip().partition(" ")
        if indent % 2 or not 2 <= indent <= 2 * (len(stack) + 1):
            continue  # a role's continuation line
        depth = indent // 2 - 1
        if name.endswith("/"):
            stack[depth:] = [name.rstrip("/")]
        elif name.endswith((".py", ".c")):
            entries["/".join([*stack[:depth], name])] = role.strip()
            del stack[depth:]
    return entries


def test_architecture_names_every_module():
    """docs/ARCHITECTURE.md's tree names every module of the package (Python and C) with its one-line role, and
    nothing that is not there."""
    src = ROOT / "src" / "weightgeom"
    on_disk = {str(p.relative_to(src)) for ext in ("py", "c") for p in src.rglob(f"*.{ext}")}
    named = _architecture_tree()
    missing, gone = sorted(on_disk - set(named)), sorted(set(named) - on_disk)
    assert not missing, f"modules docs/ARCHITECTURE.md does not name (add a line with its role): {missing}"
    assert not gone, f"docs/ARCHITECTURE.md names modules that are not there: {gone}"
    assert not [p for p, role in named.items() if not role], "modules named without a role"

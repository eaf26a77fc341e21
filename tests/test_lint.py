"""The code base stays ``ruff`` clean (configuration in pyproject.toml)."""

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

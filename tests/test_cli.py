"""The command line as an installed package runs it: `--help`/`--version` without torch, data found in the package.

What a plain (non-editable) ``pip install`` needs: every file a command reads (trainer configs, experiment presets,
C kernels, benchmarks) ships inside the ``weightgeom`` package and is looked up there, never next to a source
checkout or in the current directory. ``.ci/wheel_check.sh`` builds and installs a real wheel and runs the commands
from outside the checkout; these tests are the fast in-process part.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
import importlib.metadata
import importlib.resources
import json
import subprocess
import sys
from pathlib import Path

import pytest

from weightgeom import benchmarks_cli, cli

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "weightgeom"

# Every subcommand's --help, and a few options each must keep listing.
HELP_CASES: dict[tuple[str, ...], tuple[str, ...]] = {
    (): ("--version", "demo", "train", "sweep", "report", "analyze", "bench", "data"),
    ("demo",): ("--quick", "--out", "--only", "--verbose", "--jobs", "--set"),
    ("train",): ("--set", "--resume", "--out", "--fresh", "--no-progress", "--list", "--print-config"),
    ("sweep",): ("manifolds", "continuity", "md", "--seeds", "--steps", "--out", "--only", "--set", "--no-resume",
                 "--no-report", "--list", "--quiet", "--jobs", "--threads"),
    ("report",): ("RUN_DIR", "--out", "--title"),
    ("analyze",): ("--out", "--roles", "--metrics", "--method", "--reference", "--check-svd", "--no-plots",
                   "--gguf-keep-permutation", "--threads", "--quiet", "cv", "gram", "idx"),
    ("bench",): ("optimizer_step", "md_overhead", "train_throughput", "analysis_speed", "analysis_scale"),
    ("data",): ("prepare", "info"),
    ("data", "prepare"): ("--out", "--tokenizer"),
    ("data", "info"): (),
}

_HELP_PROBE = """
import json, sys
from weightgeom.cli import main
try:
    main(json.loads(sys.argv[1]))
except SystemExit as e:
    code = e.code
else:
    code = 'returned'
heavy = sorted(m for m in ('torch', 'numpy', 'pandas', 'matplotlib') if m in sys.modules)
print(json.dumps({'code': code, 'heavy': heavy}))
"""


def _probe(argv: list[str], cwd: Path) -> tuple[str, dict]:
    """Run ``cli.main(argv)`` in a fresh interpreter; its printed text and ``{"code", "heavy"}``."""
    out = subprocess.run([sys.executable, "-c", _HELP_PROBE, json.dumps(argv)], cwd=cwd, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text, _, last = out.stdout.rstrip("\n").rpartition("\n")
    return text, json.loads(last)


@pytest.mark.parametrize("sub", list(HELP_CASES), ids=lambda s: " ".join(s) or "weightgeom")
def test_help_is_complete_and_imports_no_torch(sub, tmp_path):
    text, res = _probe([*sub, "--help"], tmp_path)
    assert res == {"code": 0, "heavy": []}, (sub, res)
    assert text.startswith(f"usage: {' '.join(['weightgeom', *sub])}"), text[:200]
    missing = [opt for opt in HELP_CASES[sub] if opt not in text]
    assert not missing, f"weightgeom {' '.join(sub)} --help lacks {missing}"


def test_version_prints_the_installed_version_without_torch(tmp_path):
    text, res = _probe(["--version"], tmp_path)
    assert res == {"code": 0, "heavy": []}
    import weightgeom

    # one definition: the distribution's version (pyproject reads weightgeom.__version__) is the package's
    assert importlib.metadata.version("weightgeom") == weightgeom.__version__
    assert text.startswith(f"weightgeom {weightgeom.__version__} (torch {importlib.metadata.version('torch')}, ")


def test_version_in_process(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == cli.version_line() + "\n"


def test_importing_the_packages_imports_no_torch_but_their_names_still_work(tmp_path):
    code = """
import sys
import weightgeom, weightgeom.train, weightgeom.data, weightgeom.analysis, weightgeom.benchmarks
assert 'torch' not in sys.modules, 'importing the packages imported torch'
from weightgeom import msign
from weightgeom.train import load_config, train
import weightgeom.data.mnist      # binds submodules on weightgeom.data, prepare among them (imported by mnist)
import weightgeom.data.prepare
from weightgeom.data import prepare, TokenDataset
from weightgeom.analysis import analyze, METRICS, write_report
assert callable(prepare) and callable(msign) and callable(train) and callable(analyze), (prepare, msign)
assert weightgeom.data.prepare is prepare  # the function, as with eager imports, not the submodule
assert METRICS == ('cv', 'cu', 'gram', 'idx')
assert set(weightgeom.data.__all__) <= set(dir(weightgeom.data))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_lazy_package_names_resolve_to_their_definitions():
    for pkg in ("weightgeom", "weightgeom.train", "weightgeom.data", "weightgeom.analysis"):
        mod = importlib.import_module(pkg)
        for name in mod.__all__:
            assert getattr(mod, name) is not None, f"{pkg}.{name}"
        with pytest.raises(AttributeError, match="no_such_name"):
            mod.no_such_name  # noqa: B018


# ---- data shipped in the package --------------------------------------------------------------------------------
def _shipped_presets() -> list[str]:
    d = importlib.resources.files("weightgeom.experiments").joinpath("presets")
    return sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".toml"))


def test_every_preset_is_found_in_the_package_from_any_directory(tmp_path, monkeypatch):
    from weightgeom.experiments.cli import RECIPES, get_recipe
    from weightgeom.experiments.runner import resolve_preset, sweep_presets

    monkeypatch.chdir(tmp_path)  # nothing may depend on the current directory
    (tmp_path / "configs" / "experiments").mkdir(parents=True)
    shipped = _shipped_presets()
    assert {"md-ci", "manifolds-ci", "continuity-ci", "continuity-cpu", "manifolds-tiny-shakespeare"} <= set(shipped)
    assert sweep_presets() == shipped
    presets_dir = Path(str(importlib.resources.files("weightgeom.experiments").joinpath("presets"))).resolve()
    for name in shipped:
        label, path = resolve_preset(name)
        assert Path(path).resolve() == presets_dir / f"{name}.toml", name
    for recipe in RECIPES:  # the short names: `weightgeom sweep md ci`, the recipes' defaults, the demo's presets
        for short in ("ci", get_recipe(recipe).default_config):
            _, path = resolve_preset(short, recipe)
            assert Path(path).resolve().parent == presets_dir, (recipe, short, path)
            assert Path(path).stem in (f"{recipe}-{short}", short)


def test_trainer_configs_and_benchmarks_are_found_in_the_package(tmp_path, monkeypatch, capsys):
    from weightgeom.train.config import bundled_configs, resolve_config_path

    monkeypatch.chdir(tmp_path)
    configs = importlib.resources.files("weightgeom").joinpath("configs")
    shipped = sorted(p.name.rsplit(".", 1)[0] for p in configs.iterdir() if p.name.endswith((".toml", ".yaml")))
    assert bundled_configs() == shipped and "tiny-shakespeare" in shipped
    for name in shipped:
        assert Path(resolve_config_path(name)).resolve().parent == Path(str(configs)).resolve()
    assert benchmarks_cli.available() == ["analysis_scale", "analysis_speed", "gpu_check", "md_overhead",
                                          "optimizer_step", "train_throughput"]
    assert cli.main(["bench"]) == 0
    assert "optimizer_step" in capsys.readouterr().out
    assert not (ROOT / "benchmarks").exists(), "benchmarks live in src/weightgeom/benchmarks (shipped in the wheel)"


def test_package_data_globs_cover_every_data_file():
    """Every non-Python file in the package is matched by pyproject's package-data, so the wheel carries it."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["weightgeom"]
    files = [p.relative_to(PKG).as_posix() for p in PKG.rglob("*")
             if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert any(f.startswith("experiments/presets/") for f in files)
    unshipped = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert not unshipped, f"not in [tool.setuptools.package-data] of pyproject.toml: {unshipped}"
    subpackages = {p.parent for p in PKG.rglob("*.py")} - {p.parent for p in PKG.rglob("__init__.py")}
    assert not subpackages, f"folders with modules but no __init__.py (left out of the wheel): {sorted(subpackages)}"


def _file_relative_depth(node: ast.AST) -> int | None:
    """How many directory levels ``node`` climbs from the module's own file when it is built on ``__file__``
    (``Path(__file__).parent.parent`` -> 2, ``Path(__file__).resolve().parents[2]`` -> 3,
    ``os.path.dirname(__file__)`` -> 1); None when it is not such an expression."""
    if isinstance(node, ast.Name):
        return 0 if node.id == "__file__" else None
    if isinstance(node, ast.Attribute):
        inner = _file_relative_depth(node.value)
        if inner is None:
            return None
        return inner + 1 if node.attr == "parent" else inner
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents":
        inner = _file_relative_depth(node.value.value)
        if inner is None or not isinstance(node.slice, ast.Constant) or not isinstance(node.slice.value, int):
            return None
        return inner + node.slice.value + 1
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in ("Path", "resolve", "absolute", "abspath", "realpath") and (
                node.args or isinstance(func, ast.Attribute)):
            return _file_relative_depth(node.args[0] if node.args else func.value)
        if name == "dirname" and node.args:
            inner = _file_relative_depth(node.args[0])
            return None if inner is None else inner + 1
    return None


def _outermost_file_paths(tree: ast.AST):
    """``(node, depth)`` for each ``__file__``-based path expression, outermost only."""
    seen: set[int] = set()
    for node in ast.walk(tree):
        if id(node) in seen:
            continue
        depth = _file_relative_depth(node)
        if depth is not None and not isinstance(node, ast.Name):
            for sub in ast.walk(node):
                seen.add(id(sub))
            yield node, depth


def test_no_code_reads_outside_the_package():
    """No module reaches above ``src/weightgeom`` from its own file (a source checkout's folders are not installed),
    and none looks in the current directory for files the package ships."""
    climbing, cwd = [], []
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        levels_to_pkg_root = len(path.relative_to(PKG).parts)  # src/weightgeom/x.py: 1; train/config.py: 2
        for node, depth in _outermost_file_paths(tree):
            if depth > levels_to_pkg_root:
                climbing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "cwd", "getcwd"):
                cwd.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not climbing, "paths above the package (missing from a wheel install):\n" + "\n".join(climbing)
    assert not cwd, "current-directory lookups (data must come from the package):\n" + "\n".join(cwd)


def test_the_path_check_sees_the_patterns_it_guards_against():
    """The detector above recognises the forms it must refuse (so the test can fail)."""
    cases = {"Path(__file__).resolve().parents[2] / 'benchmarks'": 3, "Path(__file__).parent.parent / 'configs'": 2,
             "os.path.dirname(os.path.dirname(os.path.abspath(__file__)))": 2, "Path(__file__).parent": 1}
    for src, depth in cases.items():
        found = list(_outermost_file_paths(ast.parse(src)))
        assert [d for _, d in found] == [depth], (src, found)


@pytest.mark.parametrize("argv", [["bench", "no_such_benchmark"], ["bench", "../optimizer_step"]])
def test_bench_unknown_name_is_one_line_exit_2(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown benchmark" in err[0]


def test_bench_runs_a_shipped_benchmark_from_another_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out_json = tmp_path / "md.json"
    code = cli.main(["bench", "md_overhead", "--base", "adamw", "--adamw-impl", "default", "--md-path", "eager",
                     "--iters", "1", "--warmup", "0", "--layers", "1", "--device", "cpu", "--json", str(out_json)])
    assert code == 0, capsys.readouterr().err
    assert json.loads(out_json.read_text())


def test_gpu_check_refuses_without_cuda_and_names_the_cpu_smoke_run(capsys, monkeypatch):
    """`weightgeom bench gpu_check` on a machine without CUDA: one line, exit 2 (the GPU script is not silently run on
    the CPU)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "gpu_check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0] and "--device cpu" in err[0]


def test_gpu_check_kills_a_hung_section_and_repeats_the_verdicts(tmp_path, capsys, monkeypatch):
    """A section past --section-timeout is killed and counted failed while the next still runs (a GPU lease must not
    be eaten by one hung benchmark); every target line and test count is repeated in the closing summary."""
    import sys

    from weightgeom.benchmarks import gpu_check

    py = sys.executable
    monkeypatch.setattr(gpu_check, "_sections", lambda device, iters, tests, markdown=None: [
        ("hangs", [py, "-c", "import time; print('started', flush=True); time.sleep(60)"]),
        ("reports", [py, "-c", "print('ratio 0.4  (target ≤ 1: met)'); print('3 passed, 1 skipped in 2.0s')"]),
    ])
    log = tmp_path / "check.log"
    assert gpu_check.main(["--device", "cpu", "--section-timeout", "2", "--log", str(log)]) == 1
    out = capsys.readouterr().out
    assert "-- hangs: exit -9" in out and "killed after --section-timeout 2 s" in out
    summary = out.split("== summary: targets and test results ==", 1)[1]
    assert "[reports] ratio 0.4  (target ≤ 1: met)" in summary and "[reports] 3 passed, 1 skipped" in summary
    assert "1 section(s) failed: hangs" in summary and log.read_text().count("== summary") == 1


def test_gpu_check_times_compiled_steps_and_writes_the_docs_blocks():
    """On CUDA, gpu_check's optimizer-step, MD-overhead and throughput sections time eager and compiled steps side by
    side, and with --markdown each writes its table into the file (docs/benchmarks.md is one command away)."""
    from weightgeom.benchmarks import gpu_check

    sections = dict(gpu_check._sections("cuda", 10, None, "docs/benchmarks.md"))
    timed = [cmd for cmd in sections.values() if "bench" in cmd]
    names = {cmd[cmd.index("bench") + 1] for cmd in timed if "--markdown" in cmd}
    assert names == {"optimizer_step", "md_overhead", "train_throughput"}
    assert all("--compiled" in cmd for cmd in timed), timed
    assert not any("--markdown" in cmd for cmd in dict(gpu_check._sections("cuda", 10, None)).values())


@pytest.mark.parametrize("argv,needle", [
    (["sweep", "manifolds", "ci", "--steps", "0"], "argument --steps: expected a positive integer"),
    (["sweep", "manifolds", "ci", "--launcher", "bogus"], "argument --launcher: invalid choice"),
    (["analyze", "x", "--gram", "bogus"], "argument --gram: invalid choice"),
    (["train", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_argument_errors_are_one_line_with_exit_2(argv, needle, capsys):
    """A bad flag is one line naming it and pointing at --help (not argparse's usage block, then the error)."""
    from weightgeom.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and needle in err[0] and "--help)" in err[0], err


def test_bench_markdown_block_replaces_its_own_block_and_keeps_the_page(tmp_path, monkeypatch, capsys):
    """`--markdown FILE` puts the benchmark's table, its device kind and the command that reproduces it between
    markers; a second run replaces that block and leaves the rest of the page (docs/benchmarks.md) as it was."""
    monkeypatch.chdir(tmp_path)
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nhand-written text\n")
    argv = ["bench", "md_overhead", "--base", "adamw", "--adamw-impl", "foreach", "--md-path", "eager", "--iters",
            "1", "--warmup", "0", "--layers", "1", "--device", "cpu", "--markdown", str(page)]
    assert cli.main(argv) == 0
    first = page.read_text()
    assert first.startswith("# Benchmarks\n\nhand-written text\n\n<!-- bench md_overhead on CPU ")
    assert "`weightgeom bench md_overhead --base adamw --adamw-impl foreach --md-path eager --iters 1" in first
    assert "--markdown" not in first and "| adamw(foreach) | eager | 4 | 7.1M |" in first
    assert "markdown: appended to" in capsys.readouterr().out
    assert cli.main(argv) == 0
    second = page.read_text()
    assert second.count("<!-- bench md_overhead on CPU ") == 1 and second.startswith("# Benchmarks\n\nhand-written")
    assert "markdown: replaced its block in" in capsys.readouterr().out


def test_an_old_config_key_is_named_with_its_new_spelling_on_one_line(capsys):
    """Python hides library DeprecationWarnings outside __main__; the CLI shows weightgeom's own, one line each."""
    rc = cli.main(["train", "tiny-shakespeare", "--print-config", "--set", "optim.muon.dual_steps=3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 0
    assert err == ["weightgeom train: deprecated: config key optim.muon.dual_steps is deprecated; use "
                   "optim.muon.dual.steps=3 (a [optim.muon.dual] table in a file)"]

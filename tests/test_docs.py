"""The documentation site: docs/guarantees.md is current, every public symbol is documented, the mkdocs config holds.

``mkdocs build --strict`` itself runs in tests/test_docs_site.py (about 20 s), which loads the site in a browser;
these tests check what it relies on, quickly.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))  # docs/gen_docs.py: the checkout's docs generator (not part of the package)
import gen_docs as _docs  # noqa: E402  (needs the docs extra, which setup.sh installs)


def test_guarantees_page_is_current():
    page = _docs.render_guarantees()
    current = _docs.GUARANTEES_PATH.read_text(encoding="utf-8") if _docs.GUARANTEES_PATH.exists() else ""
    assert current == page, (f"docs/guarantees.md is stale (the hostile-input table in tests/hostile_cases/ changed): "
                             f"regenerate it with `{_docs.REGENERATE_GUARANTEES}`")


def test_guarantees_page_lists_every_row_once():
    from test_hostile import CASES

    page = _docs.render_guarantees(CASES)
    for case in CASES:
        assert page.count(f"| `{case.area}-{case.id}` |") == 1, f"{case.area}-{case.id}"
    assert "exit code 2" in page and "never run code" in page
    # every table row has the four columns (a pipe inside a cell is escaped)
    rows = [ln for ln in page.splitlines() if ln.startswith("| `")]
    assert len(rows) == len(CASES)
    assert all(len(re.split(r"(?<!\\)\|", ln)) == 6 for ln in rows), [ln for ln in rows if ln.count("|") < 5]


def test_guarantees_rows_show_message_and_exit_code():
    from test_hostile import CASES

    by_id = {f"{c.area}-{c.id}": c for c in CASES}
    page = _docs.render_guarantees([by_id["checkpoint-old-format"], by_id["optim-muon-duplicate-param"]])
    old = next(ln for ln in page.splitlines() if "`checkpoint-old-format`" in ln)
    assert "`older weightgeom`" in old and "`WGCKPT1`" in old and old.endswith("| 2 |")
    dup = next(ln for ln in page.splitlines() if "`optim-muon-duplicate-param`" in ln)
    assert "Raises `ValueError`" in dup and "`listed twice`" in dup and "(raises)" in dup


def test_every_public_symbol_has_a_docstring_and_an_api_entry():
    problems = _docs.api_problems()
    assert not problems, "\n".join(problems)


def test_api_check_catches_a_missing_entry_and_a_missing_docstring(tmp_path, monkeypatch):
    import weightgeom.manifolds

    # a page without one of its entries
    (tmp_path / "api").mkdir()
    for page in (DOCS / "api").glob("*.md"):
        text = page.read_text(encoding="utf-8")
        if page.name == "manifolds.md":
            text = text.replace("::: weightgeom.manifolds.stiefel.Stiefel\n", "")
        (tmp_path / "api" / page.name).write_text(text, encoding="utf-8")
    # a public name without a docstring (a module-level dict of the package)
    monkeypatch.setattr(weightgeom.manifolds, "__all__", [*weightgeom.manifolds.__all__, "_ALIASES"])
    problems = _docs.api_problems(tmp_path)
    assert any("weightgeom.manifolds.Stiefel is missing from the API reference" in p for p in problems), problems
    assert any("weightgeom.manifolds._ALIASES" in p and "no docstring" in p for p in problems), problems
    # a name in __all__ that does not exist
    monkeypatch.setattr(weightgeom.manifolds, "__all__", ["no_such_name"])
    assert any("does not exist" in p for p in _docs.api_problems(tmp_path))


def test_mkdocs_hook_fails_the_build(tmp_path):
    pytest.importorskip("mkdocs")
    from mkdocs.exceptions import PluginError

    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "optim.md").write_text("# Optimizers\n\n::: weightgeom.optim.muon.Muon\n")
    with pytest.raises(PluginError, match="weightgeom.optim.MagnitudeDirection is missing from the API reference"):
        hooks.on_pre_build({"docs_dir": str(tmp_path)})


def test_mkdocs_config_offline_strict_and_complete():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["strict"] is True and config["theme"]["font"] is False
    assert config["hooks"] == ["docs/hooks.py"]
    plugins = [p if isinstance(p, str) else next(iter(p)) for p in config["plugins"]]
    assert set(plugins) <= {"search", "mkdocstrings"}, plugins  # nothing that fetches at build time

    def pages(nav) -> list[str]:
        out = []
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            out += pages(value) if isinstance(value, list) else [value]
        return out

    listed = pages(config["nav"])
    missing_files = [p for p in listed if not (DOCS / p).is_file()]
    assert not missing_files, f"nav lists pages that do not exist: {missing_files}"
    guides = sorted(p.name for p in DOCS.glob("*.md"))
    assert not set(guides) - set(listed), f"docs pages missing from nav in mkdocs.yml: {set(guides) - set(listed)}"
    for package in _docs.API_PACKAGES:
        assert f"api/{package}.md" in listed, package


def test_recorded_figures_are_current_and_from_recorded_sweeps():
    """The figures on the results and experiments pages are the recorded PNGs (SHA-256 in docs/results/figures.json),
    the experiments page's section is rendered from that record, and every figure comes from a sweep the claims
    record (docs/results/claims.json) holds findings of."""
    import json

    problems = _docs.figure_problems()
    assert not problems, "\n".join(problems)
    entries = json.loads(_docs.FIGURES_RECORD.read_text(encoding="utf-8"))["figures"]
    claims = json.loads((DOCS / "results" / "claims.json").read_text(encoding="utf-8"))["findings"]
    sources = {f["source"] for f in claims}
    assert entries and all(e["source"] in sources for e in entries), [e["source"] for e in entries]
    assert all(e["device"] != "not recorded" for e in entries)


def test_figure_check_catches_a_changed_missing_or_unlisted_figure(tmp_path):
    import json
    import shutil

    figures, record, page = tmp_path / "figures", tmp_path / "figures.json", tmp_path / "page.md"
    shutil.copytree(_docs.FIGURES_DIR, figures)
    shutil.copyfile(_docs.FIGURES_RECORD, record)
    entries = json.loads(record.read_text(encoding="utf-8"))["figures"]
    page.write_text("# x\n\n" + _docs.render_figures(entries), encoding="utf-8")
    assert _docs.figure_problems(figures, record, [page]) == []
    first = figures / entries[0]["file"]
    first.write_bytes(first.read_bytes() + b"\0")  # a figure redrawn without recording it
    (figures / "stray.png").write_bytes(b"\x89PNG")
    page.write_text("# x\n", encoding="utf-8")
    problems = _docs.figure_problems(figures, record, [page])
    assert any("changed since it was recorded" in p for p in problems), problems
    assert any("stray.png: not in figures.json" in p for p in problems), problems
    assert any("figures section is missing" in p for p in problems), problems
    first.unlink()
    assert any("but missing" in p for p in _docs.figure_problems(figures, record, [page]))


def test_figures_section_names_the_quoted_sweeps_without_figures_and_their_commands(tmp_path):
    """A sweep the results page quotes but whose plots are not recorded is listed under the figures with the command
    that draws them (no broken image); a sweep whose figures are recorded is not."""
    import json

    entries = json.loads(_docs.FIGURES_RECORD.read_text(encoding="utf-8"))["figures"]
    claims = tmp_path / "claims.json"
    findings = [{"source": entries[0]["source"], "runs": 8, "steps": 250, "device": "d"},
                {"source": "weightgeom sweep manifolds long-x", "runs": 16, "steps": 10000, "device": "d"},
                {"source": "weightgeom sweep manifolds long-x", "runs": 4, "steps": 10000, "device": "d"},
                {"source": "weightgeom sweep continuity compress", "runs": 72, "steps": 0, "device": "CPU AMX"}]
    claims.write_text(json.dumps({"findings": findings}), encoding="utf-8")
    section = _docs.render_figures(entries, claims=claims)
    rows = [ln for ln in section.splitlines() if ln.startswith("| `weightgeom sweep")]
    assert len(rows) == 2, rows
    assert "16 runs × 10000 steps" in rows[0] and "weightgeom report runs/sweeps/manifolds-long-x" in rows[0]
    assert "72 points" in rows[1] and "runs/sweeps/continuity-compress/compress.png" in rows[1]
    findings[1:] = []
    claims.write_text(json.dumps({"findings": findings}), encoding="utf-8")
    assert "without recorded figures" not in _docs.render_figures(entries, claims=claims)


def test_figures_of_part_of_a_sweep_say_how_many_of_its_runs_they_show(tmp_path):
    """A sweep drawn while some of its runs had not finished: the record counts the runs the report drew (not the
    planned ones, nor the rungs the sweep skipped by its rule) and the caption says how many the sweep planned."""
    import json

    d = tmp_path / "s"
    d.mkdir()
    (d / "p.png").write_bytes(b"\x89PNG")
    (d / "report.md").write_text("# r\n\n## Manifold assignment\n\n![long-run time courses](p.png)\n")
    runs = [{"name": f"r{i}", "status": st, "step": 10000 if st == "done" else 2500}
            for i, st in enumerate(["done", "done", "running", "pending", "skipped"])]
    (d / "sweep.json").write_text(json.dumps({"recipe": "manifolds", "label": "long-const", "runs": runs}))
    fig, = _docs.report_figures(d)
    assert (fig["runs"], fig["planned"], fig["steps"]) == (2, 4, "10000")
    entries = _docs.record_figures([d], tmp_path / "figures", tmp_path / "figures.json")
    section = _docs.render_figures(entries, claims=tmp_path / "none.json")
    assert "2 runs × 10000 steps (of the sweep's 4 runs; the others had not finished when it was drawn)" in section
    for r in runs[2:4]:
        r.update(status="done", step=10000)
    (d / "sweep.json").write_text(json.dumps({"recipe": "manifolds", "label": "long-const", "runs": runs}))
    fig, = _docs.report_figures(d)
    assert (fig["runs"], fig["steps"]) == (4, "10000") and "planned" not in fig


def test_mkdocs_serves_its_own_mathjax():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8").replace("!!python", "#"))
    extensions = [e if isinstance(e, str) else next(iter(e)) for e in config["markdown_extensions"]]
    assert "pymdownx.arithmatex" in extensions
    assert _docs.MATHJAX_SITE_PATH in config["extra_javascript"]
    assert not [s for s in config["extra_javascript"] if "://" in s]  # nothing from elsewhere
    assert _docs.mathjax_script().is_file()

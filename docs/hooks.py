"""mkdocs hooks (``hooks:`` in mkdocs.yml): the API-reference check and the site's own copy of MathJax.

* mkdocs and mkdocstrings do not fail on an undocumented public name by themselves; :func:`on_pre_build` runs
  ``gen_docs.api_problems`` (docs/gen_docs.py) before the build and stops it with the list (``tests/test_docs.py``
  runs the same check).
* Formulas (``\\( … \\)``, ``\\[ … \\]`` through ``pymdownx.arithmatex``) are typeset in the browser by MathJax
  served from the site itself: :func:`on_files` adds ``assets/mathjax/tex-svg-full.js`` from the installed
  ``django-static-mathjax`` package (the ``docs`` extra; MathJax 3, Apache-2.0, no Django needed), so a page
  fetches nothing from elsewhere when it is viewed.
* The results page (``docs/results.md``, which ``weightgeom claims`` writes whole) gets the recorded sweeps' figures
  appended by :func:`on_page_markdown`, rendered from ``docs/results/figures.json`` as in ``docs/experiments.md``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent))  # docs/gen_docs.py: a checkout's tool, not in the package
from gen_docs import FIGURES_RECORD, MATHJAX_SITE_PATH, api_problems, mathjax_script, render_figures  # noqa: E402


def on_pre_build(config: Any) -> None:
    """Raise ``PluginError`` listing every public symbol without a docstring or an entry in ``docs/api/``."""
    problems = api_problems(Path(config["docs_dir"]))
    if problems:
        raise PluginError("the API reference is incomplete:\n  " + "\n  ".join(problems))


def on_files(files: Files, config: Any) -> Files:
    """Add MathJax (``MATHJAX_SITE_PATH``, named in mkdocs.yml's ``extra_javascript``) to the site's files.

    Raises:
        PluginError: the ``django-static-mathjax`` package is not installed (the ``docs`` extra).
    """
    try:
        script = mathjax_script()
    except FileNotFoundError as e:
        raise PluginError(str(e)) from None
    files.append(File.generated(config, MATHJAX_SITE_PATH, abs_src_path=str(script)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Append the recorded sweeps' figures (``gen_docs.render_figures`` of ``docs/results/figures.json``) to the
    results page; other pages pass through unchanged."""
    if page.file.src_uri != "results.md" or not FIGURES_RECORD.is_file():
        return markdown
    entries = json.loads(FIGURES_RECORD.read_text(encoding="utf-8"))["figures"]
    return markdown.rstrip("\n") + "\n\n" + render_figures(entries) if entries else markdown

"""mkdocs hooks (``hooks:`` in mkdocs.yml): the API-reference check and the site's own copy of MathJax.

* mkdocs and mkdocstrings do not fail on an undocumented public name by themselves; :func:`on_pre_build` runs
  ``gen_docs.api_problems`` (docs/gen_docs.py) before the build and stops it with the list (``tests/test_docs.py``
  runs the same check).
* Formulas (``\\( … \\)``, ``\\[ … \\]`` through ``pymdownx.arithmatex``) are typeset in the browser by MathJax
  served from the site itself: :func:`on_files` adds ``assets/mathjax/tex-svg-full.js`` from the installed
  ``django-static-mathjax`` package (the ``docs`` extra; MathJax 3, Apache-2.0, no Django needed), so a page
  fetches nothing from elsewhere when it is viewed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent))  # docs/gen_docs.py: a checkout's tool, not in the package
from gen_docs import MATHJAX_SITE_PATH, api_problems, mathjax_script  # noqa: E402


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

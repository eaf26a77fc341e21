"""mkdocs hook (``hooks:`` in mkdocs.yml): fail the build when a public symbol has no docstring or no API entry.

mkdocs and mkdocstrings do not fail on an undocumented public name by themselves; this runs
``weightgeom._docs.api_problems`` before the build and stops it with the list (``tests/test_docs.py`` runs the same
check).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

from weightgeom._docs import api_problems


def on_pre_build(config: Any) -> None:
    """Raise ``PluginError`` listing every public symbol without a docstring or an entry in ``docs/api/``."""
    problems = api_problems(Path(config["docs_dir"]))
    if problems:
        raise PluginError("the API reference is incomplete:\n  " + "\n  ".join(problems))

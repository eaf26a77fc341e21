"""mkdocs hook (``hooks:`` in mkdocs.yml): fail the build when a public symbol has no docstring or no API entry.

mkdocs and mkdocstrings do not fail on an undocumented public name by themselves; this runs
``gen_docs.api_problems`` (docs/gen_docs.py) before the build and stops it with the list (``tests/test_docs.py``
runs the same check).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

sys.path.insert(0, str(Path(__file__).resolve().parent))  # docs/gen_docs.py: a checkout's tool, not in the package
from gen_docs import api_problems  # noqa: E402


def on_pre_build(config: Any) -> None:
    """Raise ``PluginError`` listing every public symbol without a docstring or an entry in ``docs/api/``."""
    problems = api_problems(Path(config["docs_dir"]))
    if problems:
        raise PluginError("the API reference is incomplete:\n  " + "\n  ".join(problems))

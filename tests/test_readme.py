"""The README's Python example runs as written, and its two first-line commands name what .ci/run and setup.sh do."""

import re
import warnings
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs():
    text = README.read_text(encoding="utf-8")
    m = re.search(r"## Use it in your training\n\n```python\n(.*?)```", text, re.S)
    assert m, "README lost its 'Use it in your training' example"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the random-init retraction warning is expected here
        exec(compile(m.group(1), "README.md", "exec"), {})


def test_readme_first_lines_are_the_two_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert lines[3].startswith("./setup.sh && .venv/bin/weightgeom demo")
    assert lines[4].startswith("./setup.sh && .venv/bin/python -m pytest -q")
    ci = (README.parent / ".ci" / "run").read_text()
    assert "./setup.sh && .venv/bin/python -m pytest -q" in ci

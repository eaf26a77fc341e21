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


def test_readme_benchmark_summary_is_the_docs_one():
    """The README's benchmark table is copied from docs/benchmarks.md (between the same markers), never edited apart."""
    def block(text: str) -> str:
        return text[text.index("<!-- bench summary -->"):text.index("<!-- end bench summary -->")]

    docs = (README.parent / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert block(README.read_text(encoding="utf-8")) == block(docs), "copy docs/benchmarks.md's summary into README"
    assert "| device kind |" in block(docs)


def test_readme_is_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 200

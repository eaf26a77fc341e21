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


def test_benchmark_summary_figures_come_from_the_generated_blocks():
    """Each summary row names a device kind as the benchmarks print it; every figure in it appears in a block that
    `weightgeom bench ... --markdown docs/benchmarks.md` wrote for that kind. A kind without such blocks is marked
    "recorded" (measured by an earlier version; `gpu_check --markdown` regenerates a GPU's)."""
    docs = (README.parent / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    summary = docs[docs.index("<!-- bench summary -->"):docs.index("<!-- end bench summary -->")]
    rows = [r for r in summary.splitlines() if r.startswith("| ") and not r.startswith(("| device kind", "|---"))]
    blocks = re.findall(r"<!-- bench (\S+) on (.+?) -->\n(.*?)<!-- end bench \1 on \2 -->", docs, re.S)
    checked = 0
    for row in rows:
        kind, *cells = [c.strip() for c in row.strip("|").split("|")]
        text = "".join(body for _, tag, body in blocks if tag.startswith(kind + ","))
        if not text:
            assert "recorded" in kind, f"{kind!r}: no generated block for this kind, and not marked recorded"
            continue
        for figure in re.findall(r"\d+\.\d+", " ".join(cells)):
            assert figure in text, f"{kind}: {figure} is in the summary but in none of its blocks"
        checked += 1
    assert checked >= 2

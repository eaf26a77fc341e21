"""Hostile inputs: reports (rows of tests/test_hostile.py).

``weightgeom report DIR`` reads a sweep directory that may come from someone else. It never writes through a link
planted at one of its output names, ``report.md`` is inert as markdown and as HTML whatever the run and sweep files
hold, a doctored file (a wrong type, NaN where a step belongs, deep nesting, bytes that are not UTF-8, a huge integer,
a FIFO, a file of gigabytes) is left out with a warning naming it instead of a traceback, and the report still comes
out.

The rows share one corpus: real sweeps of every report section (the manifolds comparison, stability boundary,
attribution and long mechanism studies, continuity, MD), 3 steps each, trained once per test session (~15 s) into a
temporary folder; each row copies what it needs (without checkpoints) and doctors the copy.
"""

from __future__ import annotations

import atexit
import functools
import html.parser
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hostile_cases import CliResult, Hostile, assert_one_line_error, cli

__all__ = ["CASES", "corpus", "render_html"]

SWEEPS: dict[str, tuple[str, str, str]] = {
    # folder: (recipe, preset, --only)
    "manifolds": ("manifolds", "manifolds-ci", "all-stiefel,all-dgram-capped"),
    "boundary": ("manifolds", "manifolds-boundary", "unconstrained-ours-lr0.005,unconstrained-ours-lr0.01"),
    "attribution": ("manifolds", "manifolds-attribution", "attr-all-dgram-ours"),
    "mechanism": ("manifolds", "manifolds-mechanism", "mech-all-dgram-paper"),
    "continuity": ("continuity", "continuity-ci", "res-relu,nores,llama-silu"),
    "md": ("md", "md-ci", "adamw-w32-lr0.001,adamw-w64-lr0.001,muon-md-w64*"),
}
"""The corpus: one small real sweep per report section."""


@functools.lru_cache(maxsize=1)
def corpus() -> Path:
    """The folder holding one finished sweep per entry of :data:`SWEEPS` (built once per process)."""
    root = Path(tempfile.mkdtemp(prefix="wg-report-corpus-"))
    atexit.register(shutil.rmtree, root, True)
    for folder, (recipe, preset, only) in SWEEPS.items():
        res = cli("sweep", recipe, preset, "--only", only, "--seeds", "0", "--steps", "3", "--out",
                  str(root / folder), "--quiet", "--no-report")
        assert res.rc == 0, f"corpus sweep {folder} failed: {res.err[-2000:]}"
    return root


def _copy(dest: Path, folders: tuple[str, ...] | None = None) -> Path:
    """A copy of the corpus (or of some of its sweeps) under ``dest/sw``, without checkpoints or TensorBoard files."""
    src = corpus()
    out = dest / "sw"
    for folder in folders or tuple(SWEEPS):
        shutil.copytree(src / folder, out / folder, ignore=shutil.ignore_patterns("checkpoints", "tb", "*.lock*"))
    return out


def _no_traceback(res) -> None:
    assert "Traceback" not in res.err, f"traceback:\n{res.err[-3000:]}"
    assert res.rc == 0, f"exit code {res.rc}: {res.err[-2000:]}"


def _report(sw: Path, *paths: Path, timeout: float = 60):
    """``weightgeom report`` in-process, under a watchdog: a hang (blocked on a special file, reading forever) gets
    the process a SIGTERM after ``timeout`` seconds, which the CLI turns into its exit code 143 — the row fails with
    that instead of hanging the suite. (An alarm would not do: the CLI owns SIGALRM while a command runs.)"""
    watchdog = threading.Timer(timeout, os.kill, (os.getpid(), signal.SIGTERM))
    watchdog.daemon = True
    watchdog.start()
    try:
        res = cli("report", *(map(str, paths or (sw,))))
    finally:
        watchdog.cancel()
    assert res.rc != 143, f"weightgeom report did not finish within {timeout} s (blocked or reading forever)"
    return res


MEMORY_CAP = 6 << 30
"""Address-space cap (bytes) of :func:`_report_bounded`'s process: a report of the md corpus needs ~1.5 GB of it."""


def _report_bounded(path: Path, timeout: float = 120) -> CliResult:
    """``weightgeom report PATH`` in a child process capped at :data:`MEMORY_CAP` and ``timeout``: code that reads a
    huge file whole fails there (a MemoryError, a non-zero exit) instead of taking the test process down with an
    out-of-memory kill, as reading ``/dev/zero`` to its end would."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    try:
        p = subprocess.run([sys.executable, "-m", "weightgeom", "report", str(path)], preexec_fn=cap,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"weightgeom report did not finish within {timeout} s") from None
    return CliResult(p.returncode, p.stdout, p.stderr)


# ------------------------------------------------------------------------------------------------ rendering
class _Tags(html.parser.HTMLParser):
    """Every start tag with its attributes, and the text, of an HTML document."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


ALLOWED_TAGS = {"h1", "h2", "h3", "h4", "p", "ul", "ol", "li", "strong", "em", "code", "pre", "table", "thead",
                "tbody", "tr", "th", "td", "img", "details", "summary", "br", "hr"}
"""Every tag a report may contain once rendered (ours); anything else came from the input."""


def render_html(markdown: str) -> dict[str, str]:
    """``report.md`` rendered by the two renderers people use: CommonMark + GFM tables with raw HTML passed through
    (markdown-it-py, as VS Code and many sites) and Python-Markdown (``tables``, with and without ``fenced_code``; raw
    HTML passed through)."""
    import markdown as pymd
    from markdown_it import MarkdownIt

    return {"markdown-it": MarkdownIt("commonmark", {"html": True}).enable("table").render(markdown),
            "python-markdown": pymd.markdown(markdown, extensions=["tables", "fenced_code"]),
            "python-markdown, no fenced code": pymd.markdown(markdown, extensions=["tables"])}


def assert_inert(markdown: str, pngs: set[str]) -> str:
    """Assert ``markdown`` renders (both renderers) to our tags only: images only of the report's own PNGs, no link,
    no event handler, no script/style/iframe. Returns the rendered text of the markdown-it rendering."""
    texts = {}
    for name, doc in render_html(markdown).items():
        p = _Tags()
        p.feed(doc)
        for tag, attrs in p.tags:
            assert tag in ALLOWED_TAGS, f"{name}: tag <{tag} {attrs}> in the rendered report"
            for k, v in attrs.items():
                assert not k.startswith("on"), f"{name}: event handler {k}={v!r} on <{tag}>"
                if k in ("src", "href"):
                    assert tag == "img" and k == "src" and v in pngs, f"{name}: <{tag} {k}={v!r}>"
                elif k == "class":
                    assert tag == "code" and v == "language-toml", f"{name}: <{tag} class={v!r}>"
                else:
                    assert k in ("alt", "align", "style") and (k != "style" or re.fullmatch(
                        r"text-align: ?(left|right|center);?", v or "")), f"{name}: <{tag} {k}={v!r}>"
        texts[name] = "".join(p.text)
    return texts["markdown-it"]


def _tables_are_rectangular(markdown: str) -> None:
    """Every markdown table row has as many cells as its header (no injected row or column)."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").enable("table").parse(markdown)
    widths: list[int] = []
    cells = 0
    for t in tokens:
        if t.type == "table_open":
            widths = []
        elif t.type == "tr_open":
            cells = 0
        elif t.type in ("th_open", "td_open"):
            cells += 1
        elif t.type == "tr_close":
            widths.append(cells)
        elif t.type == "table_close":
            assert len(set(widths)) == 1, f"a table's rows have {widths} cells"
    # GFM drops surplus cells silently, so also count the raw cells of each table line
    for block in re.split(r"\n(?!\|)", markdown):
        rows = [ln for ln in block.splitlines() if ln.startswith("|")]
        counts = {len(re.findall(r"(?<!\\)\|", ln)) for ln in rows}
        assert len(counts) <= 1, f"table lines with different cell counts: {rows[:3]}"


# --------------------------------------------------------------------------------------------- symbolic links
def _symlinks_replaced(tmp: Path) -> None:
    sw = _copy(tmp, ("manifolds", "md"))
    first = _report(sw)
    _no_traceback(first)
    written = [p.name for p in sw.iterdir() if p.is_file() and p.suffix in (".md", ".png")]
    assert "report.md" in written and len(written) > 2, written
    victim = tmp / "victim.sh"
    victim.write_text("#!/bin/sh\necho original\n")
    dangling = tmp / "not-there-yet"
    for i, name in enumerate(written):
        (sw / name).unlink()
        (sw / name).symlink_to(victim if i % 2 == 0 else dangling)
    res = _report(sw)
    _no_traceback(res)
    assert victim.read_text() == "#!/bin/sh\necho original\n", "the report wrote through a link"
    assert not dangling.exists(), "the report created the target of a dangling link"
    for name in written:
        assert (sw / name).is_file() and not (sw / name).is_symlink(), f"{name} is still a link"
    assert (sw / "report.md").read_text().startswith("# ")


# -------------------------------------------------------------------------------------------------- injection
PAYLOAD = ("x\n# Injected heading\n| a | b |\n<script>alert(1)</script><img src=x onerror=alert(2)>"
           "<iframe src=javascript:alert(3)></iframe>[click](javascript:alert(4)) ![t](https://evil.example/t.png)"
           " <https://evil.example> ``` `code` **bold** </td></tr></table></details>")
"""Markup of every kind a run or sweep file could carry into a report."""

_NAME_PAYLOAD = "evil\n# run <img src=x onerror=alert(5)> `tick` | pipe [l](javascript:x)"


def _inject(tmp: Path) -> None:
    sw = _copy(tmp)
    for exp_path in sorted(sw.rglob("experiment.json")):
        exp = json.loads(exp_path.read_text())
        exp["variant"] = f"{exp.get('variant')}{PAYLOAD}"
        exp["description"] = PAYLOAD
        exp["part"] = PAYLOAD if exp.get("recipe") == "manifolds" else exp.get("part")
        exp["overrides"] = {**exp.get("overrides", {}), f"k{PAYLOAD}": PAYLOAD}
        tags = exp.get("tags") or {}
        for k in ("strategy", "algorithm", "arm", "optimizer", "axis"):
            if k in tags:
                tags[k] = f"{tags[k]}{PAYLOAD}"
        exp["tags"] = tags
        exp_path.write_text(json.dumps(exp))
    for st_path in sorted(sw.rglob("status.json")):
        st = json.loads(st_path.read_text())
        st["reason"] = PAYLOAD
        st_path.write_text(json.dumps(st))
    one = next(sw.glob("manifolds/all-stiefel-s0"))
    st = json.loads((one / "status.json").read_text())
    (one / "status.json").write_text(json.dumps({**st, "state": "diverged"}))  # the divergence list shows reasons
    other = next(sw.glob("md/adamw-w32-*"))
    st = json.loads((other / "status.json").read_text())
    (other / "status.json").write_text(json.dumps({**st, "state": "failed"}))  # the "left out" line shows reasons
    for man_path in sorted(sw.rglob("sweep.json")):
        man = json.loads(man_path.read_text())
        man.update(recipe=f"{man['recipe']}{PAYLOAD}", config=PAYLOAD, wall_s=PAYLOAD)
        man_path.write_text(json.dumps(man))
    for cfg in sorted(sw.rglob("config.resolved.toml")):
        cfg.write_text(cfg.read_text() + f'\n[evil]\n"key{json.dumps(PAYLOAD)[1:-1]}" = {json.dumps(PAYLOAD)}\n')
    for met in sorted(sw.rglob("metrics.jsonl")):
        with open(met, "a") as f:
            f.write(json.dumps({"step": 1, "split": "val", f"loss{PAYLOAD}": 1.0}) + "\n")
    for cont in sorted(sw.rglob("continuity.jsonl")):
        rows = [json.loads(x) for x in cont.read_text().splitlines()]
        cont.write_text("".join(json.dumps({**r, "role": f"{r['role']}{PAYLOAD}"}) + "\n" for r in rows[:3])
                        + "".join(json.dumps(r) + "\n" for r in rows[3:]))
    capped = sw / "manifolds" / "all-dgram-capped-s0" / "controls.json"
    ctl = json.loads(capped.read_text())
    ctl.update(auto_threshold=10.0, auto_layers=2, auto_max_bound={PAYLOAD: 3.0},
               auto_moves=[{"layer": PAYLOAD, "action": PAYLOAD, "step": 2, "bound": 11.0, "qk_sigma_prod": 1.0}])
    capped.write_text(json.dumps(ctl))
    other.rename(sw / "md" / f"adamw-w32-lr0.001{_NAME_PAYLOAD}-s0")  # a failed run: its name is shown
    (sw / "continuity" / "nores-s0").rename(sw / "continuity" / f"{_NAME_PAYLOAD}")
    res = _report(sw)
    _no_traceback(res)
    text = (sw / "report.md").read_text()
    assert "could not be built" not in text, text[-3000:]
    pngs = {p.name for p in sw.glob("*.png")}
    rendered = assert_inert(text, pngs)
    _tables_are_rectangular(text)
    headings = [ln for ln in text.splitlines() if ln.startswith("#")]
    assert not [h for h in headings if "Injected" in h or "run <" in h], headings
    # shown, not dropped: the payload's text reaches the reader as text
    assert "<script>alert(1)</script>" in rendered and "onerror=alert(5)" in rendered


# ------------------------------------------------------------------------------------------- doctored values
def _set_json(rel: str, key: str | None, value: Any, raw: str | None = None) -> Callable[[Path], Path]:
    """A doctoring: in JSON file ``rel`` (relative to the sweep), set ``key`` (dotted: nested) to ``value``; or write
    ``raw`` text as the whole file. Returns the doctored path."""
    def doctor(sw: Path) -> Path:
        path = sw / rel
        if raw is not None:
            path.write_bytes(raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else raw)
            return path
        obj = json.loads(path.read_text())
        *parents, last = key.split(".")
        d = obj
        for p in parents:
            d = d.setdefault(p, {})
        d[last] = value
        path.write_text(json.dumps(obj))
        return path
    return doctor


def _raw(rel: str, data: bytes, append: bool = False) -> Callable[[Path], Path]:
    """A doctoring: write ``data`` as the whole file ``rel``; or, with ``append``, add it as a line followed by a copy
    of the file's first line (a bad line in the middle: a partial *last* line is what a killed writer leaves, and
    is skipped without a warning)."""
    def doctor(sw: Path) -> Path:
        path = sw / rel
        if append:
            first = path.read_bytes().splitlines(keepends=True)[0]
            with open(path, "ab") as f:
                f.write(data + first)
        else:
            path.write_bytes(data)
        return path
    return doctor


def _toml_edit(rel: str, old: str, new: str) -> Callable[[Path], Path]:
    def doctor(sw: Path) -> Path:
        path = sw / rel
        text = path.read_text()
        assert old in text, f"{old!r} not in {path}"
        path.write_text(text.replace(old, new, 1))
        return path
    return doctor


_DEEP = "[" * 100_000 + "]" * 100_000
_HUGE_INT = "1" + "0" * 5000
_NOT_UTF8 = b'{"state": "done", "reason": "\xff\xfe\xc3\x28"}'
B = "boundary/unconstrained-ours-lr0.005-s0"
M = "md/adamw-w32-lr0.001-s0"
C = "continuity/res-relu-s0"
MC = "manifolds/all-dgram-capped-s0"
MECH = "mechanism/mech-all-dgram-paper-s0"

DOCTORED: list[tuple] = [
    # (case, sweep folder reported, doctoring[, warns]): warns=False where the value is a plain value shown as text
    # (a NaN among a run's settings) and only its use as a number must not fail
    ("status step NaN", "boundary", _set_json(f"{B}/status.json", "step", float("nan"))),
    ("status step Infinity", "boundary", _set_json(f"{B}/status.json", "step", float("inf"))),
    ("status step string", "boundary", _set_json(f"{B}/status.json", "step", "three")),
    ("status step negative", "boundary", _set_json(f"{B}/status.json", "step", -4)),
    ("status step huge int", "boundary", _raw(f"{B}/status.json",
                                              f'{{"state": "done", "step": {_HUGE_INT}}}'.encode())),
    ("status step 1e300", "boundary", _set_json(f"{B}/status.json", "step", 1e300)),
    ("status state list", "boundary", _set_json(f"{B}/status.json", "state", ["done"])),
    ("status reason table", "manifolds", _set_json(f"{MC}/status.json", "reason", {"a": 1})),
    ("status whole list", "boundary", _raw(f"{B}/status.json", b"[1, 2, 3]")),
    ("status whole string", "md", _raw(f"{M}/status.json", b'"done"')),
    ("status deep nesting", "boundary", _raw(f"{B}/status.json", _DEEP.encode())),
    ("status not UTF-8", "boundary", _raw(f"{B}/status.json", _NOT_UTF8)),
    ("experiment variant int", "manifolds", _set_json(f"{MC}/experiment.json", "variant", 5)),
    ("experiment variant list", "md", _set_json(f"{M}/experiment.json", "variant", ["a"])),
    ("experiment seed string", "continuity", _set_json(f"{C}/experiment.json", "seed", "zero")),
    ("experiment seed inf", "continuity", _set_json(f"{C}/experiment.json", "seed", float("inf"))),
    ("experiment tags string", "boundary", _set_json(f"{B}/experiment.json", "tags", "boundary")),
    ("experiment tags lr string", "boundary", _set_json(f"{B}/experiment.json", "tags.lr", "fast")),
    ("experiment tags lr NaN", "boundary", _set_json(f"{B}/experiment.json", "tags.lr", float("nan"))),
    ("experiment tags lr missing", "boundary", _set_json(f"{B}/experiment.json", "tags", {"study": "boundary"})),
    ("experiment tags width string", "md", _set_json(f"{M}/experiment.json", "tags.width", "wide")),
    ("experiment tags width negative", "md", _set_json(f"{M}/experiment.json", "tags.width", -32)),
    ("experiment tags width list", "md", _set_json(f"{M}/experiment.json", "tags.width", [32])),
    ("experiment tags optimizer table", "md", _set_json(f"{M}/experiment.json", "tags.optimizer", {"a": 1})),
    ("experiment attribution arm list", "attribution", _set_json(
        "attribution/attr-all-dgram-ours-s0/experiment.json", "tags.arm", ["ours"])),
    ("experiment mechanism algorithm int", "mechanism", _set_json(f"{MECH}/experiment.json", "tags.algorithm", 3)),
    ("experiment part list", "continuity", _set_json(f"{C}/experiment.json", "part", ["resmlp"])),
    ("experiment overrides list", "manifolds", _set_json(f"{MC}/experiment.json", "overrides", ["a"])),
    ("experiment controls string", "manifolds", _set_json(f"{MC}/experiment.json", "controls", "capped")),
    ("experiment final string", "md", _set_json(f"{M}/experiment.json", "final", "good")),
    ("experiment recipe int", "md", _set_json(f"{M}/experiment.json", "recipe", 7)),
    ("experiment settings max_steps NaN", "md", _set_json(f"{M}/experiment.json", "settings", {
        "train.max_steps": float("nan")}), False),
    ("experiment whole list", "md", _raw(f"{M}/experiment.json", b"[]")),
    ("experiment deep nesting", "md", _raw(f"{M}/experiment.json", _DEEP.encode())),
    ("experiment not UTF-8", "md", _raw(f"{M}/experiment.json", b'{"variant": "\xff"}')),
    ("config max_steps nan", "md", _toml_edit(f"{M}/config.resolved.toml", "max_steps = 3", "max_steps = nan")),
    ("config max_steps string", "md", _toml_edit(f"{M}/config.resolved.toml", "max_steps = 3", 'max_steps = "3"')),
    ("config model not a table", "continuity", _raw(f"{C}/config.resolved.toml",
                                                     b'model = 5\n[train]\nmax_steps = 3\n')),
    ("config width string", "continuity", _toml_edit(f"{C}/config.resolved.toml", "width = ", 'width = "w" #')),
    ("config strategy int", "manifolds", _toml_edit(f"{MC}/config.resolved.toml", 'strategy = "all-dgram"',
                                                    "strategy = 7")),
    ("config not TOML", "md", _raw(f"{M}/config.resolved.toml", b"[[[ not toml")),
    ("config deep nesting", "md", _raw(f"{M}/config.resolved.toml", b"a = " + _DEEP.encode())),
    ("config not UTF-8", "md", _raw(f"{M}/config.resolved.toml", b'a = "\xff"\n')),
    ("metrics step NaN", "md", _raw(f"{M}/metrics.jsonl", b'{"step": NaN, "split": "val", "loss": 1.0}\n', True)),
    ("metrics step string", "md", _raw(f"{M}/metrics.jsonl", b'{"step": "3", "split": "val", "loss": 1.0}\n', True)),
    ("metrics step Infinity", "md", _raw(f"{M}/metrics.jsonl", b'{"step": Infinity, "split": "val", "loss": 1}\n',
                                         True)),
    ("metrics step huge int", "md", _raw(f"{M}/metrics.jsonl", f'{{"step": {_HUGE_INT}, "loss": 1}}\n'.encode(), True)),
    ("metrics step 1e308 int", "md", _raw(f"{M}/metrics.jsonl", f'{{"step": {"9" * 400}, "loss": 1}}\n'.encode(),
                                         True)),
    ("metrics value huge int", "md", _raw(f"{M}/metrics.jsonl", f'{{"step": 2, "split": "val", "loss": {"9" * 400}}}\n'
                                          .encode(), True)),
    ("metrics split list", "md", _raw(f"{M}/metrics.jsonl", b'{"step": 2, "split": ["val"], "loss": 1.0}\n', True)),
    ("metrics line is a list", "md", _raw(f"{M}/metrics.jsonl", b'[1, 2]\n', True)),
    ("metrics deep line", "md", _raw(f"{M}/metrics.jsonl", _DEEP.encode() + b"\n", True)),
    ("metrics not UTF-8", "md", _raw(f"{M}/metrics.jsonl", b'{"step": 2, "split": "\xff", "loss": 1}\n', True)),
    ("continuity role int", "continuity", _raw(f"{C}/continuity.jsonl",
                                                b'{"step": 3, "kind": "weight", "role": 5, "layer": 0, "cv": 1}\n',
                                                True)),
    ("continuity layer string", "continuity", _raw(
        f"{C}/continuity.jsonl", b'{"step": 3, "kind": "weight", "role": "mlp", "layer": "x", "cv": 1}\n', True)),
    ("continuity value string", "continuity", _raw(
        f"{C}/continuity.jsonl", b'{"step": 3, "kind": "weight", "role": "mlp", "layer": 0, "cv": "x"}\n', True)),
    ("controls sigma_cap string", "manifolds", _set_json(f"{MC}/controls.json", "sigma_cap", "two")),
    ("controls rescales list", "manifolds", _set_json(f"{MC}/controls.json", "rescales", [1])),
    ("controls auto_moves string", "manifolds", _set_json(f"{MC}/controls.json", "auto_moves", "all")),
    ("controls auto_moves bad item", "manifolds", _set_json(f"{MC}/controls.json", "auto_moves", [{"layer": []}, 5])),
    ("controls auto_max_bound list", "manifolds", _set_json(f"{MC}/controls.json", "auto_max_bound", [1, 2])),
    ("controls whole list", "manifolds", _raw(f"{MC}/controls.json", b"[]")),
    ("heads step string", "mechanism", _raw(f"{MECH}/heads.jsonl", b'{"step": "x", "split": "heads"}\n', True)),
    ("meta num_params string", "md", _set_json("md/adamw-w64-lr0.001-s0/meta.json", "num_params", "many")),
    ("sweep runs string", "md", _set_json("md/sweep.json", "runs", "all")),
    ("sweep runs of ints", "md", _set_json("md/sweep.json", "runs", [5, 6])),
    ("sweep wall_s string", "md", _set_json("md/sweep.json", "wall_s", "long")),
    ("sweep recipe list", "md", _set_json("md/sweep.json", "recipe", ["md"])),
    ("sweep whole list", "md", _raw("md/sweep.json", b"[]")),
    ("sweep deep nesting", "md", _raw("md/sweep.json", _DEEP.encode())),
    ("sweep not UTF-8", "md", _raw("md/sweep.json", b'{"recipe": "\xff"}')),
    ("sweep huge int", "md", _raw("md/sweep.json", f'{{"wall_s": {_HUGE_INT}}}'.encode())),
]
"""Doctored run and sweep files, one per case: each is reported with a warning naming the file and no traceback."""


def _doctored(tmp: Path) -> None:
    failures = []
    for i, (case, folder, doctor, *warns) in enumerate(DOCTORED):
        sw = _copy(tmp / f"c{i}", (folder,))
        path = doctor(sw)
        res = _report(sw / folder)
        try:
            _no_traceback(res)
            text = (sw / folder / "report.md").read_text()
            assert "could not be built" not in text, "a section could not be built"
            rel = str(path.relative_to(sw / folder))
            if warns != [False]:
                assert "warning:" in res.err and rel in res.err, f"no warning naming {rel}: {res.err!r}"
        except AssertionError as e:
            failures.append(f"{case}: {str(e)[:300]}")
        shutil.rmtree(tmp / f"c{i}")
    assert not failures, f"{len(failures)} of {len(DOCTORED)} doctored folders:\n" + "\n".join(failures)


# ------------------------------------------------------------------------------------- special and huge files
def _special_files(tmp: Path) -> None:
    sw = _copy(tmp, ("md", "continuity"))
    run = sw / "md" / "adamw-w32-lr0.001-s0"
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    (sw / "md" / "sweep.json").unlink()
    os.mkfifo(sw / "md" / "sweep.json")
    other = sw / "continuity" / "res-relu-s0"
    (other / "status.json").unlink()
    (other / "status.json").mkdir()
    (other / "continuity.jsonl").unlink()
    (other / "continuity.jsonl").symlink_to(other / "continuity.jsonl")  # a loop
    res = _report(sw, timeout=60)
    _no_traceback(res)
    for name in ("metrics.jsonl", "sweep.json", "status.json", "continuity.jsonl"):
        assert name in res.err, f"no warning naming {name}: {res.err}"
    assert "FIFO" in res.err and "directory" in res.err


def _huge_files(tmp: Path) -> None:
    sw = _copy(tmp, ("md",))
    run = sw / "md" / "adamw-w32-lr0.001-s0"
    with open(run / "metrics.jsonl", "r+b") as f:  # sparse: 3 GiB on paper, nothing on disk
        f.truncate(3 << 30)
    with open(run / "status.json", "r+b") as f:
        f.truncate(1 << 30)
    (sw / "md" / "sweep.json").unlink()
    (sw / "md" / "sweep.json").symlink_to("/dev/zero")
    res = _report_bounded(sw / "md")
    _no_traceback(res)
    assert "metrics.jsonl" in res.err and "status.json" in res.err and "sweep.json" in res.err, res.err


# ------------------------------------------------------------------------------------------------ claims
_BEGIN = "<!-- claims table: generated by `weightgeom claims`, do not edit -->"
_END = "<!-- end of claims table -->"


def _claims_json(tmp: Path) -> Path:
    """The repository's merged claims record (a real ``claims.json``), copied under ``tmp``."""
    src = Path(__file__).resolve().parents[2] / "docs" / "results" / "claims.json"
    dest = tmp / "claims.json"
    shutil.copyfile(src, dest)
    return dest


def _readme(path: Path, begin: str = _BEGIN, end: str = _END) -> str:
    text = f"# My project\n\nkeep this\n\n{begin}\nold table\n{end}\n\nand this\n"
    path.write_text(text)
    return text


def _claims_outputs_alias(tmp: Path) -> None:
    claims = _claims_json(tmp)
    text = _readme(tmp / "same.md")
    (tmp / "link.md").symlink_to("same.md")
    (tmp / "sub").mkdir()
    os.link(tmp / "same.md", tmp / "hard.md")
    for page in ("same.md", "./same.md", "sub/../same.md", str(tmp / "same.md"), "link.md", "hard.md"):
        res = cli("claims", claims, "--readme", "same.md", "--page", page)
        assert_one_line_error(res, "--readme same.md", f"--page {page}", "name one file")
        assert (tmp / "same.md").read_text() == text, f"--page {page} replaced the README"
    res = cli("claims", claims, "--page", "p.md", "--record", "p.md")
    assert_one_line_error(res, "--page p.md", "--record p.md", "name one file")
    assert not (tmp / "p.md").exists()
    assert cli("claims", claims, "--readme", "same.md", "--page", "page.md").rc == 0  # distinct files: both written
    # the same mechanism (_files.distinct_outputs) in every command with several output files
    for bench, a, b in (("optimizer_step", "--json", "--markdown"), ("md_overhead", "--json", "--markdown")):
        res = cli("bench", bench, a, "out.txt", b, "./out.txt")
        assert_one_line_error(res, f"{a} out.txt", f"{b} ./out.txt", "name one file")
        assert not (tmp / "out.txt").exists()
    assert "keep this" in (tmp / "same.md").read_text() and (tmp / "page.md").read_text().startswith("# Results")


def _claims_fifo_readme(tmp: Path) -> None:
    claims = _claims_json(tmp)
    os.mkfifo(tmp / "README.md")
    watchdog = threading.Timer(30, os.kill, (os.getpid(), signal.SIGTERM))  # a hang: the CLI exits 143
    watchdog.daemon = True
    watchdog.start()
    try:
        res = cli("claims", claims, "--readme", "README.md")
    finally:
        watchdog.cancel()
    assert_one_line_error(res, "README.md", "--readme", "FIFO")


def _claims_write_failures(tmp: Path) -> None:
    import errno
    import tempfile as tempfile_module

    import pytest

    import weightgeom._files as files

    claims = _claims_json(tmp)
    text = _readme(tmp / "README.md", _END, _BEGIN)  # markers in reverse order
    assert_one_line_error(cli("claims", claims, "--readme", "README.md"), "--readme README.md", "reverse order")
    assert (tmp / "README.md").read_text() == text

    def full_disk(fd: int) -> None:  # the system names no file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def read_only(**kw):  # the system names the temporary file
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp / ".page.md.a1b2c3.tmp"))

    (tmp / "page.md").write_text("old page")
    for target, fault, reason in ((files.os, ("fsync", full_disk), "No space left on device"),
                                  (tempfile_module, ("mkstemp", read_only), "Read-only file system")):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(target, *fault)
            res = cli("claims", claims, "--page", "page.md")
        line = assert_one_line_error(res, "--page page.md", reason, "left as it was")
        assert ".tmp" not in line, f"names the temporary file: {line!r}"
        assert (tmp / "page.md").read_text() == "old page"
    assert sorted(p.name for p in tmp.iterdir()) == ["README.md", "claims.json", "page.md"]  # no temporary left


CASES: list[Hostile] = [
    Hostile("symlinked-outputs", "report",
            "`report.md` and every PNG a report writes, planted as symbolic links (to a script, or dangling), are "
            "replaced by new files; the link targets are never written or created", _symlinks_replaced),
    Hostile("markup-injection", "report",
            "markdown and HTML (script, event handlers, iframes, `javascript:` links, remote images, headings, table "
            "rows) in run names, variants, descriptions, tags, reasons, overrides, configs, metric names, continuity "
            "roles, automatic-assignment moves and `sweep.json` are shown as text: `report.md` rendered by "
            "markdown-it or Python-Markdown holds only the report's own tags, images and table cells", _inject),
    Hostile("doctored-values", "report",
            f"{len(DOCTORED)} doctored run and sweep files (NaN/Inf/string/negative steps, huge integers, lists or "
            "strings where tables belong, deep nesting, bytes that are not UTF-8, wrong-typed tags, configs and "
            "metrics) are each left out with a warning naming the file; no traceback, every section is built",
            _doctored),
    Hostile("special-files", "report",
            "a FIFO `metrics.jsonl` or `sweep.json`, a directory named `status.json` and a loop of links as "
            "`continuity.jsonl` get a warning naming them; the report never blocks and still comes out",
            _special_files),
    Hostile("huge-files", "report",
            "a 3 GiB `metrics.jsonl`, a 1 GiB `status.json` and a `sweep.json` linked to `/dev/zero` are refused by "
            "their size bounds with a warning naming them (no out-of-memory); the report still comes out",
            _huge_files),
    Hostile("claims-outputs-alias", "report",
            "`weightgeom claims --readme same.md --page same.md` (or the page named through a link, `..`, an "
            "absolute path or a hard link; or `--page` and `--record` alike; or a benchmark's `--json` and "
            "`--markdown`) is refused with one line naming both flags before anything is written; the README keeps "
            "everything outside its claims table",
            _claims_outputs_alias),
    Hostile("claims-fifo-readme", "report",
            "a FIFO given as `claims --readme` is refused at once with one line naming it; nothing blocks",
            _claims_fifo_readme),
    Hostile("claims-write-failures", "report",
            "a full disk or a read-only filesystem while `claims` writes `--page` is one line naming `--page` and "
            "its path (never a temporary file), the old page kept; README markers in reverse order are reported "
            "as such", _claims_write_failures),
]

"""The documentation site as a reader sees it, in a real headless browser (Debian's chromium).

The site is built once per run with ``mkdocs build --strict`` (the build CI relies on: a warning, a broken link or
an undocumented public name fails it; ``$WG_DOCS_SITE`` names an existing build to load instead), served from
127.0.0.1 and loaded by chromium with every other host unresolvable, so a page that needed anything from elsewhere
would show it. A small script added to the served copy of each page reports, once MathJax has typeset the
page, its images (loaded: ``naturalWidth > 0``), its rendered formulas, every resource it fetched and the status of
every link it holds into the site. Nothing here skips: without chromium the tests fail, saying how to install it.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import gen_docs as _docs  # noqa: E402

PROBE = b"""<script>
window.addEventListener('load', async () => {
  const out = {};
  try {
    if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
    await Promise.all([...document.images].map(
      i => i.complete ? null : new Promise(r => { i.onload = i.onerror = r; })));
    out.images = [...document.images].map(i => [i.getAttribute('src'), i.naturalWidth]);
    out.formulas = document.querySelectorAll('mjx-container svg').length;
    out.formula_errors = document.querySelectorAll('mjx-merror, [data-mjx-error]').length;
    out.unrendered = [...document.querySelectorAll('.arithmatex')].filter(
      e => !e.querySelector('mjx-container')).length;
    out.origin = location.origin;
    const links = new Set();
    for (const a of document.querySelectorAll('a[href]')) {
      const u = new URL(a.getAttribute('href'), location.href);
      if (u.origin === location.origin) { u.hash = ''; links.add(u.href); }
    }
    out.links = {};
    for (const u of links) { out.links[u] = (await fetch(u, {method: 'HEAD'})).status; }
    out.resources = performance.getEntriesByType('resource').map(e => e.name);
  } catch (e) { out.error = String(e); }
  const pre = document.createElement('pre'); pre.id = 'wg-probe'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""
"""Added before ``</body>`` of each page in the served copy (the built site itself is not changed)."""

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1", "--virtual-time-budget=30000"]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail("no headless browser for the docs-site test: install chromium (apt-get install chromium); "
                ".ci/run installs it")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A served copy of the built site, each page with the probe."""
    built = Path(os.environ["WG_DOCS_SITE"]) if os.environ.get("WG_DOCS_SITE") else None
    if built is None or not (built / "index.html").is_file():
        built = tmp_path_factory.mktemp("site-built")
        res = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "-q", "-d", str(built)],
                             cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
        assert res.returncode == 0, f"mkdocs build --strict failed:\n{res.stderr[-3000:]}"
    served = tmp_path_factory.mktemp("site") / "site"
    shutil.copytree(built, served)
    for page in served.rglob("*.html"):
        page.write_bytes(page.read_bytes().replace(b"</body>", PROBE + b"</body>", 1))
    return served


@pytest.fixture(scope="module")
def server(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # noqa: D401 - no request log on stderr
        pass


def load(server: str, page: str, tmp_path: Path) -> dict:
    """What the probe reports for ``page`` (a path under the site) once chromium has loaded and typeset it."""
    res = subprocess.run([_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
                          f"{server}/{page}"], capture_output=True, text=True, timeout=180)
    m = re.search(r'<pre id="wg-probe">(.*?)</pre>', res.stdout, re.S)
    assert m, f"chromium returned no probe for {page} (exit {res.returncode}): {res.stderr[-1500:]}"
    report = json.loads(html.unescape(m.group(1)))
    assert "error" not in report, report["error"]
    return report


def _common(report: dict, page: str) -> None:
    """Nothing fetched from elsewhere; every link into the site answers 200."""
    elsewhere = [r for r in report["resources"] if not r.startswith(report["origin"])]
    assert not elsewhere, f"{page} fetched from elsewhere: {elsewhere}"
    broken = {u: s for u, s in report["links"].items() if s != 200}
    assert not broken, f"{page}: broken links {broken}"


def test_results_page_shows_the_recorded_figures(server, tmp_path):
    entries = json.loads(_docs.FIGURES_RECORD.read_text(encoding="utf-8"))["figures"]
    assert entries, "no recorded figures: docs/results/figures.json is empty"
    report = load(server, "results/", tmp_path)
    images = {urllib.parse.urlparse(src).path.rsplit("/", 1)[-1]: width for src, width in report["images"]}
    for e in entries:
        assert e["file"] in images, f"the results page lacks {e['file']}"
        assert images[e["file"]] > 0, f"{e['file']} did not load on the results page"
    _common(report, "results/")
    experiments = load(server, "experiments/", tmp_path)
    loaded = [src for src, width in experiments["images"] if width > 0]
    assert len(loaded) >= len(entries), experiments["images"]
    _common(experiments, "experiments/")


@pytest.mark.parametrize("page", ["muon/", "manifolds/", "md/"])
def test_formulas_render_offline(server, tmp_path, page):
    report = load(server, page, tmp_path)
    assert report["formulas"] >= 3, f"{page}: {report['formulas']} formulas rendered by MathJax"
    assert report["formula_errors"] == 0 and report["unrendered"] == 0, report
    assert any(r.endswith(_docs.MATHJAX_SITE_PATH) for r in report["resources"]), report["resources"]
    _common(report, page)


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        for key in ("href", "src"):
            if a.get(key):
                self.refs.append(a[key])


def test_no_broken_internal_link_on_any_page(site):
    """Every page's links and sources into the site (files and #anchors) exist — the pages the browser tests do not
    load included."""
    pages = {p: _Links() for p in site.rglob("*.html")}
    for p, parser in pages.items():
        parser.feed(p.read_text(encoding="utf-8"))
    broken = []
    for p, parser in pages.items():
        for ref in parser.refs:
            u = urllib.parse.urlparse(ref)
            if u.scheme or u.netloc or ref.startswith(("mailto:", "javascript:", "data:")):
                continue
            path = urllib.parse.unquote(u.path)
            base = site if path.startswith("/") else p.parent  # 404.html links from the site's root
            target = (base / path.lstrip("/")).resolve() if path else p
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{p.relative_to(site)}: {ref}")
            elif u.fragment and target.suffix == ".html" and target in pages and u.fragment not in pages[target].ids:
                broken.append(f"{p.relative_to(site)}: {ref} (no such anchor)")
    assert not broken, "\n".join(broken[:30])

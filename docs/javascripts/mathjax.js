// MathJax configuration for pymdownx.arithmatex (generic mode: \( \) inline, \[ \] display), read before MathJax
// loads. MathJax itself (tex-svg-full.js: SVG output, every TeX extension built in, so nothing is fetched when a page
// is viewed) is copied into the site by docs/hooks.py from the django-static-mathjax package (the docs extra).
window.MathJax = {
  tex: { inlineMath: [["\\(", "\\)"]], displayMath: [["\\[", "\\]"]], processEscapes: true, processEnvironments: true },
  svg: { fontCache: "global" },
  options: { ignoreHtmlClass: ".*|", processHtmlClass: "arithmatex" },
  startup: { typeset: true },
};
// mkdocs-material's instant navigation swaps pages without reloading: typeset each new page
if (typeof document$ !== "undefined") {
  document$.subscribe(() => { if (window.MathJax && MathJax.typesetPromise) { MathJax.typesetPromise(); } });
}

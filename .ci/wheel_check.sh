#!/usr/bin/env bash
# Wheel check: build a wheel of weightgeom, install it (not editable) into a fresh venv, and run the commands a user
# runs, from a directory outside the checkout, so nothing can be read from the source tree.
#
#   .ci/wheel_check.sh [SOURCE_DIR]      (default: this checkout; needs ./setup.sh's .venv)
#
# Offline: the wheel is built with the .venv's setuptools (no build isolation), installed with --no-index, and the
# fresh venv sees the .venv's site-packages (torch, NumPy, the data packages, ...) through a .pth line, after its own
# site-packages, so weightgeom itself is the wheel's copy; the script checks that it is.
# About 3 minutes on 2 idle CPU cores (most of it `weightgeom demo --quick`).
# Ends with "wheel_check: N passed, 0 failed"; a failing command stops it with a non-zero exit code.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC=$(cd "${1:-$ROOT}" && pwd)
VENV_PY=$ROOT/.venv/bin/python
TMP=$(mktemp -d "${TMPDIR:-/tmp}/weightgeom-wheel.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
trap 'echo "wheel check $checks failed (exit $?): $BASH_COMMAND" >&2; echo "wheel_check: $((checks - 1)) passed, 1 failed"' ERR
t0=$SECONDS
checks=0
step() { [ "$checks" -eq 0 ] || echo "   ok"; checks=$((checks + 1)); echo "== wheel check $checks ($((SECONDS - t0)) s): $*"; }

step "build the wheel from a clean copy of $SRC (no stale build/ folder)"
mkdir -p "$TMP/src" "$TMP/dist" "$TMP/work"
cp -r "$SRC/pyproject.toml" "$SRC/README.md" "$SRC/src" "$TMP/src/"
rm -rf "$TMP"/src/src/*.egg-info
find "$TMP/src" -name __pycache__ -prune -exec rm -rf {} +
"$VENV_PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$TMP/dist" "$TMP/src"
WHEEL=$(ls "$TMP"/dist/weightgeom-*.whl)
echo "$(basename "$WHEEL")"
"$VENV_PY" - "$WHEEL" <<'EOF'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
need = ["weightgeom/benchmarks/optimizer_step.py", "weightgeom/benchmarks/_common.py",
        "weightgeom/experiments/presets/md-ci.toml", "weightgeom/configs/tiny-shakespeare.toml",
        "weightgeom/kernels/md_adam.c", "weightgeom/kernels/linalg.c"]
missing = [n for n in need if n not in names]
assert not missing, f"wheel lacks {missing}"
print(f"wheel holds {len(names)} files, the presets, configs, kernels and benchmarks among them")
EOF

step "install it into a fresh venv"
"$VENV_PY" -m venv "$TMP/venv"
PY=$TMP/venv/bin/python
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$VENV_PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$SITE/zz_weightgeom_ci_deps.pth"
"$PY" -m pip install -q --no-deps --no-index "$WHEEL"
WG=$TMP/venv/bin/weightgeom

cd "$TMP/work"
step "weightgeom is the wheel's copy"
"$PY" - "$TMP/venv" <<'EOF'
import sys
from pathlib import Path
import weightgeom
where = Path(weightgeom.__file__).resolve()
assert Path(sys.argv[1]).resolve() in where.parents, f"weightgeom imported from {where}, not the wheel"
print(f"weightgeom from {where.parent}")
EOF

step "weightgeom --version; --help imports no torch"
"$WG" --version | tee version.txt
grep -q "^weightgeom [0-9]" version.txt
"$PY" -c "
import sys
from weightgeom.cli import main
try:
    main(['--help'])
except SystemExit:
    pass
assert 'torch' not in sys.modules, 'weightgeom --help imported torch'
" > /dev/null

step "weightgeom sweep RECIPE ci --steps 2 (a few variants of each recipe's CI preset, 2 jobs)"
sweep() {  # recipe, --only list
  "$WG" sweep "$1" ci --steps 2 --only "$2" --jobs 2 --threads 1 --quiet --out "sweeps/$1"
  test -f "sweeps/$1/report.md"
}
sweep md "adamw-md-w32*,muon-md-w32*"
sweep manifolds "hetero,hetero-md"
sweep continuity "res-relu,llama-silu"

step "weightgeom train --list (the bundled configs)"
"$WG" train --list | grep -q tiny-shakespeare

step "weightgeom bench (list) and a one-step md_overhead"
"$WG" bench | grep -q optimizer_step
"$WG" bench md_overhead --base adamw --adamw-impl default --md-path eager --iters 1 --warmup 0 --device cpu

step "weightgeom demo --quick"
"$WG" demo --quick --out demo
test -f demo/report.md
echo "   ok"
echo "wheel check finished in $((SECONDS - t0)) s"
echo "wheel_check: $checks passed, 0 failed"

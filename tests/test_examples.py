"""Every script in examples/ runs at its tiny size and prints what it promises.

Table-driven over the directory listing: a new ``examples/*.py`` without an entry in ``EXAMPLES`` fails
``test_every_example_has_an_entry``, and an entry whose script is gone fails too. Each script runs in its own process
(as a user runs it: ``python examples/NAME.py --tiny``) from an empty working directory with its own empty TMPDIR,
and the test checks afterwards that it left no file in either (the examples write only into temporary folders they
delete, or ``--out``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
# Per example script: its tiny command line and the check of its output; what each asserts is what the script is
# there to show, read from its printed text.
Check = Callable[[str], None]


def _numbers_after(label: str, text: str) -> list[float]:
    """The number printed right after each occurrence of ``label``."""
    return [float(x) for x in re.findall(re.escape(label) + r"\s*([-+0-9.eE]+)", text)]


def _finetune_hf(out: str) -> None:
    assert "init='auto' (the default) refused the pretrained weights" in out and "init='keep'" in out
    assert "pass init='keep' to fine-tune it as it is" in out and "nothing was changed" in out
    cos = _numbers_after("embedding cosine vs the pretrained model (min over 4 sentences):", out)
    assert len(cos) == 2, out  # the plain loop and the HF Trainer
    assert all(c > 0.999 for c in cos), cos  # the pretrained model is kept (measured: 0.999998)
    assert "4 attention matrices on Stiefel, 2 MLP matrices on DGram" in out
    assert "Hugging Face Trainer" in out


def _finetune_lr_sweep(out: str) -> None:
    assert "task: does line B follow line A (Shakespeare, bundled, 36 plays)" in out
    num = r"\s+([0-9.]+)"
    rows = re.findall(r"^(pretrained|manifold Muon \(adamw_lr 2e-05\)|AdamW)\s+(\S+)" + 5 * num, out, re.M)
    assert [(r[0].split()[0], r[1]) for r in rows] == [("pretrained", "—"), ("manifold", "0.001"), ("AdamW", "2e-05")]
    assert rows[0][5:] == ("1.000", "0.0000")  # the pretrained row: nothing moved
    assert all(0 < float(r[6]) <= 2 * 0.001 / 2.2 for r in rows[1:2])  # 2 Muon steps of ‖ΔW‖₂ = lr, ‖W‖₂ ≥ 2.2


def _md_around_adamw(out: str) -> None:
    assert "decoupled matrices: inp.weight, blocks.0.weight" in out
    assert "γ_r mean" in out and "fused" in out  # summary(): the gains and the CPU path that ran them
    losses = _numbers_after("loss", out)
    assert losses[-1] < losses[0], losses
    gains = [float(x) for x in re.findall(r"γ_r in \[([0-9.]+), ([0-9.]+)\]", out)[0]]
    assert gains[0] < 1.0 < gains[1], gains  # the row gains moved away from their initial 1 both ways
    spheres = re.findall(r"‖Ŵ‖_F ([0-9.]+) \(radius ([0-9.]+)\)", out)
    assert spheres and all(a == b for a, b in spheres), spheres  # each direction stays on its sphere
    assert _numbers_after("max difference", out)[0] < 1e-5


def _analyze_checkpoint(out: str) -> None:
    for role in ("Q", "K", "V", "O", "Up", "Down"):
        assert re.search(rf"^{role}\s+5\s+\d\.\d{{3}} \(\d\.\d{{3}}\)", out, re.M), role  # 5 pairs of 6 layers
    assert "shared-basis runs" in out and "In plain words:" in out
    assert "C_v = |cos(v1_l, v1_l+1)|" in out and "random level sqrt(2/(π d))" in out
    assert "weightgeom analyze CHECKPOINT --suggest" in out
    assert re.search(r"wrote \d+ report files to .*: pairs\.csv, layers\.csv, summary\.csv, analysis\.json", out)


def _sweep_on_cluster(out: str) -> None:
    assert "dry run: --launcher slurm" in out
    assert "7 of 7 runs would be submitted as one SLURM job array" in out
    assert "GPU-hours requested per time-limit window: 7 runs × 1 GPU × 8 h = 56 GPU-hours" in out
    assert "#SBATCH --array=0-6" in out and "#SBATCH --partition=gpu" in out and "module load cuda" in out
    assert "nothing was written" in out and "nothing was submitted" in out


def _custom_manifold(out: str) -> None:
    assert "registered manifolds: dgram, euclidean, none, oblique, sphere, stiefel" in out
    assert "property checks passed" in out
    assert re.search(r"2\.weight\s+16×16\s+other\s+muon\s+sphere", out)
    assert out.count("check ok=True") == 2  # both constrained matrices on the sphere after training
    assert "a point off the sphere: ok=False" in out
    assert "reason: sphere: ‖W‖_F = " in out and "not sqrt(16) = 4" in out
    assert "retract() puts it back: True" in out


EXAMPLES: dict[str, tuple[list[str], Check]] = {
    "finetune_hf.py": (["--tiny"], _finetune_hf),
    "finetune_lr_sweep.py": (["--tiny"], _finetune_lr_sweep),
    "md_around_adamw.py": (["--tiny"], _md_around_adamw),
    "analyze_checkpoint.py": (["--tiny"], _analyze_checkpoint),
    "sweep_on_cluster.py": (["--tiny"], _sweep_on_cluster),
    "custom_manifold.py": (["--tiny"], _custom_manifold),
}


def _scripts() -> list[str]:
    return sorted(p.name for p in EXAMPLES_DIR.glob("*.py"))


def test_every_example_has_an_entry() -> None:
    scripts = _scripts()
    assert len(scripts) >= 5
    missing = [s for s in scripts if s not in EXAMPLES]
    assert not missing, f"examples without an entry in tests/test_examples.py EXAMPLES: {missing}"
    gone = [s for s in EXAMPLES if s not in scripts]
    assert not gone, f"EXAMPLES entries whose script is not in examples/: {gone}"
    readme = (EXAMPLES_DIR / "README.md").read_text(encoding="utf-8")
    assert all(s in readme for s in scripts), "examples/README.md should have one line per script"


@pytest.mark.parametrize("script", _scripts())
def test_example_runs_tiny(script: str, tmp_path: Path) -> None:
    assert script in EXAMPLES, f"{script}: add it to EXAMPLES in tests/test_examples.py (tiny arguments, check)"
    args, check = EXAMPLES[script]
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    # one torch thread: tiny matrices on a shared 2-core machine; offline: nothing may download
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TMPDIR": str(tmp),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(EXAMPLES_DIR / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    check(proc.stdout)
    # torch keeps its own compile cache in TMPDIR (torchinductor_<user>): not the example's
    left = [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")
            if p not in (cwd, tmp) and not p.relative_to(tmp_path).parts[1].startswith("torchinductor_")]
    assert not left, f"{script} left files outside a temporary folder it deletes: {left[:5]}"

"""Record golden outputs of the manifold-assignment paper's published code (not part of the test run).

The published repository is github.com/kiratoyoshihara/module-wise-manifold-muon; its files are read from a checkout
given on the command line and run as they are (``msign.py`` and ``manifold_muon.py`` imported, ``train.py``'s
``Muon`` class compiled from that file's own source — ``train.py`` itself trains at import). Nothing of it is copied
into this project: only the inputs and the outputs it produced, as tensors, in ``published-<class>.safetensors``
(one per class of bf16 matrix product: the published bf16 msign rounds differently on each; README.md here).

Usage (the command that made the file in this folder; see README.md here for the commit):

    git -C MIRROR archive f283b76 msign.py manifold_muon.py train.py | tar -x -C /tmp/published
    python tests/golden/published/make_golden.py /tmp/published

Recorded, all on the CPU with one torch thread:

- ``msign/<case>/in`` (float32) and ``msign/<case>/out``: the published ``msign`` (bf16, 10 steps) on tall, wide,
  square, near-orthonormal, Gaussian, low-rank and zero inputs.
- ``mm/<manifold>/<tall|wide>/lr<lr>/``: ``W0`` (a random start), ``init`` (``init_on_manifold(W0)``), ``g<k>`` the
  gradient of step k and ``w<k>`` the weight after step k of the published ``Muon.step`` (manifold_type set, as
  ``train.py`` sets it: dual ascent 20 steps, α = 0.1, momentum 0.95 summed, Nesterov), k = 1 … 5; ``floor`` the
  published code's own bf16 noise floor per step (below).
- ``plain/<tall|wide>/``: the same for an unconstrained matrix (weight decay 0.1, lr 0.02).

Noise floor: the published steps repeated ``FLOOR_RUNS`` times from the starting point (``init``; W0 for a plain
matrix) perturbed at float32 rounding (each entry times 1 + u·2⁻²⁴, u uniform in [−1, 1]; the start, not W0: the
Stiefel initialisation casts W0 to bf16 first, which would absorb the perturbation); ``floor[k−1]`` is the largest
max-entry-relative distance max|W'ₖ − Wₖ| / max|Wₖ| any repetition reached after step k. A different but equally
valid float32 evaluation (another product order, a contiguous copy instead of a transposed view) lands within that
distance; the tests hold ``preset="paper"`` to it.
"""

from __future__ import annotations

import argparse
import ast
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
STEPS = 5
FLOOR_RUNS = 32
SHAPES = {"tall": (96, 32), "wide": (32, 96)}
MANIFOLDS = ("stiefel", "dgram", "oblique")
LRS = (0.02, 0.1)
# train.py's hyper-parameters for the Muon matrices
MOMENTUM, DUAL_STEPS, DUAL_ALPHA, WEIGHT_DECAY = 0.95, 20, 0.1, 0.1
GRAD_SCALE = 0.1


def golden_kind(capped: bool = True) -> str:
    """The class of this process's bf16 matrix products (``weightgeom.benchmarks._common.cpu_kind``: AMX, AVX512-BF16,
    AVX512, AVX2, ...), which decides how the published bf16 msign rounds, so golden outputs are kept per class;
    with a oneDNN cap (``ONEDNN_MAX_CPU_ISA``) the cap's class, unless ``capped`` is False."""
    from weightgeom.benchmarks._common import cpu_kind  # noqa: PLC0415

    kind = cpu_kind()  # "AVX2 (capped; CPU: AMX)" under a cap
    return kind.split(" (")[0] if capped else kind.split("CPU: ")[-1].rstrip(")")


def _load(repo: Path):
    sys.path.insert(0, str(repo))
    import manifold_muon  # noqa: PLC0415 — the published module
    import msign  # noqa: PLC0415

    tree = ast.parse((repo / "train.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Muon")
    ns = {"torch": torch, "msign": msign.msign, "manifold_muon": manifold_muon.manifold_muon}
    exec(compile(ast.Module(body=[cls], type_ignores=[]), str(repo / "train.py"), "exec"), ns)
    return msign.msign, manifold_muon.init_on_manifold, ns["Muon"]


def _msign_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
    q, _ = torch.linalg.qr(torch.randn(192, 64, generator=g, dtype=torch.float64))
    low = torch.randn(192, 8, generator=g) @ torch.randn(8, 64, generator=g)
    return {
        "tall_gaussian": torch.randn(192, 64, generator=g),
        "wide_gaussian": torch.randn(64, 192, generator=g),
        "square_gaussian": torch.randn(128, 128, generator=g),
        # what a Stiefel retraction sees: an orthonormal W after a step of size 0.02 in a random direction
        "near_orthonormal": (q + 0.02 * torch.randn(192, 64, generator=g, dtype=torch.float64) / 8).float(),
        "low_rank": low,
        "zero": torch.zeros(16, 8),
    }


def _run(Muon, init_on_manifold, manifold: str | None, W0: torch.Tensor, grads: list[torch.Tensor], lr: float,
         on_manifold: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    p = torch.nn.Parameter(W0.clone())
    if manifold is not None:
        p.manifold_type = manifold
    if manifold is not None and not on_manifold:
        with torch.no_grad():
            p.data.copy_(init_on_manifold(p.data.float(), manifold).to(p.dtype))
    init = p.detach().clone()
    opt = Muon([{"params": [p]}], lr=lr, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
               dual_ascent_steps=DUAL_STEPS, dual_ascent_alpha=DUAL_ALPHA)
    out = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        out.append(p.detach().clone())
    return init, out


def _floor(Muon, init_on_manifold, manifold, start, grads, lr, ref: list[torch.Tensor], g: torch.Generator
           ) -> torch.Tensor:
    worst = torch.zeros(len(ref), dtype=torch.float64)
    for _ in range(FLOOR_RUNS):
        u = torch.rand(start.shape, generator=g) * 2 - 1
        _, ws = _run(Muon, init_on_manifold, manifold, start * (1 + u * 2.0**-24), grads, lr, on_manifold=True)
        d = torch.tensor([float((w - r).abs().max() / r.abs().max()) for w, r in zip(ws, ref)], dtype=torch.float64)
        worst = torch.maximum(worst, d)
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo", type=Path, help="a checkout of the published repository (msign.py, manifold_muon.py, "
                                             "train.py)")
    ap.add_argument("--commit", default="f283b76e680243a7e894e33123ba27b26d8fd834",
                    help="the published commit the checkout holds (recorded in the file's metadata)")
    ap.add_argument("--out", type=Path, default=None,
                    help="where to write (default: published-<bf16 kind>.safetensors here: "
                         "weightgeom.benchmarks._common.cpu_kind(), a oneDNN cap's class where "
                         "ONEDNN_MAX_CPU_ISA sets one)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    msign, init_on_manifold, Muon = _load(args.repo.resolve())
    g = torch.Generator().manual_seed(20261205)
    t: dict[str, torch.Tensor] = {}
    for name, X in _msign_inputs(g).items():
        t[f"msign/{name}/in"] = X.contiguous()
        t[f"msign/{name}/out"] = msign(X.clone()).contiguous()
    for manifold in (*MANIFOLDS, None):
        for orient, shape in SHAPES.items():
            for lr in (LRS if manifold is not None else (0.02,)):
                key = f"mm/{manifold}/{orient}/lr{lr:g}" if manifold is not None else f"plain/{orient}"
                W0 = torch.randn(shape, generator=g) / shape[1] ** 0.5
                grads = [torch.randn(shape, generator=g) * GRAD_SCALE for _ in range(STEPS)]
                init, ws = _run(Muon, init_on_manifold, manifold, W0, grads, lr)
                t[f"{key}/W0"] = W0
                if manifold is not None:
                    t[f"{key}/init"] = init
                for k, (gk, wk) in enumerate(zip(grads, ws), 1):
                    t[f"{key}/g{k}"] = gk
                    t[f"{key}/w{k}"] = wk
                t[f"{key}/floor"] = _floor(Muon, init_on_manifold, manifold, init, grads, lr, ws, g)
                print(key, " ".join(f"{v:.2e}" for v in t[f"{key}/floor"].tolist()))
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "")
    amx = " with AMX" if "amx_bf16" in cpu else (" with AVX512-BF16" if "avx512_bf16" in cpu else "")
    kind = golden_kind()
    out = args.out or HERE / f"published-{kind}.safetensors"
    meta = {
        "source": "github.com/kiratoyoshihara/module-wise-manifold-muon",
        "commit": args.commit,
        "command": ("ONEDNN_MAX_CPU_ISA=" + os.environ["ONEDNN_MAX_CPU_ISA"] + " "
                    if os.environ.get("ONEDNN_MAX_CPU_ISA") else "")
        + "python tests/golden/published/make_golden.py /tmp/published",
        "bf16_kind": kind,
        "torch": torch.__version__,
        "cpu": (model or platform.machine()) + amx + (f" (capped to {kind})" if kind != golden_kind(False) else ""),
        "threads": "1",
    }
    save_file({k: v.contiguous() for k, v in t.items()}, str(out), metadata=meta)
    print(f"wrote {out} ({len(t)} tensors)")


if __name__ == "__main__":
    main()

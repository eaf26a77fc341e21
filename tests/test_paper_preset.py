"""``optim.preset = "paper"``: the manifold-assignment paper's published algorithm, step by step.

The reference below is a slow float64 transcription of that algorithm written independently of the library (its own
momentum, cold-started 20-step dual ascent with linearly decaying α, last iterate, Polar Express, retractions). The
optimizer is run with the preset's group keys and compared against it:

- in float64 (msign computed in float64 through the ``msign_dtype`` group key, and the Stiefel "paper" retraction's
  bf16 msign replaced by its float64 counterpart): equal to ``EXACT_ATOL``;
- as the preset really runs (bf16 msign): within ``BF16_RTOL`` (worst entry difference ÷ largest entry) of the
  float64 reference. bf16 keeps 8 significant bits (rounding 2⁻⁸ ≈ 3.9e-3) and 10 bf16 Polar Express steps do not
  drive small singular values to 1, so the published Stiefel retraction (itself a bf16 msign of a random start) is
  the loosest: measured on 24×10, seeds 3 and 5, after 3 steps: Stiefel 1.35e-2 / 1.26e-2, DGram 2.3e-3 / 2.3e-3,
  Oblique 4.2e-4 / 5.3e-4, unconstrained 6.5e-5 / 8.3e-5. The bounds leave about 2× headroom.

The published code's own bf16 outputs (not a transcription) are the golden files of tests/test_published_golden.py.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import weightgeom.manifolds.stiefel as stiefel_mod
from weightgeom.linalg import msign
from weightgeom.models import GPT, GPTConfig
from weightgeom.optim import DualAscent, Muon, build_optimizer
from weightgeom.optim.config import PAPER_MUON, MuonConfig, OptimConfig
from weightgeom.optim.param_groups import STRATEGIES
from weightgeom.train.config import describe_presets, dump_toml, load_config, preset_report

EXACT_ATOL = 1e-10
BF16_RTOL = {"stiefel": 3e-2, "dgram": 5e-3, "oblique": 1.2e-3, None: 2e-4}
LR = 0.02
STEPS = 3

# Polar Express (Amsel et al. 2025): per-step (a, b, c), safety 1.01 on all but the last, the last repeated.
_PE = [(8.28721201814563, -23.595886519098837, 17.300387312530933),
       (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
       (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
       (3.3184196573706015, -2.488488024314874, 0.51004894012372),
       (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
       (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
       (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
       (1.875, -1.25, 0.375)]
_PE_SAFE = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _PE[:-1]] + [_PE[-1]]


def ref_msign(X: torch.Tensor) -> torch.Tensor:
    """Polar Express, 10 steps, float64, input divided by ‖X‖_F·1.01 (wide orientation), each step evaluated as
    (a·I + (b·I + c·S)·S)·Y with S = YYᵀ, as published (tests/test_published_golden.py holds the bf16 original)."""
    tall = X.shape[0] > X.shape[1]
    Y = X.T if tall else X
    Y = Y / (torch.linalg.norm(Y) * 1.01)
    eye = torch.eye(Y.shape[0], dtype=Y.dtype)
    for k in range(10):
        a, b, c = _PE_SAFE[min(k, len(_PE_SAFE) - 1)]
        S = Y @ Y.T
        Y = (a * eye + (b * eye + c * S) @ S) @ Y
    return Y.T if tall else Y


def ref_P(name: str, S: torch.Tensor) -> torch.Tensor:
    d = torch.diag(torch.diagonal(S))
    return {"stiefel": S, "dgram": S - d, "oblique": d}[name]


def ref_retract(name: str, X: torch.Tensor) -> torch.Tensor:
    """The published retractions on a tall X."""
    if name == "stiefel":
        return ref_msign(X)
    if name == "dgram":
        U, S, Vh = torch.linalg.svd(X, full_matrices=False)
        return (U @ Vh) * S
    return X / torch.linalg.norm(X, dim=0).clamp_min(1e-8)


def ref_run(name: str | None, W0: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """The published algorithm on one matrix: momentum B ← 0.95B + g, U = g + 0.95B; manifold: cold start, 20 dual
    steps (α = 0.1(1 − k/20), stop below 1e-6, last iterate), W ← retract(W − lr·A); none: decay 0.1."""
    wide = W0.shape[0] < W0.shape[1]
    X = (W0.T if wide else W0).clone()
    if name is not None:
        X = ref_retract(name, X)  # before training: onto the manifold
    B = torch.zeros_like(X)
    for g in grads:
        g = g.T if wide else g
        B = 0.95 * B + g
        U = g + 0.95 * B
        if name is None:
            X = X * (1 - LR * 0.1) - LR * ref_msign(U)
            continue
        Lam = -0.25 * ref_P(name, X.T @ U + U.T @ X)
        for k in range(20):
            A = ref_msign(U + 2 * X @ ref_P(name, 0.5 * (Lam + Lam.T)))
            H = ref_P(name, X.T @ A + A.T @ X)
            if torch.linalg.norm(H) / H.numel() ** 0.5 < 1e-6:
                break
            Lam = Lam - 0.1 * (1 - k / 20) * H
        X = ref_retract(name, X - LR * A)
    return X.T if wide else X


def _problem(shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    W0 = torch.randn(*shape, generator=g, dtype=torch.float64) * torch.linspace(0.5, 1.5, shape[1],
                                                                                 dtype=torch.float64)
    # momentum-like gradients: a shared decaying-spectrum part plus noise, of a realistic small scale
    base = torch.randn(*shape, generator=g, dtype=torch.float64)
    grads = [1e-2 * (base + 0.5 * torch.randn(*shape, generator=g, dtype=torch.float64)) for _ in range(STEPS)]
    return W0, grads


def _paper_group_keys(manifold: str | None) -> dict:
    """The group keys ``optim.preset = "paper"`` gives Muon (``MuonConfig.kwargs`` of the preset config), with the
    manifold groups' weight decay 0 as ``build.from_config`` sets it."""
    kw = OptimConfig(preset="paper").muon.kwargs()
    kw.pop("on_nonfinite")  # optimizer-wide, not a group key
    kw["lr"] = LR
    if manifold is not None:
        kw["weight_decay"] = 0.0
    return kw


def _run_ours(manifold: str | None, W0: torch.Tensor, grads: list[torch.Tensor], **override) -> torch.Tensor:
    p = torch.nn.Parameter(W0.clone())
    opt = Muon([{"params": [p], "manifold": manifold, **{**_paper_group_keys(manifold), **override}}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first retraction of a random start moves it far (expected)
        for g in grads:
            p.grad = g.clone()
            opt.step()
    return p.detach()


# every manifold, tall / wide / square orientations among them (the reference transposes wide matrices itself)
CASES = [("stiefel", (20, 8)), ("stiefel", (8, 20)), ("dgram", (20, 8)), ("dgram", (12, 12)), ("oblique", (8, 20)),
         (None, (20, 8))]


@pytest.mark.parametrize("manifold,shape", CASES, ids=[f"{m}-{s[0]}x{s[1]}" for m, s in CASES])
def test_paper_preset_equals_float64_transcription(manifold, shape, monkeypatch):
    # test-only override: the Stiefel "paper" retraction's bf16 msign computed in float64 (same arithmetic)
    monkeypatch.setattr(stiefel_mod, "msign", lambda W, method: msign(W, method, dtype=torch.float64))
    W0, grads = _problem(shape, seed=hash((manifold, shape)) % 1000)
    ref = ref_run(manifold, W0, grads)
    ours = _run_ours(manifold, W0, grads, msign_dtype=torch.float64)
    torch.testing.assert_close(ours, ref, atol=EXACT_ATOL, rtol=0)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "oblique", None])
def test_paper_preset_in_bf16_close_to_float64_transcription(manifold):
    W0, grads = _problem((24, 10), seed=3)
    ref = ref_run(manifold, W0, grads)
    ours = _run_ours(manifold, W0.float(), [g.float() for g in grads])
    assert ours.dtype == torch.float32
    err = float((ours.double() - ref).abs().max() / ref.abs().max())
    assert err <= BF16_RTOL[manifold], err
    assert err > 1e-5  # really computed in bf16 (a float32 path would agree to ~1e-6)


def test_paper_preset_differs_from_ours():
    """The test above can fail: our default algorithm on the same problem is far from the transcription."""
    W0, grads = _problem((20, 8), seed=4)
    ref = ref_run("dgram", W0, grads)
    p = torch.nn.Parameter(W0.clone())
    opt = Muon([{"params": [p], "manifold": "dgram"}], lr=LR)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert float((p.detach() - ref).abs().max()) > 1e-3


def _tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=11, block_size=8, bias=False))


@pytest.mark.parametrize("strategy", ["unconstrained", "all-stiefel", "all-dgram", "hetero", "hetero-inv"])
def test_config_preset_builds_the_paper_groups(strategy):
    cfg = OptimConfig(preset="paper", strategy=strategy)
    opt = build_optimizer(_tiny_gpt(), config=cfg)
    muon_groups = [g for g in opt.param_groups if g["algorithm"] == "muon"]
    assert muon_groups and any(g["algorithm"] == "adamw" for g in opt.param_groups)
    expected_manifolds = {m for m in STRATEGIES[strategy].values()}
    assert {g["manifold"] for g in muon_groups} == expected_manifolds
    for g in muon_groups:
        assert DualAscent.from_group(g) == PAPER_MUON["dual"] == DualAscent.preset("published")
        for k, v in PAPER_MUON.items():
            if k in ("weight_decay", "dual"):
                continue
            want = getattr(torch, v) if k == "msign_dtype" else v
            assert g[k] == want, (strategy, g["manifold"], k, g[k], want)
        assert g["weight_decay"] == (0.1 if g["manifold"] is None else 0.0), (strategy, g["manifold"])
    for g in opt.param_groups:  # AdamW groups as the config says
        if g["algorithm"] == "adamw":
            assert g["lr"] == cfg.adamw.lr and g["betas"] == tuple(cfg.adamw.betas)


def test_preset_fills_defaults_and_keeps_set_keys():
    cfg = OptimConfig(preset="paper", muon=MuonConfig(dual=DualAscent(steps=7), lr=0.01))
    assert cfg.muon.dual.steps == 7 and cfg.muon.lr == 0.01  # set keys (and dual fields) win
    assert cfg.muon.dual.normalize is False and cfg.muon.retraction == "paper"  # defaults take the preset
    assert cfg.preset_overrides() == {"dual.steps": (7, 20)}
    assert OptimConfig(preset="paper", muon=cfg.muon) == cfg  # idempotent (the resolved config loads back equal)
    assert OptimConfig().muon == MuonConfig() and OptimConfig().preset_overrides() == {}


def test_preset_never_replaces_a_written_key_even_at_its_default():
    # written = in the file / --set / constructor arguments; not "differs from the default"
    cfg = load_config(None, ["optim.preset=paper", "optim.muon.dual.steps=1", "optim.muon.dual.project=true"])
    assert cfg.optim.muon.dual.steps == 1 and cfg.optim.muon.dual.project is True
    assert cfg.optim.muon.dual.keep == "last"  # unwritten fields take the preset's value
    assert OptimConfig(preset="paper", muon=MuonConfig(dual=DualAscent(steps=1))).muon.dual.steps == 1
    assert OptimConfig(preset="paper").muon.dual == DualAscent.preset("published")
    assert load_config({"optim": {"preset": "paper", "muon": {"dual": {"steps": 1}}}}).optim.muon.dual.steps == 1
    report = preset_report(cfg)["optim.preset"]
    assert report["kept"] == {"optim.muon.dual.steps": [1, 20], "optim.muon.dual.project": [True, False]}
    assert report["set"]["optim.muon.retraction"] == "paper" and report["set"]["optim.muon.dual.keep"] == "last"
    (line,) = describe_presets(preset_report(cfg))
    assert line.startswith('optim.preset="paper" set ') and "optim.muon.dual.steps=1 (the preset's: 20)" in line
    assert preset_report(load_config(None, ["optim.preset=ours"])) == {}


def test_preset_says_manifold_groups_get_no_weight_decay():
    # as published: no decay on constrained matrices, whatever optim.muon.weight_decay says (it decays the
    # unconstrained Muon matrices); the preset's line says so, written key or not
    key = "manifold groups' weight_decay (optim.muon.weight_decay: unconstrained matrices)"
    for sets in ([], ["optim.muon.weight_decay=0.05"]):
        cfg = load_config(None, ["optim.preset=paper", "optim.strategy=hetero", *sets])
        opt = build_optimizer(_tiny_gpt(), config=cfg.optim)
        assert {g["weight_decay"] for g in opt.param_groups if g.get("manifold") is not None} == {0.0}
        assert preset_report(cfg)["optim.preset"]["set"][key] == 0.0
        assert f"{key}=0.0" in describe_presets(preset_report(cfg))[0]


def test_preset_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["optim.preset=paper", "optim.strategy=hetero", "optim.muon.dual.steps=9"])
    assert cfg.optim.muon.dual.keep == "last" and cfg.optim.muon.dual.steps == 9
    text = dump_toml(cfg)
    assert 'preset = "paper"' in text and "[optim.muon.dual]" in text and 'keep = "last"' in text
    assert 'retraction = "paper"' in text
    (tmp_path / "c.toml").write_text(text)
    assert load_config(str(tmp_path / "c.toml")) == cfg
    assert dataclasses.replace(cfg.optim.muon) == cfg.optim.muon

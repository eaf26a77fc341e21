"""Activation-aware compression: the whitened fits are the optima of the layer-output error (checked against float64
references on tiny random layers), the calibration pass collects the right Grams, ``auto`` picks the lowest loss,
and what compress writes with calibration loads through the existing reader."""

import math

import pytest
import torch

from weightgeom.analysis.compress_fit import (
    fit_group,
    fit_per_layer,
    fit_shared_input,
    fit_shared_output,
    output_error,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _correlated(T: int, n: int, seed: int) -> torch.Tensor:
    """T×n float64 activations with strongly correlated, unequally scaled features (a non-diagonal Gram)."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(n, n, generator=g, dtype=torch.float64) * torch.logspace(0, -2, n, dtype=torch.float64)
    return torch.randn(T, n, generator=g, dtype=torch.float64) @ A + 0.3


def _layer(m: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(m, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _data_error(W, What, X) -> float:
    """Mean squared output error computed on the activations themselves: (1/T)‖X (W − Ŵ)ᵀ‖_F²."""
    return float(((X @ (W.double() - What.double()).mT) ** 2).sum()) / X.shape[0]


def _sqrtm(G):
    vals, vecs = torch.linalg.eigh(G)
    return (vecs * vals.clamp_min(0).sqrt()) @ vecs.mT, (vecs * vals.clamp_min(1e-300).rsqrt()) @ vecs.mT


# (m, n, r, T, seed): tall, wide and square layers; T > n so the Gram is invertible
SHAPES = [(6, 8, 2, 200, 0), (9, 5, 3, 100, 1), (7, 7, 1, 60, 2)]


@pytest.mark.parametrize("m,n,r,T,seed", SHAPES)
def test_whitened_per_layer_is_the_output_error_optimum(m, n, r, T, seed):
    W, X = _layer(m, n, seed), _correlated(T, n, seed + 10)
    G = X.mT @ X / T
    fit = fit_per_layer(W, G, r)
    What = fit.coefs[0].double() @ fit.basis[0].double().mT
    assert torch.linalg.matrix_rank(What).item() <= r
    err = _data_error(W, What, X)
    assert fit.errors[0] == pytest.approx(err, rel=1e-4)  # the Gram form equals the error on the data
    # the float64 reference: Eckart–Young on W G^½ (a different square root than the Cholesky factor)
    R, Rinv = _sqrtm(G)
    U, s, Vh = torch.linalg.svd(W @ R)
    opt = float((s[r:] ** 2).sum())
    assert err == pytest.approx(opt, rel=1e-4)
    ref = (U[:, :r] * s[:r]) @ Vh[:r] @ Rinv
    assert _data_error(W, ref, X) == pytest.approx(opt, rel=1e-4)
    # plain (weight-only) truncated SVD at the same rank is worse on the outputs
    U0, s0, Vh0 = torch.linalg.svd(W)
    plain = (U0[:, :r] * s0[:r]) @ Vh0[:r]
    assert _data_error(W, plain, X) > err * (1 + 1e-3)
    # and no random rank-r perturbation of the fit does better
    g = torch.Generator().manual_seed(seed)
    for _ in range(5):
        C = fit.coefs[0].double() + 1e-2 * torch.randn(m, r, generator=g, dtype=torch.float64)
        B = fit.basis[0].double() + 1e-2 * torch.randn(n, r, generator=g, dtype=torch.float64)
        assert _data_error(W, C @ B.mT, X) >= err * (1 - 1e-6)


@pytest.mark.parametrize("m,n,r,T,seed", SHAPES)
def test_shared_fits_coefficients_are_least_squares_optimal(m, n, r, T, seed):
    k = 3
    Ws = [_layer(m, n, seed + 100 + i) for i in range(k)]
    Xs = [_correlated(T, n, seed + 200 + i) for i in range(k)]
    Gs = [X.mT @ X / T for X in Xs]
    # input space: C_l minimises (1/T)‖X_l W_lᵀ − X_l B C_lᵀ‖² for the shared B (lstsq on the data)
    fin = fit_shared_input(Ws, Gs, r)
    B = fin.basis.double()
    for W, X, C, e in zip(Ws, Xs, fin.coefs, fin.errors):
        ref = torch.linalg.lstsq(X @ B, X @ W.mT).solution.mT
        torch.testing.assert_close(C.double(), ref, rtol=1e-4, atol=1e-4)
        assert e == pytest.approx(_data_error(W, C.double() @ B.mT, X), rel=1e-4)
    # output space: C_l = Uᵀ W_l is the lstsq solution of X_l W_lᵀ U ≈ X_l C_lᵀ, and U the exact joint optimum
    fout = fit_shared_output(Ws, Gs, r)
    U = fout.basis.double()
    torch.testing.assert_close(U.mT @ U, torch.eye(r, dtype=torch.float64), rtol=0, atol=1e-5)
    for W, X, C in zip(Ws, Xs, fout.coefs):
        ref = torch.linalg.lstsq(X, X @ W.mT @ U).solution.mT
        torch.testing.assert_close(C.double(), ref, rtol=1e-4, atol=1e-4)
    M = sum(W @ G @ W.mT for W, G in zip(Ws, Gs))
    opt = float(torch.linalg.eigvalsh(M)[:-r].sum()) if r < m else 0.0
    assert sum(fout.errors) == pytest.approx(opt, rel=1e-4, abs=1e-9)
    g = torch.Generator().manual_seed(seed)
    for _ in range(5):  # any other orthonormal basis loses more
        Q = torch.linalg.qr(U + 0.05 * torch.randn(m, r, generator=g, dtype=torch.float64)).Q
        assert sum(output_error(W, Q @ Q.mT @ W, G) for W, G in zip(Ws, Gs)) >= opt * (1 - 1e-9)
    # per layer (space none) through the dispatcher: each layer's error is its own optimum, below the shared ones
    fnone = fit_group("none", Ws, Gs, r)
    assert [len(fnone.basis), len(fnone.coefs)] == [k, k]
    assert sum(fnone.errors) <= min(sum(fin.errors), sum(fout.errors)) * (1 + 1e-9)


def test_input_shared_basis_is_the_optimum_when_layers_share_inputs():
    """With one Gram for the whole group, the whitened stacked SVD is the exact joint optimum."""
    m, n, r, k = 5, 8, 3, 3
    Ws = [_layer(m, n, 300 + i) for i in range(k)]
    X = _correlated(120, n, 7)
    G = X.mT @ X / 120
    fit = fit_shared_input(Ws, [G] * k, r)
    R, _ = _sqrtm(G)
    s = torch.linalg.svdvals(torch.cat([W @ R for W in Ws], 0))
    assert sum(fit.errors) == pytest.approx(float((s[r:] ** 2).sum()), rel=1e-4)


# ------------------------------------------------------------------------------------------------- on a tiny model
@pytest.fixture(scope="module")
def tiny_lm():
    import transformers

    from weightgeom.analysis.perplexity import CausalLM

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return CausalLM(model, lambda s: [ord(c) % 40 for c in s], "tiny", "hf", 64)


def test_collect_grams_matches_the_inputs_and_shares_q_k_v(tiny_lm):
    from weightgeom.analysis.calibration import calibration_text, collect_grams

    text = calibration_text()
    grams = collect_grams(tiny_lm, text, ("Q", "K", "V", "O", "Down"), tokens=50, context=32)
    assert grams.tokens == 50
    ids = torch.tensor([ord(c) % 40 for c in text[:50]])
    seen = []
    h = tiny_lm.model.model.layers[2].mlp.down_proj.register_forward_hook(lambda mod, i, o: seen.append(i[0]))
    with torch.no_grad():
        tiny_lm.model(ids[None, :32])
        tiny_lm.model(ids[None, 32:50])
    h.remove()
    X = torch.cat([x.reshape(-1, x.shape[-1]) for x in seen]).double()
    torch.testing.assert_close(grams.get("Down", 2), X.mT @ X / 50, rtol=1e-6, atol=1e-9)
    assert grams.get("Q", 1) is grams.get("K", 1) is grams.get("V", 1)  # one Gram for one input
    assert grams.get("O", 1) is not grams.get("Q", 1)
    with pytest.raises(KeyError, match="role Gate layer 0"):
        grams.get("Gate", 0)


def test_collect_grams_holds_the_last_tokens_apart_in_windows_of_their_own(tiny_lm):
    from weightgeom.analysis.calibration import calibration_text, collect_grams

    text = calibration_text()
    grams = collect_grams(tiny_lm, text, ("Down",), tokens=64, context=32, holdout=0.25)
    assert (grams.tokens, grams.held_tokens) == (64, 16)
    ids = torch.tensor([ord(c) % 40 for c in text[:64]])
    seen = []
    h = tiny_lm.model.model.layers[1].mlp.down_proj.register_forward_hook(lambda mod, i, o: seen.append(i[0]))
    with torch.no_grad():
        for a, b in ((0, 32), (32, 48), (48, 64)):  # the held-out part (the last 16) starts a window
            tiny_lm.model(ids[None, a:b])
    h.remove()
    X = [x.reshape(-1, x.shape[-1]).double() for x in seen]
    fit, held = torch.cat(X[:2]), X[2]
    torch.testing.assert_close(grams.held[("Down", 1)], held.mT @ held / 16, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(grams.fit_part().get("Down", 1), fit.mT @ fit / 48, rtol=1e-6, atol=1e-9)
    whole = torch.cat(X)
    torch.testing.assert_close(grams.get("Down", 1), whole.mT @ whole / 64, rtol=1e-6, atol=1e-9)
    assert collect_grams(tiny_lm, text, ("Down",), tokens=64, context=32).fit_part().held_tokens == 0


def test_auto_scores_every_space_on_held_out_tokens_and_fits_the_choice_on_all(tiny_lm):
    """auto's loss of a space is the error, on the held-out Grams, of that space's fit to the other tokens (not the
    fit's own loss, which favours the fit that overfits most); the written groups are fitted on all the tokens."""
    from weightgeom.analysis.calibration import calibration_text, collect_grams
    from weightgeom.analysis.compress import CompressConfig, _groups, _plan
    from weightgeom.analysis.compress_choice import choose_by_loss, compress_calibrated
    from weightgeom.analysis.compress_fit import output_energy
    from weightgeom.analysis.roles import assign_roles

    grams = collect_grams(tiny_lm, calibration_text(), ("O", "Down"), tokens=64, context=32, holdout=0.25)
    sd = {k: v.clone() for k, v in tiny_lm.model.state_dict().items()}
    by_role = {r: assign_roles(sd)[r] for r in ("O", "Down")}
    cfg = CompressConfig(share="auto", savings=0.3, layers_per_group=2, roles=("O", "Down"), calibration="x")
    info = choose_by_loss(by_role, cfg, grams)
    fit_g = grams.fit_part()
    for role, v in info.items():
        assert v["by"] == "held-out loss"
        for space in ("input", "output", "none"):
            (_, _, _, r), *_ = _plan({role: by_role[role]}, cfg, {role: space})
            err = en = 0.0
            for g in _groups(by_role[role], 2):
                Ws = [rw.weight.float() for rw in g]
                f = fit_group(space, Ws, [fit_g.get(role, rw.layer) for rw in g], r)
                for rw, W, c in zip(g, Ws, f.coefs):
                    B = f.basis if space != "none" else f.basis[g.index(rw)]
                    What = B.double() @ c.double() if space == "output" else c.double() @ B.double().mT
                    err += output_error(W, What, grams.held[(role, rw.layer)])
                    en += output_energy(W, grams.held[(role, rw.layer)])
            assert v["loss"][space] == pytest.approx(err / en, rel=1e-4), (role, space)
            assert v["fit_loss"][space] < v["loss"][space], (role, space)  # in-sample looks better than it is
        assert v["space"] == min(v["loss"], key=v["loss"].get)
    res = compress_calibrated(sd, None, cfg, grams=grams)
    assert {r: v["space"] for r, v in res.spaces.items()} == {r: v["space"] for r, v in info.items()}
    for g in res.index["groups"]:  # the chosen space refitted on all 64 tokens: its loss is the whole Grams' fit's
        Ws = [by_role[g["role"]][i].weight.float() for i in g["layers"]]
        whole = fit_group(g["space"], Ws, [grams.get(g["role"], i) for i in g["layers"]], g["rank"])
        assert g["calib_loss"] == pytest.approx(whole.loss, rel=1e-6)
    assert res.index["calibration"] == {"text": grams.text, "tokens": 64, "held_tokens": 16}


def test_calibration_text_is_disjoint_from_the_heldout_text():
    from weightgeom.analysis.calibration import calibration_text
    from weightgeom.analysis.perplexity import heldout_text
    from weightgeom.data.corpora import shakespeare_text

    cal, held, full = calibration_text(), heldout_text(), shakespeare_text()
    assert full == cal + held


def test_calibrated_compress_writes_what_the_reader_applies_and_auto_picks_the_lowest_loss(tiny_lm, tmp_path):
    from weightgeom.analysis.calibration import calibration_text, collect_grams
    from weightgeom.analysis.compress import CompressConfig, apply_compressed, compress
    from weightgeom.analysis.compress_choice import compress_calibrated, format_choice_table

    grams = collect_grams(tiny_lm, calibration_text(), tokens=64, context=32)
    sd = {k: v.clone() for k, v in tiny_lm.model.state_dict().items()}
    cfg = CompressConfig(share="auto", savings=0.3, layers_per_group=2, calibration="shakespeare")
    with pytest.raises(ValueError, match="compress_calibrated"):
        compress(sd, tmp_path / "c", cfg, grams=grams)  # auto's choice by loss is the calibrated entry's
    res = compress_calibrated(sd, tmp_path / "c", cfg, grams=grams)
    for role, v in res.spaces.items():
        finite = {s: x for s, x in v["loss"].items() if not math.isnan(x)}
        assert v["space"] == min(finite, key=finite.get), role
    assert res.index["calibration"]["tokens"] == 64
    assert "calib_loss" in res.table.columns
    assert "loss per-layer" in format_choice_table(res.spaces)
    # the written groups reproduce the losses: apply them and measure each layer's output error with its Gram
    target = {k: v.clone() for k, v in sd.items()}
    assert apply_compressed(target, tmp_path / "c") == sum(len(g["layers"]) for g in res.index["groups"])
    from weightgeom.analysis.compress_fit import output_energy
    from weightgeom.analysis.roles import assign_roles

    before, after = assign_roles(sd), assign_roles(target)
    for g in res.index["groups"]:
        err = sum(output_error(before[g["role"]][i].weight, after[g["role"]][i].weight, grams.get(g["role"], i))
                  for i in g["layers"])
        en = sum(output_energy(before[g["role"]][i].weight, grams.get(g["role"], i)) for i in g["layers"])
        assert err / en == pytest.approx(g["calib_loss"], rel=1e-3, abs=1e-6)


def test_calibrated_fit_beats_the_weight_only_fit_on_the_calibration_loss(tiny_lm):
    from weightgeom.analysis.calibration import calibration_text, collect_grams
    from weightgeom.analysis.compress import CompressConfig, compress_roles
    from weightgeom.analysis.compress_fit import output_energy
    from weightgeom.analysis.roles import assign_roles

    grams = collect_grams(tiny_lm, calibration_text(), ("Down",), tokens=64, context=32)
    by_role = {"Down": assign_roles(tiny_lm.model.state_dict())["Down"]}
    for share in ("input", "output", "none"):
        cfg = CompressConfig(share=share, rank=3, layers_per_group=2, roles=("Down",))
        cal = list(compress_roles(None, cfg, by_role=by_role, grams=grams))
        plain = list(compress_roles(None, cfg, by_role=by_role))
        for a, b in zip(cal, plain):
            e_plain = sum(output_error(rw.weight, b.dense(rw.layer), grams.get("Down", rw.layer))
                          for rw in by_role["Down"] if rw.layer in b.coefs)
            en = sum(output_energy(rw.weight, grams.get("Down", rw.layer)) for rw in by_role["Down"]
                     if rw.layer in b.coefs)
            assert a.calib_loss < e_plain / en, share


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    d = tmp_path_factory.mktemp("tiny_llama_cal") / "hf"
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(d, safe_serialization=True)
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz .,!?'")}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=" ").save_pretrained(d)
    return d


def test_cli_compress_calibrated_auto_prints_the_per_role_table_and_eval_reads_it(hf_dir, tmp_path, capsys):
    from weightgeom.cli import main

    out = tmp_path / "c"
    assert main(["compress", str(hf_dir), "--out", str(out), "--savings", "0.3", "--calibration-tokens", "64",
                 "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "lowest calibration loss" in text and "loss per-layer" in text and "calib_loss" in text
    for role in ("Q", "K", "O", "Gate", "Up", "Down"):
        assert any(line.startswith(role + " ") for line in text.splitlines()), role
    assert main(["eval", str(out), "--tokens", "30", "--context", "16", "--compare", "--max-ratio", "50",
                 "--quiet"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "the uncompressed model itself is no better than guessing uniformly" in last  # a random-init model
    # a missing calibration file: one line, exit 2, nothing written
    assert main(["compress", str(hf_dir), "--out", str(tmp_path / "d"), "--savings", "0.3", "--calibration",
                 str(tmp_path / "nope.txt"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--calibration" in err[0] and "no such file" in err[0]
    assert not (tmp_path / "d").exists()
    assert main(["eval", str(out), "--max-ratio", "2", "--quiet"]) == 2  # --max-ratio without --compare
    assert "--max-ratio is for --compare" in capsys.readouterr().err


@pytest.mark.parametrize("nll,base_nll,vocab,max_ratio,says", [
    (7.0, 4.0, 100, None, "BROKEN: its NLL 7.000 nats/token is above ln(100)"),
    (4.5, 4.0, 100, 1.5, "BROKEN by your --max-ratio 1.5"),
    (4.2, 4.0, 100, None, "usable: perplexity 1.22×"),
    (5.0, 4.8, 100, None, "the uncompressed model itself is no better than guessing uniformly"),
])
def test_eval_compare_verdict_in_plain_words(nll, base_nll, vocab, max_ratio, says):
    from weightgeom.analysis.compress_cli import _verdict
    from weightgeom.analysis.perplexity import PerplexityResult

    comp = PerplexityResult(math.exp(nll), nll, 10, 1, 10, 0.0)
    base = PerplexityResult(math.exp(base_nll), base_nll, 10, 1, 10, 0.0)
    assert says in _verdict(comp, base, vocab, max_ratio)


def test_model_scope_sweep_resumed_keeps_its_continuity_analysis_and_sums_its_wall_time(tiny_lm, tmp_path,
                                                                                         monkeypatch):
    import weightgeom.experiments.compression as comp

    monkeypatch.setattr(comp, "resolve_model", lambda model: model)
    cfg = comp.CompressSweep(model="tiny", roles=("Q", "K"), savings=(0.3,), scope="model", methods=("shared",),
                             tokens=30, context=16, calibration_tokens=48, layers_per_group=2)
    first = comp.run_compress_sweep(cfg, tmp_path, lm=tiny_lm, progress=False)
    assert set(first["spaces"]) == {"Q", "K"}  # the weight-only method's continuity analysis
    grown = comp.run_compress_sweep(comp.CompressSweep(**{**cfg.__dict__, "methods": ("shared", "svd")}), tmp_path,
                                    lm=tiny_lm, progress=False)
    assert [r["method"] for r in grown["rows"]] == ["shared", "svd"]
    assert grown["rows"][0]["ppl"] == first["rows"][0]["ppl"]  # reused, not recomputed
    assert grown["spaces"] == first["spaces"]  # not recomputed, not lost
    assert grown["wall_s"] > first["wall_s"]


def test_model_scope_sweep_compresses_every_role_per_method_and_restores_the_weights(tiny_lm, tmp_path):
    from weightgeom.analysis.perplexity import perplexity_of_ids
    from weightgeom.experiments.compression import CompressSweep, _write
    from weightgeom.experiments.compression_model import METHODS, run_model_sweep

    sw = CompressSweep(model="tiny", roles=("Q", "K", "V", "O", "Gate", "Up", "Down"), savings=(0.3,), scope="model",
                       tokens=30, context=16, calibration_tokens=48, layers_per_group=2)
    sw.check()
    before = {k: v.clone() for k, v in tiny_lm.model.state_dict().items()}
    ids = tiny_lm.encode("the quick brown fox jumps over the lazy dog; " * 2)
    base = perplexity_of_ids(tiny_lm, ids, tokens=30, context=16)
    rows: list[dict] = []
    rec = {"settings": {}, "model": "tiny", "device_kind": "cpu", "baseline": base.as_dict(), "rows": rows,
           "scope": "model"}
    run_model_sweep(sw, tiny_lm, ids, base, rec, rows, lambda: None, progress=False)
    assert [r["method"] for r in rows] == list(METHODS)
    assert all(r["saved_frac"] >= 0.3 and r["ppl"] > 1 and r["peak_rss_mb"] > 0 for r in rows)
    assert len({r["params_dense"] for r in rows}) == 1  # the budget's whole roles count too: one denominator
    budget = next(r for r in rows if r["method"] == "budget-w")
    assert len(set(budget["allotment"].replace(":", " ").split()[1::2])) > 1  # roles allotted different shares
    assert all(r["ppl"] != pytest.approx(base.ppl, rel=1e-9) for r in rows)  # each point did change the model
    for k, v in tiny_lm.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    _write(tmp_path, rec, sw, "t", plot=True)
    assert {"compress.csv", "compress.md", "compress.png"} <= {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match="unknown method 'svd-x'"):
        CompressSweep(model="tiny", scope="model", methods=("svd-x",)).check()


# ------------------------------------------------------------------------------------------ whole-model budget
@pytest.mark.parametrize("held", [False, True])
def test_budget_loss_curve_is_the_whitened_fits_error_at_every_rank(held):
    from weightgeom.analysis.compress_budget import layer_loss_curve
    from weightgeom.analysis.compress_fit import output_energy

    m, n = 6, 8
    W, X, Y = _layer(m, n, 40), _correlated(200, n, 41), _correlated(50, n, 42)
    G, H = X.mT @ X / 200, Y.mT @ Y / 50
    curve = layer_loss_curve(W, G, H if held else None)
    assert curve.shape == (min(m, n) + 1,) and curve[-1] == 0
    score = H if held else G
    for r in range(1, min(m, n)):
        f = fit_per_layer(W, G, r)
        What = f.coefs[0].double() @ f.basis[0].double().mT
        want = output_error(W, What, score) / output_energy(W, score)
        assert float(curve[r]) == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert float(curve[0]) == pytest.approx(1.0, rel=1e-5)


def test_budget_allots_more_savings_to_the_role_that_loses_least_and_reaches_the_target():
    from weightgeom.analysis.compress_budget import allocate

    levels = [i * 0.1 for i in range(9)]
    # A loses 10x less per level than B; both 1000 parameters
    curves = {"A": [(s, int(s * 1000), 0.1 * s * s) for s in levels], "B": [(s, int(s * 1000), s * s) for s in levels]}
    got = allocate(curves, {"A": 1000, "B": 1000}, 0.3)
    assert got["A"] > got["B"] and (got["A"] + got["B"]) * 1000 >= 600 - 1e-6
    with pytest.raises(ValueError, match="save at most 80%"):
        allocate(curves, {"A": 1000, "B": 1000}, 0.85)


def test_cli_compress_budget_model_allots_savings_per_role_and_saves_the_whole_model_fraction(hf_dir, tmp_path, capsys):
    import pandas as pd

    from weightgeom.cli import main

    out = tmp_path / "b"
    assert main(["compress", str(hf_dir), "--out", str(out), "--savings", "0.3", "--budget", "model",
                 "--share", "none", "--calibration-tokens", "64", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "budget: 30% of the compressed roles' parameters together" in text
    table = pd.read_csv(out / "savings.csv")
    total = table[table.role == "total"].iloc[0]
    assert total.saved >= 0.3 * 4 * sum(m * n for m, n in [(32, 32), (16, 32), (32, 32), (48, 32), (48, 32), (32, 48)])
    fracs = table[table.role != "total"].set_index("role").saved_frac
    assert fracs.max() - fracs.min() > 0.05  # the roles' shares differ: allotted, not uniform
    idx = __import__("json").loads((out / "compressed.json").read_text())
    assert set(idx["budget"]["roles"]) == set(fracs.index) and idx["budget"]["savings"] == 0.3
    for role, frac in fracs.items():  # each role saves at least its allotment
        assert frac >= idx["budget"]["roles"][role] - 1e-9
    header = next(line for line in text.splitlines() if line.startswith("role") and "savings" in line)
    assert "choice" in header
    # refusals: one line, exit 2
    for extra, says in ((["--rank", "2"], "give --savings, not --rank"),
                        (["--savings", "0.3", "--calibration", "none"], "drop --calibration none")):
        assert main(["compress", str(hf_dir), "--out", str(tmp_path / "x"), "--budget", "model", *extra,
                     "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0]


def test_auto_with_the_model_follows_its_held_out_nll_with_one_role_replaced(tiny_lm):
    """Given the runnable model, auto judges each space by the model's own NLL on the held-out calibration tokens
    with that role's matrices replaced by the fit (the other weights whole), and leaves the model as it was."""
    from weightgeom.analysis.calibration import calibration_text, collect_grams
    from weightgeom.analysis.compress import CompressConfig, compress_roles
    from weightgeom.analysis.compress_choice import choose_by_loss
    from weightgeom.analysis.perplexity import perplexity_of_ids
    from weightgeom.analysis.roles import assign_roles

    grams = collect_grams(tiny_lm, calibration_text(), ("Up",), tokens=64, context=32, holdout=0.25)
    before = {k: v.clone() for k, v in tiny_lm.model.state_dict().items()}
    by_role = {"Up": assign_roles(tiny_lm.model.state_dict())["Up"]}
    cfg = CompressConfig(share="auto", savings=0.3, layers_per_group=2, roles=("Up",), calibration="x")
    v = choose_by_loss(by_role, cfg, grams, lm=tiny_lm)["Up"]
    for k, t in tiny_lm.model.state_dict().items():
        assert torch.equal(t, before[k]), k
    assert v["by"] == "held-out NLL" and v["space"] == min(v["nll"], key=v["nll"].get)
    nll = lambda: perplexity_of_ids(tiny_lm, grams.held_ids, tokens=16, context=32).nll  # noqa: E731
    base = nll()
    groups = list(compress_roles(None, CompressConfig(share="none", savings=0.3, layers_per_group=2, roles=("Up",)),
                                 by_role=by_role, grams=grams.fit_part()))
    with torch.no_grad():
        for g in groups:
            for rw in (x for x in by_role["Up"] if x.layer in g.coefs):
                rw.weight.copy_(g.dense(rw.layer))
        replaced = nll()
        tiny_lm.model.load_state_dict(before)
    assert v["nll"]["none"] == pytest.approx(replaced - base, rel=1e-6, abs=1e-9)

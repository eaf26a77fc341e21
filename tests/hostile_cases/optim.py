"""Hostile inputs: optim (rows of tests/test_hostile.py).

Promises: an optimizer step is all or nothing — a NaN/Inf gradient anywhere (the last group, a manifold group, a
parameter MD does not decouple, the fused C path) is refused with one message naming the parameter, and every
parameter and every piece of optimizer state is bit-identical afterwards; gains of magnitude-direction never make W
NaN/Inf, whatever their value (1e-30, 0, subnormal), on the eager and the fused path, after an outside edit of W and
after loading a checkpoint. Parameters a step cannot handle (complex, integer, bool, float8) or listed twice are
refused when they are added, and ``load_state_dict`` refuses a state dict that does not fit (another optimizer's,
another structure, state of another shape) before loading any of it. Driven through the Python API (these are library
promises).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hostile_cases import Hostile, assert_one_line_error, cli

__all__ = ["CASES", "snapshot", "assert_unchanged"]


# ---------------------------------------------------------------------------------------------------------------------
# Shared helpers: a deep copy of everything a step could change, and a bitwise comparison.
# ---------------------------------------------------------------------------------------------------------------------
def snapshot(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, Any]:
    """Deep copies of the model's parameters, the optimizer's ``state_dict()`` and (Muon) ``last_stats``."""
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state": copy.deepcopy(opt.state_dict()),
            "last_stats": copy.deepcopy(getattr(opt, "last_stats", None))}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (so NaN equals the same NaN, and -0.0 differs from 0.0)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_unchanged(before: Any, after: Any, where: str = "") -> None:
    """Assert two snapshots are equal: tensors bitwise (same dtype, shape and bytes), everything else by ``==``."""
    if isinstance(before, torch.Tensor):
        assert isinstance(after, torch.Tensor) and before.dtype == after.dtype and before.shape == after.shape, where
        assert torch.equal(_bits(before), _bits(after)), f"{where} changed"
    elif isinstance(before, dict):
        assert isinstance(after, dict) and set(before) == set(after), f"{where}: keys differ"
        for k in before:
            assert_unchanged(before[k], after[k], f"{where}.{k}")
    elif isinstance(before, (list, tuple)):
        assert type(before) is type(after) and len(before) == len(after), f"{where}: lengths differ"
        for i, (a, b) in enumerate(zip(before, after)):
            assert_unchanged(a, b, f"{where}[{i}]")
    else:
        assert before == after, f"{where}: {before!r} != {after!r}"


# ---------------------------------------------------------------------------------------------------------------------
# Muon: NaN/Inf in the last group.
# ---------------------------------------------------------------------------------------------------------------------
class _Net(torch.nn.Module):
    """Three kinds of parameters: plain-Muon matrices, a Stiefel-constrained matrix, AdamW vectors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 16)
        self.fc2 = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _muon(model: _Net, last: str):
    """Muon over three groups (plain, manifold ``stiefel``, ``adamw``), ordered so that ``last`` comes last."""
    from weightgeom.optim import Muon

    groups = {
        "muon": {"params": [model.fc1.weight, model.head.weight], "names": ["fc1.weight", "head.weight"]},
        "manifold": {"params": [model.fc2.weight], "names": ["fc2.weight"], "manifold": "stiefel",
                     "dual": {"steps": 3}},
        "adamw": {"params": [model.fc1.bias, model.fc2.bias], "names": ["fc1.bias", "fc2.bias"],
                  "algorithm": "adamw", "lr": 1e-2},
    }
    order = [k for k in groups if k != last] + [last]
    return Muon([groups[k] for k in order], lr=0.02), groups[last]


def _train(opt: torch.optim.Optimizer, model: torch.nn.Module, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, _inputs(model), generator=g)).pow(2).mean().backward()
        opt.step()


def _refused_unchanged(opt: torch.optim.Optimizer, model: torch.nn.Module, param: torch.Tensor, name: str,
                       bad: float) -> None:
    """Gradients everywhere, one ``bad`` entry in ``param``'s: the step raises naming it and changes nothing."""
    from weightgeom.optim.functional import NonFiniteGradientError

    opt.zero_grad()
    model(torch.randn(8, _inputs(model))).pow(2).mean().backward()
    param.grad.view(-1)[param.grad.numel() // 2] = bad
    before = snapshot(opt, model)
    with pytest.raises(NonFiniteGradientError) as info:
        opt.step()
    msg = str(info.value)
    assert f"'{name}'" in msg and "NaN/Inf" in msg and "no parameter or optimizer state was changed" in msg, msg
    assert "\n" not in msg
    assert info.value.param_name == name
    assert_unchanged(before, snapshot(opt, model), "after the refused step")


def _inputs(model: torch.nn.Module) -> int:
    """Input width of the test models (their first Linear's)."""
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    return first.in_features


def _muon_last_group(last: str, bad: float):
    def check(tmp_path: Path) -> None:
        torch.manual_seed(0)
        model = _Net()
        opt, group = _muon(model, last)
        _train(opt, model, 2)  # momentum buffers, dual multipliers, Adam moments and step counters exist
        _refused_unchanged(opt, model, group["params"][-1], group["names"][-1], bad)

    return check


# ---------------------------------------------------------------------------------------------------------------------
# MagnitudeDirection over AdamW: eager and fused paths.
# ---------------------------------------------------------------------------------------------------------------------
def _md(fused: bool | None, **kw):
    from weightgeom import kernels
    from weightgeom.optim import MagnitudeDirection

    if fused and kernels.load_kernel("md_adam") is None:
        pytest.skip(f"md kernel unavailable: {kernels.unavailable_reason('md_adam')}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    md = MagnitudeDirection(torch.optim.AdamW(model.named_parameters(), lr=1e-2), model=model, gain_lr=0.05,
                            fused=fused, **kw)
    return md, model


def _md_nan(fused: bool, which: str, bad: float):
    def check(tmp_path: Path) -> None:
        md, model = _md(fused)
        _train(md, model, 2)
        assert set(md._path.values()) == {"fused" if fused else "eager (fused=False)"}
        _refused_unchanged(md, model, dict(model.named_parameters())[which], which, bad)

    return check


def _tiny_gain(fused: bool, value: float):
    """Gains of magnitude ``value`` (softplus θ where softplus(θ) = value; 0: θ = -1000), then an outside edit of W
    (the direction is re-derived from W / gains), more steps, and a checkpoint round trip into a fresh optimizer whose
    model holds a different W: W stays finite and equal to γ_r Ŵ γ_c throughout."""

    def check(tmp_path: Path) -> None:
        from weightgeom.optim.md_functional import GAIN_MIN, compose

        md, model = _md(fused)
        _train(md, model, 1)
        w = model[2].weight
        theta = -1000.0 if value == 0 else math.log(math.expm1(value))
        with torch.no_grad():
            md.state[w]["gain_row"].fill_(theta)
            w.mul_(1.5)  # an outside edit: the next step re-derives Ŵ = W / γ_r / γ_c
        _train(md, model, 2)

        def consistent(opt, mod) -> None:
            p = mod[2].weight
            gr, gc = opt.gain_values(p)
            assert bool(torch.isfinite(p).all()), f"W has {int((~torch.isfinite(p)).sum())} NaN/Inf entries"
            assert float(gr.min()) >= GAIN_MIN * (1 - 1e-6)
            torch.testing.assert_close(p.detach(), compose(opt.direction(p), gr, gc), rtol=1e-5, atol=0)

        consistent(md, model)
        saved = copy.deepcopy(md.state_dict())
        md2, model2 = _md(fused)
        with torch.no_grad():  # the model does not match the checkpoint: Ŵ is re-derived with the tiny gains
            model2[2].weight.mul_(0.5)
        md2.load_state_dict(saved)
        _train(md2, model2, 2)
        consistent(md2, model2)

    return check


def _huge_gradient(fused: bool | None):
    """Finite float32 gradients of 1e30 (squares past float32's range) and 3e38 (the log-gain sums overflow too) over
    SGD, on every sphere: Ŵ stays on its sphere (radius unchanged), W finite and nonzero, the gains and their Adam
    moments finite, and the gains still move on the normal steps after it — on the torch path and the C passes."""

    def check(tmp_path: Path) -> None:
        from weightgeom import kernels
        from weightgeom.optim import MagnitudeDirection
        from weightgeom.optim.md_functional import sphere_norm_wide

        if fused is None and kernels.load_kernel("md_adam") is None:
            pytest.skip(f"md kernel unavailable: {kernels.unavailable_reason('md_adam')}")
        for huge in (1e30, 3e38):
            for sphere in ("frobenius", "row", "col"):
                torch.manual_seed(0)
                model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
                md = MagnitudeDirection(torch.optim.SGD(model.parameters(), lr=5e-2), model=model, fused=fused,
                                        gain_lr=3e-2, sphere=sphere)
                w = model[0].weight
                for p in model.parameters():
                    p.grad = torch.full_like(p, huge)
                md.step()
                where = f"{huge:g}, {sphere}"
                assert md._path[w].startswith("eager (fused=False)" if fused is False else "eager-C"), md._path[w]
                assert bool(torch.isfinite(w.detach()).all()) and float(w.detach().abs().max()) > 0, where
                radius = md.state[w]["radius"].double()
                norm = sphere_norm_wide(md.direction(w), sphere)
                torch.testing.assert_close(norm, radius.expand_as(norm), rtol=1e-5, atol=0)
                gains = [t.detach().clone() for t in md.gain_values(w) if t is not None]
                moments = [v for st in md.state.values() for k, v in st.items()
                           if torch.is_tensor(v) and k in ("exp_avg", "exp_avg_sq")]
                assert gains and moments and all(bool(torch.isfinite(t).all()) for t in gains + moments), where
                for _ in range(3):  # normal steps after the spike: the gains are not frozen
                    for p in model.parameters():
                        p.grad = torch.randn_like(p) * 1e-2
                    md.step()
                after = [t for t in md.gain_values(w) if t is not None]
                assert any(not torch.equal(a, b) for a, b in zip(gains, after)), f"{where}: gains frozen"
                assert all(bool(torch.isfinite(t).all()) for t in after), where
        # gains grown to ~3 first (γ_r·G·γ_c of a 3e38 gradient then passes float32's range: it saturates), and rows of
        # mixed sign whose products sum to +inf − inf in float32 (the sums are float64)
        torch.manual_seed(0)
        lin = torch.nn.Linear(16, 4, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.tensor([1.0, 1, -1, -1] * 4).expand(4, 16))
        md = MagnitudeDirection(torch.optim.SGD(lin.parameters(), lr=1e-2), model=lin, fused=fused, gain_lr=0.1,
                                sphere="row")
        for _ in range(10):
            lin.weight.grad = -torch.ones_like(lin.weight) * 1e-2
            md.step()
        grown = float(md.gain_values(lin.weight)[0].max() * md.gain_values(lin.weight)[1].max())
        assert grown > 1.2, grown
        lin.weight.grad = torch.full_like(lin.weight, 3e38)
        md.step()
        tensors = [lin.weight.detach(), *[t for t in md.gain_values(lin.weight) if t is not None]]
        tensors += [v for st in md.state.values() for v in st.values() if torch.is_tensor(v) and v.is_floating_point()]
        assert all(bool(torch.isfinite(t).all()) for t in tensors), "grown gains, 3e38: not finite"
        # entries of Ŵ above 1 (a row sphere of radius > 1) times a saturated Ĝ: the products saturate as well
        with torch.no_grad():
            lin.weight.copy_(torch.tensor([3.0, -3, 3, -3, 2, -2, 2, -2] * 2).expand(4, 16))
        md = MagnitudeDirection(torch.optim.SGD(lin.parameters(), lr=1e-2), model=lin, fused=fused, gain_lr=0.1,
                                sphere="row")
        for _ in range(10):
            lin.weight.grad = -torch.ones_like(lin.weight) * 1e-2
            md.step()
        lin.weight.grad = torch.tensor([3e38, 3e38, -3e38, -3e38] * 4).expand(4, 16).clone()
        md.step()
        tensors = [lin.weight.detach()]
        tensors += [v for st in md.state.values() for v in st.values() if torch.is_tensor(v) and v.is_floating_point()]
        assert all(bool(torch.isfinite(t).all()) for t in tensors), "|Ŵ| > 1, 3e38: not finite"
        # the 'direct' parameterization (its own, non-log split) with gains of 3: Ĝ saturates there too
        from weightgeom.optim.md_functional import compose

        lin = torch.nn.Linear(16, 8, bias=False)
        md = MagnitudeDirection(torch.optim.SGD(lin.parameters(), lr=1e-2), model=lin, fused=fused,
                                parameterization="direct")
        with torch.no_grad():
            md.state[lin.weight]["gain_row"].fill_(3.0)
            md.state[lin.weight]["gain_col"].fill_(3.0)
            lin.weight.copy_(compose(md.direction(lin.weight), *md.gain_values(lin.weight)))
        for huge in (3e38, -3.4e38):
            lin.weight.grad = torch.full_like(lin.weight, huge)
            md.step()
        assert bool(torch.isfinite(lin.weight.detach()).all()), "direct gains, 3e38: W not finite"

    return check


def _stale_gain_grad(fused: bool | None):
    """Two MD steps, then model.zero_grad() (not the optimizer's: the gains keep their θ.grad) and a backward through
    the last layer only: the first layer's W and gains do not move; the last layer's do."""
    def check(tmp_path: Path) -> None:
        md, model = _md(fused)
        _train(md, model, 2)
        first, last = model[0].weight, model[2].weight
        model.zero_grad(set_to_none=True)
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
        model[2](x).pow(2).sum().backward()
        st0, st2 = md.state[first], md.state[last]
        before = [t.clone() for t in (first.detach(), st0["gain_row"], st0["gain_col"], st2["gain_row"])]
        assert first.grad is None and st0["gain_row"].grad is not None  # the stale gradient is there
        md.step()
        for now, was, what in zip((first.detach(), st0["gain_row"], st0["gain_col"]), before[:3],
                                  ("W", "gain_row", "gain_col")):
            assert torch.equal(now, was), f"the gradient-less layer's {what} moved"
        assert not torch.equal(st2["gain_row"], before[3]), "the stepped layer's gains did not move"

    return check


def _bf16_msign_scales(manifold: str | None):
    """Muon with a bf16 msign (its CPU normalisation runs in C for matrices of ≥ 65536 entries) on a 512×256
    parameter, fed gradients of 1e-40 (subnormal), 1e-23, 1e37 and rank 1: every step finite, the update's singular
    values within the bf16 band of 1 (plain Muon) or W on its manifold (manifold Muon)."""

    def check(tmp_path: Path) -> None:
        import warnings

        from weightgeom import manifolds
        from weightgeom.optim import Muon

        g = torch.Generator().manual_seed(0)
        base = torch.randn(512, 256, generator=g)
        rank1 = torch.randn(512, 1, generator=g) @ torch.randn(1, 256, generator=g)
        for G in (1e-40 * base, 1e-23 * base, 1e37 * base, rank1):
            p = torch.nn.Parameter(0.02 * torch.randn(512, 256, generator=g))
            kw = {"manifold": manifold} if manifold else {}
            opt = Muon([{"params": [p], "names": ["w"]}], lr=0.02, msign_dtype=torch.bfloat16, ns_steps=8, **kw)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(2):
                    before = p.detach().clone()
                    p.grad = G.clone()
                    opt.step()
            assert torch.isfinite(p).all(), f"non-finite parameter after a gradient of scale {float(G.abs().max())}"
            if manifold:
                assert manifolds.get(manifold).check(p.detach(), tol=1e-5).ok
            elif G is not rank1:
                s = torch.linalg.svdvals((p.detach() - before).double())
                assert float((s / s.max() - 1).abs().max()) < 0.1, float((s / s.max() - 1).abs().max())

    return check


def _low_precision_mode(mode: str, shape: tuple[int, int] = (192, 64), manifold: str = "stiefel", steps: int = 10,
                        tol: float = 1e-6, products: str | None = None):
    """The process asks for fast float32 matmuls (bf16 arithmetic on AMX/AVX512-BF16 CPUs, TF32 on GPUs): manifold-Muon
    steps are bitwise those of a full-precision process, W stays on its manifold (``tol``), and the mode is kept.
    ``products``: WEIGHTGEOM_PRODUCTS for the runs (the split calls MKL's bf16 gemm itself, whatever the mode; oneDNN's
    float32 linear honours the mode, so it must run inside the full-precision guard)."""

    def check(tmp_path: Path) -> None:
        import os
        import warnings

        from weightgeom import manifolds
        from weightgeom.optim import Muon

        def run() -> torch.Tensor:
            torch.manual_seed(0)
            p = torch.nn.Parameter(torch.randn(*shape) * 0.02)
            opt = Muon([{"params": [p], "names": ["w"]}], lr=0.02, manifold=manifold)
            for _ in range(steps):
                p.grad = torch.randn_like(p) * 1e-3
                opt.step()
            return p.detach().clone()

        levels = (torch.backends.mkldnn.matmul, torch.backends.cuda.matmul)
        before = [b.fp32_precision for b in levels]
        env = os.environ.get("WEIGHTGEOM_PRODUCTS")
        if products is not None:
            os.environ["WEIGHTGEOM_PRODUCTS"] = products
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                full = run()
                torch.set_float32_matmul_precision(mode)
                asked = [b.fp32_precision for b in levels]
                low = run()
            assert [b.fp32_precision for b in levels] == asked, "the process's matmul mode was not kept"
        finally:
            for b, v in zip(levels, before):
                b.fp32_precision = v
            if env is None:
                os.environ.pop("WEIGHTGEOM_PRODUCTS", None)
            else:
                os.environ["WEIGHTGEOM_PRODUCTS"] = env
        assert torch.equal(full, low), "steps differ from a full-precision process"
        assert manifolds.get(manifold).check(low, tol=tol)

    return check


def _bad_products_env(var: str, value: str):
    """``var=value`` (an invalid value): `weightgeom train` of a manifold config stops before any step with one line
    naming the variable and exit 2; no checkpoint is written."""

    def check(tmp_path: Path) -> None:
        _bad_env_train(tmp_path, var, value)

    return check


def _bad_env_train(tmp_path: Path, var: str, value: str) -> None:
    import os

    import yaml

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
        "data": {"kind": "synthetic", "block_size": 16, "batch_size": 4},
        "optim": {"name": "muon", "strategy": "all-stiefel"},
        "train": {"max_steps": 2, "eval_every": 2, "eval_iters": 1, "log_every": 1, "ckpt_every": 1},
    }))
    old = os.environ.get(var)
    os.environ[var] = value
    try:
        res = cli("train", cfg, "--out", tmp_path / "run", "--no-progress")
    finally:
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old
    assert_one_line_error(res, var)
    assert not list((tmp_path / "run").rglob("*.pt")) and not list((tmp_path / "run").rglob("*.safetensors"))


# ---------------------------------------------------------------------------------------------------------------------
# Parameters an optimizer cannot step (dtype), parameters listed twice, and state dicts that do not fit.
# ---------------------------------------------------------------------------------------------------------------------
# Every kind of Muon group: plain Muon, AdamW, and each manifold.
_GROUP_KINDS = {"muon": {}, "adamw": {"algorithm": "adamw"}, "stiefel": {"manifold": "stiefel"},
                "dgram": {"manifold": "dgram"}, "oblique": {"manifold": "oblique"}}
_BAD_DTYPES = (torch.complex64, torch.int64, torch.bool, torch.float8_e4m3fn)


@contextlib.contextmanager
def _refused(*must_contain: str) -> Iterator[None]:
    """The block must raise a one-line ValueError containing every string in ``must_contain``."""
    with pytest.raises(ValueError) as info:
        yield
    msg = str(info.value)
    assert "\n" not in msg, msg
    for s in must_contain:
        assert s in msg, f"{s!r} not in {msg!r}"


def _float_and(dtype: torch.dtype) -> tuple[torch.nn.Parameter, torch.Tensor]:
    """A float32 16×8 parameter and a 16×8 tensor of ``dtype`` (a Parameter where autograd allows one)."""
    good = torch.nn.Parameter(torch.randn(16, 8) * 0.1)
    raw = torch.ones(16, 8).to(dtype)
    bad = torch.nn.Parameter(raw) if raw.is_floating_point() or raw.is_complex() else raw
    return good, bad


def _muon_bad_dtype(tmp_path: Path) -> None:
    from weightgeom.optim import Muon

    for kind, kw in _GROUP_KINDS.items():
        for dtype in _BAD_DTYPES:
            good, bad = _float_and(dtype)
            groups = [{"params": [good], "names": ["ok"], **kw}, {"params": [bad], "names": ["bad"], **kw}]
            with _refused("'bad'", "group 1, position 0", "shape (16, 8)", str(dtype).removeprefix("torch."),
                          "float32"):
                Muon(groups)
            opt = Muon([{"params": [good], "names": ["ok"], **kw}])
            before = [dict(g) for g in opt.param_groups]
            with _refused("group 1, position 0", str(dtype).removeprefix("torch.")):
                opt.add_param_group({"params": [bad], **kw})
            assert len(opt.param_groups) == 1 and opt.param_groups[0] == before[0], f"{kind}: a refused group stayed"


def _muon_dtype_changed(tmp_path: Path) -> None:
    """A parameter turned complex after construction: the step is refused before the float32 one moves."""
    for kind, kw in _GROUP_KINDS.items():
        model, opt = _two_groups_after_a_step(kw)
        model["b"].weight.data = model["b"].weight.data.to(torch.complex64)
        model["b"].weight.grad = torch.randn_like(model["b"].weight)
        model["a"].weight.grad = torch.randn_like(model["a"].weight)
        before = snapshot(opt, model)
        with _refused("'b.weight'", "complex64", "nothing was changed"):
            opt.step()
        assert_unchanged(before, snapshot(opt, model), f"{kind}: after the refused step")


def _md_bad_dtype(tmp_path: Path) -> None:
    from weightgeom.optim import MagnitudeDirection

    for dtype in (torch.complex64, torch.float8_e4m3fn):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 16)
        extra = torch.nn.Parameter(torch.zeros(16).to(dtype))
        base = torch.optim.AdamW([{"params": [model.weight, model.bias], "names": ["weight", "bias"]},
                                  {"params": [extra], "names": ["extra"], "weight_decay": 0.0}])
        with _refused("'extra'", "group 1, position 0", str(dtype).removeprefix("torch."), "float32"):
            MagnitudeDirection(base, model=model)
        md = MagnitudeDirection(torch.optim.AdamW(model.parameters()), model=model)
        groups = len(md.param_groups)
        with _refused(str(dtype).removeprefix("torch.")):
            md.add_param_group({"params": [extra]})
        assert len(md.param_groups) == groups


def _muon_duplicates(tmp_path: Path) -> None:
    import warnings

    from weightgeom.optim import Muon

    for kw in _GROUP_KINDS.values():
        p, q = torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(16, 8))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own warning is not the refusal
            with _refused("listed twice", "group 0, position 1"):
                Muon([{"params": [p, p], **kw}])
            with _refused("'p again'", "listed twice", "group 1, position 0", "group 0, position 1"):
                Muon([{"params": [q, p], "names": ["q", "p"], **kw}, {"params": [p], "names": ["p again"], **kw}])
            opt = Muon([{"params": [p], "names": ["p"], **kw}])
            with _refused("'p2'", "listed twice"):
                opt.add_param_group({"params": [q, p], "names": ["q", "p2"]})
            assert len(opt.param_groups) == 1


def _md_duplicates(tmp_path: Path) -> None:
    import warnings

    from weightgeom.optim import MagnitudeDirection

    model = torch.nn.Linear(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = torch.optim.AdamW([model.weight, model.bias, model.weight])
    with _refused("listed twice", "group 0, position 2"):
        MagnitudeDirection(base, model=model)
    md = MagnitudeDirection(torch.optim.AdamW(model.parameters()), model=model)
    with _refused("listed twice"):
        md.add_param_group({"params": [model.bias]})


def _muon_for(model: torch.nn.Module, **kw):
    """Muon over a two-layer model: its matrices in one group (``kw``), its biases in an AdamW group."""
    from weightgeom.optim import Muon

    mats = {"params": [model[0].weight, model[1].weight], "names": ["0.weight", "1.weight"], **kw}
    vecs = {"params": [model[0].bias, model[1].bias], "names": ["0.bias", "1.bias"], "algorithm": "adamw"}
    return Muon([mats, vecs], lr=0.02)


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 16))


def _round_trip_bitwise(opt, model, make, label: str = "") -> None:
    """``make(copy of model)`` loads ``opt``'s state dict; two more steps on each leave the two models bitwise equal."""
    model2 = copy.deepcopy(model)
    opt2 = make(model2)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    _train(opt, model, 2)
    _train(opt2, model2, 2)
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), f"{label + ': ' if label else ''}{n} differs after a round trip"


def _refused_load(opt, model, sd, *must_contain: str) -> None:
    """``opt.load_state_dict(sd)`` is one ValueError line with ``must_contain``; nothing changed; ``opt`` still
    steps."""
    before = snapshot(opt, model)
    with _refused(*must_contain):
        opt.load_state_dict(sd)
    assert_unchanged(before, snapshot(opt, model), "after the refused load")
    _train(opt, model, 1)


def _muon_load_foreign(tmp_path: Path) -> None:
    import warnings

    from weightgeom.optim import MagnitudeDirection

    warnings.simplefilter("ignore")
    model = _mlp()
    opt = _muon_for(model)
    _train(opt, model, 2)
    adamw = torch.optim.AdamW([{"params": [model[0].weight, model[1].weight]}, {"params": [model[0].bias,
                                                                                          model[1].bias]}])
    _train(adamw, model, 1)
    _refused_load(opt, model, adamw.state_dict(), "torch.optim.AdamW state dict")
    md = MagnitudeDirection(torch.optim.AdamW(model.parameters()), model=model)
    _refused_load(opt, model, md.state_dict(), "MagnitudeDirection state dict")
    _refused_load(opt, model, [1, 2], "list")
    _round_trip_bitwise(opt, model, _muon_for)  # a legitimate round trip still resumes bitwise


def _muon_load_structure(tmp_path: Path) -> None:
    import warnings

    warnings.simplefilter("ignore")
    for key, value, ours in [("manifold", "stiefel", None), ("manifold", "dgram", "stiefel"),
                             ("manifold", None, "oblique"), ("momentum_form", "sum", "ema"),
                             ("layout", "in_out", "out_in"), ("dual_normalize", False, True),
                             ("algorithm", "adamw", "muon")]:
        kw = {"manifold": "stiefel"} if key == "dual_normalize" else {}
        model = _mlp()
        # a state dict's groups hold dual.normalize as the flattened key dual_normalize (what the refusal names)
        donor_kw, ours_kw = ({"dual": {"normalize": v}} if key == "dual_normalize" else {key: v} for v in (value, ours))
        donor = _muon_for(model, **kw, **donor_kw)
        _train(donor, model, 2)
        opt = _muon_for(model, **kw, **ours_kw)
        _train(opt, model, 1)
        _refused_load(opt, model, copy.deepcopy(donor.state_dict()), "group 0", f"{key}={value!r}", f"{key}={ours!r}")


def _muon_load_bad_state(tmp_path: Path) -> None:
    import warnings

    warnings.simplefilter("ignore")
    model = _mlp()
    opt = _muon_for(model, manifold="stiefel")
    _train(opt, model, 2)
    good = copy.deepcopy(opt.state_dict())

    def edited(fn) -> dict:
        sd = copy.deepcopy(good)
        fn(sd)
        return sd

    cases = [
        (lambda sd: sd["state"][0].__setitem__("momentum_buffer", torch.zeros(8, 16)), "'0.weight'",
         "'momentum_buffer'", "(8, 16)", "(16, 8)"),
        (lambda sd: sd["state"][1].__setitem__("dual_multiplier", torch.zeros(4, 4)), "'1.weight'",
         "'dual_multiplier'", "(4, 4)", "(16, 16)"),
        (lambda sd: sd["state"][2].__setitem__("exp_avg", torch.zeros(16, dtype=torch.complex64)), "'0.bias'",
         "'exp_avg'"),
        (lambda sd: sd["state"][2].__setitem__("momentum_buffer", torch.zeros(16)), "'0.bias'", "'momentum_buffer'"),
        (lambda sd: sd["state"].__setitem__(99, {}), "99"),
        (lambda sd: sd["param_groups"][1].__setitem__("amsgrad", False), "group 1", "'amsgrad'"),
        (lambda sd: sd["param_groups"][0].__setitem__("momentum", 1.5), "group 0", "momentum=1.5"),
        (lambda sd: sd["param_groups"][0].__setitem__("lr", "fast"), "group 0", "lr='fast'"),
        (lambda sd: sd["param_groups"].pop(), "1 param groups", "has 2"),
        (lambda sd: sd["param_groups"][1]["params"].pop(), "group 1", "1 parameters", "has 2"),
    ]
    for fn, *must in cases:
        _refused_load(opt, model, edited(fn), *must)


def _muon_load_nonfinite_state(tmp_path: Path) -> None:
    """A Muon state dict of the right shapes whose momentum buffer (plain and manifold group), dual multiplier, cold
    multiplier or AdamW moment holds a NaN or Inf (a corrupt checkpoint, or one saved after a blow-up) is refused
    when loaded, naming the parameter and the tensor; nothing changed; a fresh optimizer refuses it too; the clean
    state dict still loads and resumes bitwise."""
    import warnings

    warnings.simplefilter("ignore")
    model = _mlp()
    make = {"plain": lambda m: _muon_for(m), "stiefel": lambda m: _muon_for(m, manifold="stiefel")}
    for kind, build in make.items():
        opt = build(model)
        _train(opt, model, 2)
        good = copy.deepcopy(opt.state_dict())
        keys = [(0, "momentum_buffer", "'0.weight'"), (1, "momentum_buffer", "'1.weight'"),
                (2, "exp_avg", "'0.bias'"), (3, "exp_avg_sq", "'1.bias'")]
        if kind == "stiefel":
            keys += [(0, "dual_multiplier", "'0.weight'"), (1, "dual_cold", "'1.weight'")]
        for k, key, name in keys:
            for bad in (NAN, INF):
                sd = copy.deepcopy(good)
                sd["state"][k][key].view(-1)[0] = bad
                _refused_load(opt, model, sd, name, f"'{key}'", "NaN/Inf", "nothing was loaded")
                fresh = build(copy.deepcopy(model))
                with _refused(name, f"'{key}'"):
                    fresh.load_state_dict(sd)
        _round_trip_bitwise(opt, model, build, kind)


def _resume_nonfinite_state(tmp_path: Path) -> None:
    """`weightgeom train --resume` of a run whose newest checkpoint (hash intact) holds a NaN momentum buffer stops
    with one line naming the checkpoint, the parameter and the tensor, exit 2; the run's checkpoints are kept."""
    from weightgeom.train.checkpoint import load_checkpoint, save_checkpoint

    run = tmp_path / "r"
    tiny = ["--set", "model.n_layer=1", "--set", "model.n_embd=16", "--set", "model.n_head=1"]
    res = cli("train", "tiny-shakespeare", "--out", run, "--set", "train.max_steps=2", *tiny, "--no-progress")
    assert res.rc == 0, res.err[-2000:]
    (ckpt,) = sorted((run / "checkpoints").glob("ckpt_*.pt"))
    payload = load_checkpoint(ckpt)
    k = next(k for k, st in payload["optimizer"]["state"].items() if "momentum_buffer" in st)
    payload["optimizer"]["state"][k]["momentum_buffer"].view(-1)[0] = NAN
    save_checkpoint(ckpt, payload)  # a well-formed checkpoint (its hash matches) whose state is poisoned
    before = ckpt.read_bytes()
    res = cli("train", "--resume", run, "--set", "train.max_steps=4", "--no-progress")
    assert_one_line_error(res, str(ckpt.name), "'momentum_buffer'", "NaN/Inf", "nothing was loaded")
    assert ckpt.read_bytes() == before and sorted((run / "checkpoints").glob("ckpt_*.pt")) == [ckpt]


# What a step refuses before it changes anything, as data: (id, the parameter it hits, how it is made, what the one
# line names). ``_refusals_eager_and_compiled`` runs every row through the eager step and ``compile_step`` (on_nonfinite
# "skip" and "raise"): the same line, nothing changed.
def _to_double(p: torch.nn.Parameter) -> None:
    p.grad = torch.randn(p.shape)  # float32 gradient, then the parameter becomes float64 under it
    p.data = p.data.double()


def _reshaped(p: torch.nn.Parameter) -> None:
    p.grad = torch.randn(p.shape)
    p.data = torch.randn(*reversed(p.shape)) if p.ndim == 2 else torch.randn(p.numel() + 1)


def _sparse_grad(p: torch.nn.Parameter) -> None:
    p.grad = torch.randn(p.shape).to_sparse()


def _to_complex(p: torch.nn.Parameter) -> None:
    p.data = p.data.to(torch.complex64)
    p.grad = torch.randn_like(p)


STEP_REFUSALS = [
    ("dtype-changed", "fc.weight", _to_double, ("'fc.weight'", "float64", "gradient is float32")),
    ("shape-changed", "fc.weight", _reshaped, ("'fc.weight'", "shape (8, 16)", "gradient is float32 (16, 8)")),
    ("sparse-gradient", "fc.weight", _sparse_grad, ("'fc.weight'", "sparse gradient")),
    ("complex", "fc.weight", _to_complex, ("'fc.weight'", "complex64")),
    ("adamw-dtype-changed", "fc.bias", _to_double, ("'fc.bias'", "float64", "gradient is float32")),
    ("adamw-shape-changed", "fc.bias", _reshaped, ("'fc.bias'", "shape (17,)")),
    ("adamw-sparse-gradient", "fc.bias", _sparse_grad, ("'fc.bias'", "sparse gradient")),
]


def _refusals_eager_and_compiled(tmp_path: Path) -> None:
    """Every row of ``STEP_REFUSALS`` through Muon's eager step and its compiled step (``compile_step``, backend
    "eager": the dynamo trace and its guards, without inductor's compile time), with on_nonfinite "skip" and
    "raise": after two good steps (the second compiled) the hostile change is refused with the same one line, every
    parameter and all state bitwise unchanged; undone, the next step runs."""
    import warnings

    from weightgeom.optim import Muon, compile_step

    warnings.simplefilter("ignore")

    def build(mode: str):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"fc": torch.nn.Linear(8, 16), "out": torch.nn.Linear(16, 8, bias=False)})
        params = dict(model.named_parameters())
        mats, vecs = ["fc.weight", "out.weight"], ["fc.bias"]
        opt = Muon([{"params": [params[n] for n in mats], "names": mats},
                    {"params": [params[n] for n in vecs], "names": vecs, "algorithm": "adamw", "lr": 1e-2}],
                   lr=0.02, on_nonfinite=mode)
        return model, params, opt

    def grads(params) -> None:
        g = torch.Generator().manual_seed(5)
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g)

    for mode in ("skip", "raise"):
        eager_model, eager_params, eager_opt = build(mode)
        model, params, opt = build(mode)
        step = compile_step(opt, backend="eager")
        for _ in range(2):  # the first call eager, the second compiled
            grads(eager_params)
            eager_opt.step()
            grads(params)
            step()
        for rid, target, make, must in STEP_REFUSALS:
            lines = []
            for m, ps, o, run in ((eager_model, eager_params, eager_opt, eager_opt.step), (model, params, opt, step)):
                keep = ps[target].data
                grads(ps)
                make(ps[target])
                before = snapshot(o, m)
                with pytest.raises(ValueError) as info:
                    run()
                lines.append(str(info.value))
                assert "\n" not in lines[-1] and all(x in lines[-1] for x in (*must, "nothing was changed")), (
                    f"{mode}, {rid}: {lines[-1]!r}")
                assert_unchanged(before, snapshot(o, m), f"{mode}, {rid}: after the refused step")
                ps[target].grad = None
                ps[target].data = keep
            assert lines[0] == lines[1], f"{mode}, {rid}: eager {lines[0]!r} but compiled {lines[1]!r}"
        grads(params)
        step()  # the hostile changes undone: the compiled step runs again
        assert all(bool(torch.isfinite(p).all()) for p in params.values())


def _md_over(model: torch.nn.Module, base: str):
    from weightgeom.optim import MagnitudeDirection

    b = torch.optim.AdamW(model.parameters(), lr=1e-2) if base == "adamw" else _muon_for(model)
    return MagnitudeDirection(b, model=model, gain_lr=1e-2)


def _md_keys(md, sd: dict) -> list:
    """The state-dict keys of ``md``'s decoupled matrices, in order (their entries hold MD's ``md.*`` state)."""
    keys = [k for g in sd["param_groups"][:-1] for k in g["params"]]
    live = [q for g in md.base_optimizer.param_groups for q in g["params"]]
    return [keys[next(i for i, q in enumerate(live) if q is p)] for p in md._decoupled]


def _md_load_bad_over(base: str) -> None:
    """MD over ``base`` refuses foreign and misshapen state dicts, unchanged; its own resumes bitwise."""
    model = _mlp()
    md = _md_over(model, base)
    _train(md, model, 2)
    good = copy.deepcopy(md.state_dict())
    other = _muon_for(model) if base == "adamw" else torch.optim.AdamW(model.parameters())
    _refused_load(md, model, other.state_dict(), "expected a MagnitudeDirection.state_dict()",
                  "Muon state dict" if base == "adamw" else "torch.optim.AdamW state dict")
    moment = "exp_avg" if base == "adamw" else "momentum_buffer"
    k0, k1 = _md_keys(md, good)
    edits = [
        (("state", k0, "md.gain_row"), torch.zeros(1), ("'0.weight'", "'gain_row'", "(16,)")),
        (("state", k1, "md.gain_col.exp_avg"), torch.zeros(3), ("'1.weight'", "'exp_avg'")),
        (("state", k1, "md.radius"), torch.ones(16, 1), ("'radius'",)),
        (("state", k0, "md.extra"), torch.ones(1), ("'extra'",)),
        (("state", k0, moment), torch.zeros(2, 2), ("base", "(2, 2)")),
        (("param_groups", slice(None, -1)), other.state_dict()["param_groups"], ("base",)),
    ]
    for path, value, must in edits:
        sd = copy.deepcopy(good)
        where = sd
        for k in path[:-1]:
            where = where[k]
        where[path[-1]] = value
        _refused_load(md, model, sd, *must)
    _round_trip_bitwise(md, model, lambda m: _md_over(m, base), base)


def _md_load_nonfinite_state(tmp_path: Path) -> None:
    """An MD state dict of the right shapes with one NaN/Inf in a gain θ, a gain's Adam moment or step, a direction,
    or the base's moments (over AdamW and over Muon) is refused when loaded, naming the matrix and the tensor; nothing
    changed; a fresh optimizer refuses it too; the clean state dict still resumes bitwise."""
    import warnings

    warnings.simplefilter("ignore")
    for base in ("adamw", "muon"):
        model = _mlp()
        md = _md_over(model, base)
        _train(md, model, 2)
        good = copy.deepcopy(md.state_dict())
        k0, k1 = _md_keys(md, good)
        edits = [(("state", k0, "md.gain_row"), "'0.weight'", "'md.gain_row'"),
                 (("state", k1, "md.gain_col.exp_avg"), "'1.weight'", "'md.gain_col.exp_avg'"),
                 (("state", k0, "md.gain_row.exp_avg_sq"), "'0.weight'", "'md.gain_row.exp_avg_sq'"),
                 (("state", k1, "md.gain_row.step"), "'1.weight'", "'md.gain_row.step'"),
                 (("state", k1, "md.direction"), "'1.weight'", "'md.direction'"),
                 (("state", k0, "exp_avg" if base == "adamw" else "momentum_buffer"), "base", "NaN/Inf")]
        for path, *must in edits:
            for bad in (NAN, INF):
                sd = copy.deepcopy(good)
                where = sd
                for k in path[:-1]:
                    where = where[k]
                where[path[-1]].view(-1)[0] = bad
                _refused_load(md, model, sd, *must, "NaN/Inf", "nothing was loaded")
                with _refused(*must):
                    _md_over(copy.deepcopy(model), base).load_state_dict(sd)
        _round_trip_bitwise(md, model, lambda m, base=base: _md_over(m, base), base)


def _md_load_bad(tmp_path: Path) -> None:
    import warnings

    warnings.simplefilter("ignore")
    for base in ("adamw", "muon"):
        _md_load_bad_over(base)


class _SparseNet(torch.nn.Module):
    """A sparse embedding (never decoupled by MD), a matrix MD decouples, and one it is told to leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8, sparse=True)
        self.fc = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(self.emb(x))))


def _md_base_refusals(tmp_path: Path) -> None:
    """What the base optimizer would refuse inside its step is refused by MD before its own passes change anything."""
    import warnings

    from weightgeom.optim import MagnitudeDirection, Muon

    warnings.simplefilter("ignore")
    for base in ("adamw", "muon", "sgd"):
        torch.manual_seed(0)
        model = _SparseNet()
        if base == "muon":
            opt = Muon([{"params": [model.fc.weight], "names": ["fc.weight"]},
                        {"params": [model.out.weight], "names": ["out.weight"], "manifold": "stiefel"},
                        {"params": [model.emb.weight, model.fc.bias], "names": ["emb.weight", "fc.bias"],
                         "algorithm": "adamw"}])
        else:
            kind = torch.optim.AdamW if base == "adamw" else torch.optim.SGD
            opt = kind(model.named_parameters(), lr=1e-2)
        md = MagnitudeDirection(opt, model=model, exclude=("out.weight",))
        x = torch.tensor([[1, 2, 3]])
        _train_on(md, model, x)
        if base == "sgd":  # SGD steps sparse gradients: MD lets it
            _train_on(md, model, x)
            continue
        model.zero_grad()
        model(x).pow(2).sum().backward()
        before = snapshot(md, model)
        with _refused("'emb.weight'", "sparse gradient", "nothing was changed"):
            md.step()
        assert_unchanged(before, snapshot(md, model), f"{base}: after the refused step")
        if base == "muon":  # a manifold matrix MD does not decouple holds NaN: Muon would refuse it mid-step
            model.emb.weight.grad = None
            with torch.no_grad():
                model.out.weight[0, 0] = float("nan")
            before = snapshot(md, model)
            with _refused("'out.weight'", "NaN/Inf weights"):
                md.step()
            assert_unchanged(before, snapshot(md, model), "after the refused step (NaN manifold weights)")


def _train_on(opt: torch.optim.Optimizer, model: torch.nn.Module, x: torch.Tensor) -> None:
    """One step on token batch ``x``, the sparse embedding's gradient left out (the base may not step one)."""
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    if not isinstance(getattr(opt, "base_optimizer", None), torch.optim.SGD):
        model.emb.weight.grad = None
    opt.step()



# Ways a parameter is changed after its optimizer created state for it: (what, change(model, p)). ``p.data = ...`` is
# what ``model.half()`` / ``model.to(...)`` do to every parameter (its gradient too); the last one leaves the gradient
# as it was.
def _to_half(model: torch.nn.Module, p: torch.nn.Parameter) -> None:
    p.data = p.data.half()
    p.grad = torch.randn_like(p)


def _reshaped(model: torch.nn.Module, p: torch.nn.Parameter) -> None:
    p.data = torch.randn(p.shape[0] + 1, *p.shape[1:])
    p.grad = torch.randn_like(p)


def _half_keeping_grad(model: torch.nn.Module, p: torch.nn.Parameter) -> None:
    p.data = p.data.half()  # p.grad stays float32


def _model_half(model: torch.nn.Module, p: torch.nn.Parameter) -> None:
    model.half()


_CHANGES = {"cast to float16": _to_half, "given another shape": _reshaped,
            "cast to float16 after its gradient": _half_keeping_grad, "model.half()": _model_half}


def _two_groups_after_a_step(kw: dict):
    """Two 16×8 matrices ``a``, ``b`` in two Muon groups of kind ``kw`` (seed 0), after one step."""
    from weightgeom.optim import Muon

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 16, bias=False), "b": torch.nn.Linear(8, 16, bias=False)})
    opt = Muon([{"params": [model["a"].weight], "names": ["a.weight"], **kw},
                {"params": [model["b"].weight], "names": ["b.weight"], **kw}])
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def _muon_param_changed(tmp_path: Path) -> None:
    """A parameter changed after Muon's first step (its state is float32 of the old shape): the next step is refused
    naming it before the parameter beside it moves."""
    import warnings


    warnings.simplefilter("ignore")
    for kind, kw in _GROUP_KINDS.items():
        for what, change in _CHANGES.items():
            model, opt = _two_groups_after_a_step(kw)
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            change(model, model["b"].weight)
            before = snapshot(opt, model)
            first = "'a.weight'" if change is _model_half else "'b.weight'"  # the first parameter that changed
            with _refused(first, "was changed since", "nothing was changed"):
                opt.step()
            assert_unchanged(before, snapshot(opt, model), f"{kind}, {what}: after the refused step")


def _md_on_mlp(base: str, fused: bool | None):
    """``_mlp()`` and a MagnitudeDirection over ``base`` (adamw, sgd with momentum, or Muon), ``1.weight`` excluded."""
    from weightgeom.optim import MagnitudeDirection

    model = _mlp()
    if base == "muon":
        opt = _muon_for(model)
    else:
        kind = torch.optim.AdamW if base == "adamw" else torch.optim.SGD
        opt = kind(model.named_parameters(), lr=1e-2, **({"momentum": 0.9} if base == "sgd" else {}))
    return model, MagnitudeDirection(opt, model=model, fused=fused, exclude=("1.weight",))


def _md_param_changed(tmp_path: Path) -> None:
    """A parameter changed after MagnitudeDirection's first step (a bias it does not decouple, a matrix it does, or
    the whole model): the next step is refused naming it before any matrix moves, on every path and base."""
    import warnings

    from weightgeom.optim import Muon

    warnings.simplefilter("ignore")
    for base in ("adamw", "sgd", "muon"):
        for fused in (None, False):
            for target in ("1.bias", "0.weight", "1.weight"):
                for what, change in _CHANGES.items():
                    model, md = _md_on_mlp(base, fused)
                    assert isinstance(md.base_optimizer, Muon if base == "muon" else torch.optim.Optimizer)
                    _train(md, model, 1)
                    for p in model.parameters():
                        p.grad = torch.randn_like(p)
                    change(model, dict(model.named_parameters())[target])
                    before = snapshot(md, model)
                    where = f"{base}, fused={fused}, {target} {what}"
                    with _refused("nothing was changed"):
                        md.step()
                    assert_unchanged(before, snapshot(md, model), f"{where}: after the refused step")



# Group values set after construction (as a user or an LR scheduler would), each refused by the constructor:
# (key, value, the group kinds it applies to, what the refusal names).
_GROUP_EDITS = [
    ("lr", "fast", None, "lr='fast'"), ("lr", None, None, "lr=None"), ("betas", (0.9,), None, "betas=(0.9,)"),
    ("momentum", "x", None, "momentum='x'"), ("weight_decay", "x", None, "weight_decay='x'"),
    ("msign_method", "bad", None, "msign_method='bad'"), ("split", 3, ("muon", "stiefel"), "split=3"),
    ("manifold", "nope", ("muon", "stiefel", "dgram", "oblique"), "manifold='nope'"),
    ("retraction", "bad", ("stiefel", "dgram", "oblique"), "retraction='bad'"),
    ("algorithm", "adamw", ("muon",), "'momentum_buffer'"),  # after a step: state an AdamW group does not keep
    ("manifold", None, ("stiefel", "dgram", "oblique"), "'dual_multiplier'"),
]


def _muon_group_edited(tmp_path: Path) -> None:
    """A value set in group 1 after a step that the constructor refuses: the next step is refused naming it before
    group 0 moves."""
    import warnings


    warnings.simplefilter("ignore")
    for kind, kw in _GROUP_KINDS.items():
        for key, value, kinds, named in _GROUP_EDITS:
            if kinds is not None and kind not in kinds:
                continue
            model, opt = _two_groups_after_a_step(kw)
            opt.param_groups[1][key] = value
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            before = snapshot(opt, model)
            with _refused(named, "nothing was changed"):
                opt.step()
            assert_unchanged(before, snapshot(opt, model), f"{kind}, {key}={value!r}: after the refused step")


def _md_group_edited(tmp_path: Path) -> None:
    """A value set after a step in a base group or in MD's gains group that the constructor refuses: the next step is
    refused naming it before any matrix moves, on every base and path."""
    import warnings


    warnings.simplefilter("ignore")
    edits = {"adamw": [(0, "lr", "fast"), (0, "betas", (0.9,)), (0, "eps", None)],
             "sgd": [(0, "lr", None), (0, "momentum", "x")],
             "muon": [(0, "lr", "fast"), (1, "betas", (0.9,))]}
    for base, base_edits in edits.items():
        for fused in (None, False):
            for gi, key, value in [*base_edits, (-1, "lr", "x"), (-1, "betas", (0.9,)), (-1, "eps", None)]:
                model, md = _md_on_mlp(base, fused)
                _train(md, model, 1)
                md.param_groups[gi][key] = value
                for p in model.parameters():
                    p.grad = torch.randn_like(p)
                before = snapshot(md, model)
                with _refused(f"{key}={value!r}", "nothing was changed"):
                    md.step()
                assert_unchanged(before, snapshot(md, model), f"{base}, fused={fused}, group {gi} {key}={value!r}")


# ---------------------------------------------------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
CASES: list[Hostile] = [
    Hostile("muon-nan-last-group-adamw", "optim",
            "Muon with a NaN gradient in its last (AdamW) group refuses the step naming the parameter; no parameter, "
            "momentum buffer, step counter or other state changed",
            _muon_last_group("adamw", NAN)),
    Hostile("muon-nan-last-group-manifold", "optim",
            "Muon with a NaN gradient in its last group, a manifold-Muon (Stiefel) group, refuses the step naming "
            "the parameter; nothing changed, dual multipliers included",
            _muon_last_group("manifold", NAN)),
    Hostile("muon-inf-last-group-muon", "optim",
            "Muon with an Inf gradient in its last (plain Muon) group refuses the step naming the parameter; "
            "nothing changed",
            _muon_last_group("muon", INF)),
    Hostile("md-eager-nan-last-matrix", "optim",
            "MagnitudeDirection (eager path) over AdamW with a NaN gradient in the last decoupled matrix refuses the "
            "step naming it; W, directions, gains, their Adam state and the base AdamW state unchanged",
            _md_nan(False, "2.weight", NAN)),
    Hostile("md-fused-nan-last-matrix", "optim",
            "MagnitudeDirection (fused C path) over AdamW with a NaN gradient in the last decoupled matrix refuses "
            "the step naming it; nothing changed",
            _md_nan(True, "2.weight", NAN)),
    Hostile("md-fused-inf-bias", "optim",
            "MagnitudeDirection (fused path) with an Inf gradient in a parameter it does not decouple (a bias) "
            "refuses the step naming it, before any matrix is stepped; nothing changed",
            _md_nan(True, "2.bias", INF)),
    Hostile("md-eager-tiny-gain", "optim",
            "MagnitudeDirection (eager path) with gains of 1e-30, then an outside edit of W and a checkpoint reload: "
            "W stays finite and equal to γ_r Ŵ γ_c (gains are clamped to at least 1e-6)",
            _tiny_gain(False, 1e-30)),
    Hostile("md-fused-zero-gain", "optim",
            "MagnitudeDirection (fused path) with gains that underflow to 0, then an outside edit of W and a "
            "checkpoint reload: W stays finite and equal to γ_r Ŵ γ_c",
            _tiny_gain(True, 0.0)),
    Hostile("md-fused-subnormal-gain", "optim",
            "MagnitudeDirection (fused path) with subnormal gains (1e-40), then an outside edit of W and a checkpoint "
            "reload: W stays finite and equal to γ_r Ŵ γ_c",
            _tiny_gain(True, 1e-40)),
    Hostile("md-torch-huge-gradient", "optim",
            "MagnitudeDirection's torch passes (fused=False) over SGD with finite float32 gradients of 1e30 and 3e38 "
            "on the Frobenius, row and column spheres: Ŵ stays on its sphere, W finite and nonzero, the gains and "
            "their Adam moments finite and still moving afterwards; also 3e38 after the gains grew to ~3, with the "
            "`direct` parameterization, and on rows whose products sum to +inf − inf (sphere sums in float64, "
            "overflow-safe gain sums, γ_r·G·γ_c "
            "saturating, the gains' gradient clamped to 9.2e18; before, W became 0 at 1e30 and NaN at 3e38)",
            _huge_gradient(False)),
    Hostile("md-c-passes-huge-gradient", "optim",
            "The same with MD's C passes around SGD (the default, eager-C): Ŵ on its sphere, W finite and nonzero, "
            "gains finite and moving",
            _huge_gradient(None)),
    Hostile("muon-bf16-msign-hostile-scales", "optim",
            "Muon with a bf16 msign (on the CPU its input normalisation runs in C: the norm summed in double, no "
            "prescale) on gradients of 1e-40 (subnormal), 1e-23, 1e37 and rank 1: steps finite, the update "
            "orthogonal to bf16's band",
            _bf16_msign_scales(None)),
    Hostile("manifold-muon-bf16-msign-hostile-scales", "optim",
            "The same for manifold Muon (DGram): steps finite and W on its manifold (1e-5)",
            _bf16_msign_scales("dgram")),
    Hostile("manifold-muon-medium-matmul-mode", "optim",
            "torch.set_float32_matmul_precision('medium') (float32 matmuls in bf16 on AMX/AVX512-BF16 CPUs): "
            "manifold-Muon (Stiefel) steps equal a full-precision process's bitwise, W stays on its manifold (1e-6) "
            "and the process keeps its mode (before: 3.4e-3 off the manifold after 20 steps)",
            _low_precision_mode("medium")),
    Hostile("manifold-muon-split-products-medium-mode", "optim",
            "Manifold Muon (DGram, 512×256) with its constraint products forced split-bf16 "
            "(WEIGHTGEOM_SPLIT_PRODUCTS=1) in a process that set torch.set_float32_matmul_precision('medium'): "
            "steps equal a full-precision process's bitwise and W stays on its manifold (2e-6)",
            _low_precision_mode("medium", shape=(512, 256), manifold="dgram", steps=6, tol=2e-6,
                                products="split_bf16")),
    Hostile("manifold-muon-onednn-products-medium-mode", "optim",
            "Manifold Muon (DGram, 512×256) with its constraint products forced through oneDNN "
            "(WEIGHTGEOM_PRODUCTS=ieee_onednn; oneDNN's float32 linear follows the process's matmul mode) in a "
            "process that set torch.set_float32_matmul_precision('medium'): steps equal a full-precision process's "
            "bitwise and W stays on its manifold (1e-6)",
            _low_precision_mode("medium", shape=(512, 256), manifold="dgram", steps=6, tol=1e-6,
                                products="ieee_onednn")),
    Hostile("manifold-muon-bad-split-env", "optim",
            "WEIGHTGEOM_SPLIT_PRODUCTS=yes: `weightgeom train` of a manifold-Muon config stops before any step with "
            "one line naming the variable, exit 2, no checkpoint (before it was read inside the first step, after "
            "other groups had stepped)",
            _bad_products_env("WEIGHTGEOM_SPLIT_PRODUCTS", "yes")),
    Hostile("manifold-muon-bad-products-env", "optim",
            "WEIGHTGEOM_PRODUCTS=fast (not auto, ieee, ieee_onednn or split_bf16): `weightgeom train` of a "
            "manifold-Muon config stops before any step with one line naming the variable, exit 2, no checkpoint",
            _bad_products_env("WEIGHTGEOM_PRODUCTS", "fast")),
    Hostile("md-torch-stale-gain-grad", "optim",
            "model.zero_grad() between MagnitudeDirection steps (torch passes, fused=False), then a gradient for one "
            "layer only: the other layer's gains keep last step's θ.grad but do not move, nor does its W (before: "
            "its gains took a full Adam step while W stayed, so W and γ_r Ŵ γ_c disagreed)",
            _stale_gain_grad(False)),
    Hostile("md-default-stale-gain-grad", "optim",
            "The same on MD's default path over AdamW (the fused kernel where it loads, stepping each matrix's "
            "gains with the matrix; else the eager passes)",
            _stale_gain_grad(None)),
    Hostile("muon-unsupported-dtype", "optim",
            "Muon given a complex64, int64, bool or float8 parameter beside a float32 one (plain-Muon, AdamW, "
            "Stiefel, DGram or Oblique group) refuses it at construction and in `add_param_group` with one line "
            "naming it (group, position, shape, dtype) and the supported dtypes; a refused group is not added "
            "(before: complex was accepted and a step updated the float32 parameter, then raised)",
            _muon_bad_dtype),
    Hostile("muon-dtype-changed-before-step", "optim",
            "A Muon parameter turned complex after construction (`p.data = p.data.to(torch.complex64)`) makes the "
            "next step refuse with one line naming it, in every kind of group; the float32 parameter beside it and "
            "all optimizer state unchanged",
            _muon_dtype_changed),
    Hostile("md-unsupported-dtype", "optim",
            "MagnitudeDirection over an AdamW holding a complex64 or float8 parameter it does not decouple is "
            "refused at construction, naming it (group, position, dtype) and the supported dtypes; so is "
            "`add_param_group` of one",
            _md_bad_dtype),
    Hostile("muon-duplicate-param", "optim",
            "`Muon([p, p])`, a parameter in two groups, or `add_param_group` of a parameter the optimizer holds is "
            "refused with one line naming it and both places, in every kind of group (before: p was stepped twice "
            "with only torch's warning)",
            _muon_duplicates),
    Hostile("md-duplicate-param", "optim",
            "MagnitudeDirection over an optimizer that lists a parameter twice, or `add_param_group` of a parameter "
            "it holds, is refused with one line naming it",
            _md_duplicates),
    Hostile("muon-load-foreign-state-dict", "optim",
            "`Muon.load_state_dict` of a torch.optim.AdamW state dict with as many groups, of a MagnitudeDirection "
            "state dict or of a list is refused with one line naming what it is (before: AdamW's was accepted and "
            "the next step raised `KeyError: 'algorithm'`); nothing changed, the optimizer still steps, and its own "
            "state dict still resumes bitwise",
            _muon_load_foreign),
    Hostile("muon-load-other-structure", "optim",
            "Loading a Muon state dict whose group has another manifold (Stiefel into plain, DGram into Stiefel, "
            "plain into Oblique), momentum_form, layout, dual_normalize or algorithm is refused with one line naming "
            "the group, the key and both values (before: the group silently became Stiefel); nothing changed",
            _muon_load_structure),
    Hostile("muon-load-bad-state", "optim",
            "A Muon state dict with a momentum buffer, dual multiplier or AdamW moment of another shape or kind, a "
            "state key this optimizer does not keep, state for an unlisted parameter, an unknown or invalid group "
            "key, or another number of groups or parameters is refused with one line naming the parameter or key; "
            "nothing changed and the optimizer still steps",
            _muon_load_bad_state),
    Hostile("muon-load-nonfinite-state", "optim",
            "A Muon state dict of the right shapes whose momentum buffer (plain or Stiefel group), dual multiplier, "
            "cold multiplier or AdamW moment holds a NaN or Inf is refused by `load_state_dict` (hence by `weightgeom "
            "train --resume`, HF Trainer and Lightning resumes) with one line naming the parameter and the tensor; "
            "nothing changed (before: it loaded, and those matrices never moved again, silently)",
            _muon_load_nonfinite_state),
    Hostile("train-resume-nonfinite-optimizer-state", "optim",
            "`weightgeom train --resume` of a run whose newest checkpoint is well formed (hash intact) but holds a NaN "
            "momentum buffer stops with one line naming the checkpoint, the parameter and `momentum_buffer`, exit 2; "
            "the checkpoint is kept (before: the run resumed and that matrix never moved again)",
            _resume_nonfinite_state),
    Hostile("muon-compiled-refuses-as-eager", "optim",
            "Whatever Muon's eager step refuses before changing anything — a parameter turned float64 under its "
            "float32 gradient (`p.data = p.data.double()`), given another shape, turned complex, or a sparse "
            "gradient, in a Muon or an AdamW group — its compiled step (`compile_step`, on_nonfinite \"skip\" and "
            "\"raise\") refuses with the same one line, nothing changed (before: under \"skip\" the float64 "
            "parameter was stepped; otherwise `InternalTorchDynamoError`, `Unsupported: Attempted to wrap sparse "
            "Tensor` or a RuntimeError from `torch.stack`)",
            _refusals_eager_and_compiled),
    Hostile("md-load-bad-state", "optim",
            "`MagnitudeDirection.load_state_dict` (over AdamW and over Muon) of the base's own state dict, or of an "
            "MD state dict whose gains (before: a gain of shape (1,) was broadcast), gain moments, radius, entry "
            "keys or base part do not fit is refused with one line naming it; nothing changed, and a round trip "
            "into a fresh optimizer of the same config resumes bitwise",
            _md_load_bad),
    Hostile("md-load-nonfinite-state", "optim",
            "A MagnitudeDirection state dict of the right shapes (over AdamW or Muon) with a NaN or Inf in a gain, a "
            "gain's Adam moment or step, a direction or the base's moments is refused by `load_state_dict` (hence by "
            "every resume path) with one line naming the matrix and the tensor; nothing changed (before: a NaN column-"
            "gain moment loaded, and that column of the matrix was NaN after the next step)",
            _md_load_nonfinite_state),
    Hostile("md-base-would-refuse", "optim",
            "MagnitudeDirection over AdamW or Muon with a sparse gradient on a parameter it does not decouple (an "
            "`nn.Embedding(sparse=True)`), or over Muon with NaN weights in a manifold matrix it does not decouple, "
            "refuses the step naming it before any matrix moves (before: over AdamW the decoupled matrices were "
            "stepped, then AdamW raised); nothing changed; over SGD the sparse gradient still steps",
            _md_base_refusals),
    Hostile("muon-param-changed-under-state", "optim",
            "A Muon parameter changed after its first step (`p.data` cast to float16 or given another shape, cast "
            "after its gradient was computed, or `model.half()`) makes the next step refuse with one line naming it "
            "and the gradient or state entry that no longer fits, in every kind of group; the parameter beside it "
            "and all optimizer state unchanged (before: the other group was stepped, then a RuntimeError)",
            _muon_param_changed),
    Hostile("md-param-changed-under-state", "optim",
            "MagnitudeDirection over AdamW, SGD or Muon (fused and eager paths) with a bias, a decoupled matrix or a "
            "matrix it leaves to the base changed after a step (cast to float16, given another shape, `model.half()`) "
            "refuses the next step with one line naming it; nothing changed (before: the decoupled matrices were "
            "stepped, then the base optimizer raised)",
            _md_param_changed),
    Hostile("muon-group-edited-before-step", "optim",
            "A Muon group value set after a step that the constructor refuses (`lr='fast'` or None, `betas=(0.9,)`, an "
            "unknown msign method, manifold or retraction, a split that does not divide, an algorithm or manifold "
            "changed under the state) makes the next step refuse with one line naming it, in every kind of group; "
            "the groups before it and all optimizer state unchanged (before: they were stepped, then a TypeError or "
            "KeyError)",
            _muon_group_edited),
    Hostile("md-group-edited-before-step", "optim",
            "MagnitudeDirection over AdamW, SGD or Muon (fused and eager paths) with a base group's `lr`, `betas`, "
            "`eps` or `momentum`, or its gains group's, set after a step to a value of the wrong kind refuses the "
            "next step with one line naming it; nothing changed (before: the matrices were stepped, then the base "
            "optimizer or the gains' Adam raised)",
            _md_group_edited),
]

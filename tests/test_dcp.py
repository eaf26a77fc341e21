"""``torch.distributed.checkpoint``'s optimizer helpers in one process: ``get_optimizer_state_dict`` /
``set_optimizer_state_dict`` (parameters keyed by name) round-trip Muon with manifold groups and MagnitudeDirection
over AdamW and over Muon — through ``torch.save``/``torch.load(weights_only=True)``, with an LR scheduler on every
group, the gains group's included — and training continues bit for bit. The same under FSDP2 on two gloo processes
is in test_distributed.py."""

from __future__ import annotations

import io

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from weightgeom.models import GPT, GPTConfig
from weightgeom.optim import MagnitudeDirection, Muon, param_groups

VOCAB, T, STEPS, SAVE_AT = 32, 8, 5, 2
KINDS = ("muon-hetero", "md-adamw", "md-muon-hetero")


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=VOCAB, block_size=T))


def _optimizer(kind: str, model: GPT) -> torch.optim.Optimizer:
    if kind == "md-adamw":
        return MagnitudeDirection(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, gain_lr=1e-2)
    opt = Muon(param_groups(model, strategy="hetero", lr=0.02, adamw_lr=3e-3, verbose=False))
    return MagnitudeDirection(opt, model=model, gain_lr=1e-2) if kind.startswith("md") else opt


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _run(kind: str, through_dcp: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    """STEPS steps; with ``through_dcp`` the optimizer (and scheduler) are rebuilt at SAVE_AT from a checkpoint."""
    model = _model()
    opt = _optimizer(kind, model)
    sched = _schedule(opt)
    for s in range(STEPS):
        if through_dcp and s == SAVE_AT:
            buf = io.BytesIO()
            torch.save({"optim": get_optimizer_state_dict(model, opt), "sched": sched.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            opt = _optimizer(kind, model)
            sched = _schedule(opt)
            set_optimizer_state_dict(model, opt, saved["optim"])
            sched.load_state_dict(saved["sched"])
        g = torch.Generator().manual_seed(1000 + s)
        x = torch.randint(0, VOCAB, (4, T), generator=g)
        _, loss = model(x, torch.roll(x, -1, dims=1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, [g["lr"] for g in opt.param_groups]


@pytest.mark.parametrize("kind", KINDS)
def test_dcp_round_trip_continues_bit_identically(kind):
    ref, ref_lrs = _run(kind, through_dcp=False)
    got, lrs = _run(kind, through_dcp=True)
    assert lrs == ref_lrs  # every group's scheduled lr, the gains group's included
    for n in ref:
        assert torch.equal(got[n], ref[n]), n


def test_dcp_state_dict_is_keyed_by_name_and_carries_md_state():
    """What DCP reads from MD: every entry keyed by a model parameter's name, each decoupled matrix's entry with the
    base's moments and MD's ``md.*`` state, the gains group last and without parameters."""
    model = _model()
    opt = _optimizer("md-adamw", model)
    _, loss = model(torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long))
    loss.backward()
    opt.step()
    sd = get_optimizer_state_dict(model, opt)
    names = {n for n, _ in model.named_parameters()}
    assert set(sd["state"]) <= names
    decoupled = set(opt.decoupled_names)
    assert decoupled and decoupled <= set(sd["state"])
    for n in decoupled:
        assert {"exp_avg", "md.direction", "md.radius", "md.gain_row", "md.gain_col.exp_avg"} <= set(sd["state"][n]), n
    assert sd["param_groups"][-1]["params"] == [] and sd["param_groups"][-1]["md_role"] == "gains"


def test_dcp_zero_step_leaves_manifold_matrices_unchanged():
    """DCP creates a fresh optimizer's state by one step with zero gradients and lr 0: a manifold group's matrices
    are then bitwise unchanged (their retraction alone moved them by rounding), and the state exists."""
    model = _model()
    opt = _optimizer("muon-hetero", model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    get_optimizer_state_dict(model, opt)  # runs the initialising step on a state-less optimizer
    assert opt.state
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_md_state_dict_keeps_the_base_state_dicts_other_keys():
    """MD over Muon: the base's top-level keys besides state and param_groups (Muon's "numerics") stay in MD's
    state dict, and it loads back."""
    model = _model()
    opt = _optimizer("md-muon-hetero", model)
    _, loss = model(torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long))
    loss.backward()
    opt.step()
    sd = opt.state_dict()
    assert "numerics" in sd and sd["numerics"] == opt.base_optimizer.state_dict()["numerics"]
    _optimizer("md-muon-hetero", _model()).load_state_dict(sd)

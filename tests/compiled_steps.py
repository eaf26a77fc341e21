"""One helper for the tests that compare a torch.compile'd optimizer step with the eager one."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo


def assert_compiled_equals_eager(make_opt: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                                 init: list[torch.Tensor], grads: list[list[torch.Tensor]], atol: float = 0.0) -> None:
    """Parameters from ``init``, one step per entry of ``grads``, through ``make_opt(params).step`` eagerly and through
    ``torch.compile(..., backend="eager")`` (graph breaks allowed): the final parameters are bitwise equal (within
    ``atol`` when given: a compiled manifold step runs the host-free path, batched)."""

    def run(compiled: bool) -> list[torch.Tensor]:
        ps = [torch.nn.Parameter(w.clone()) for w in init]
        opt = make_opt(ps)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for gs in grads:
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
            step()
        return [p.detach().clone() for p in ps]

    torch._dynamo.reset()
    try:
        eager, compiled = run(False), run(True)
    finally:
        torch._dynamo.reset()
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b) if atol == 0 else float((a - b).abs().max()) <= atol, float((a - b).abs().max())


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest absolute difference between two lists of tensors of the same shapes and dtypes (float64)."""
    assert len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


def eager_and_compiled(run: Callable[[bool], tuple]) -> tuple[tuple, tuple]:
    """``(run(False), run(True))`` between two ``torch._dynamo.reset()``, so no trace leaks into other tests."""
    torch._dynamo.reset()
    try:
        return run(False), run(True)
    finally:
        torch._dynamo.reset()

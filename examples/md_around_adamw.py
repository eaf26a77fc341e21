"""Magnitude–direction (MD) training around your own ``torch.optim.AdamW`` on your own model.

What it shows:

1. An ordinary PyTorch model (a small residual MLP classifier written here, nothing from weightgeom) and an ordinary
   ``torch.optim.AdamW`` over its parameters.
2. Wrapping that optimizer in ``weightgeom.optim.MagnitudeDirection``: each weight matrix is trained as
   W = diag(γ_r) · Ŵ · diag(γ_c), where AdamW steps the *direction* Ŵ (kept on a sphere of its initial Frobenius
   norm) and a separate Adam steps the row and column *gains* γ_r, γ_c (starting at 1). The model still holds one
   ordinary weight tensor per layer; its forward pass is unchanged.
3. A few training steps with the wrapper used exactly like the optimizer it wraps (``step``, ``zero_grad``, an LR
   scheduler on top), and what it learned: ``summary()`` (per matrix: radius, mean gains, which code path ran it),
   the spread of the gains, and that each direction Ŵ stays on its sphere while W itself changes norm.

Which parameters are decoupled: by default every 2-D parameter of the base optimizer except embeddings; here the
three hidden matrices and the classifier head. Biases and other 1-D parameters are stepped by AdamW as usual. MD
parameters get no weight decay (the sphere already fixes their norm): ``weight_decay_overridden`` names them.

Run:
    python examples/md_around_adamw.py           # width 256, 300 steps
    python examples/md_around_adamw.py --tiny    # width 32, 20 steps (what the tests run)

Time on a 2-core CPU: full size about 20 seconds (20 CPU-seconds measured); ``--tiny`` under a second after the
imports. Writes no files.
"""

from __future__ import annotations

import argparse

import torch

from weightgeom.optim import MagnitudeDirection


class ResidualMLP(torch.nn.Module):
    """An input layer, ``depth`` residual blocks h + relu(W·h), a linear classifier: plain PyTorch."""

    def __init__(self, dim_in: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(dim_in, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits for a batch of inputs (batch, dim_in)."""
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.head(h)


def make_data(n: int, dim_in: int, classes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic classification task: labels from a fixed random teacher network (learnable, not trivial)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim_in, generator=g)
    teacher = torch.randn(dim_in, classes, generator=g)
    y = (torch.tanh(x) @ teacher).argmax(-1)
    return x, y


def main(argv: list[str] | None = None) -> int:
    """Train the MLP with MD around AdamW; print the losses, the gains and the sphere check."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="width 32, 20 steps (under a second)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 300; --tiny 20)")
    p.add_argument("--gain-lr", type=float, default=1e-2, help="Adam learning rate of the gains (default 1e-2)")
    args = p.parse_args(argv)
    width, steps = (32, 20) if args.tiny else (256, 300)
    steps = args.steps if args.steps is not None else steps
    torch.manual_seed(0)

    x, y = make_data(2048, 16, 4)
    model = ResidualMLP(16, width, depth=3, classes=4)

    # 1. your optimizer, as you would build it anyway
    adamw = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    # 2. one line: wrap it. model= lets it name parameters in errors and in summary(); gains="row+col" is the default
    opt = MagnitudeDirection(adamw, model=model, gains="row+col", gain_lr=args.gain_lr)
    # a scheduler on the wrapper schedules AdamW's groups and the gains group alike
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    print(f"decoupled matrices: {', '.join(opt.decoupled_names)}")
    print(f"weight decay turned off for (the sphere fixes their norm): {', '.join(opt.weight_decay_overridden)}")

    norms0 = {n: float(p.detach().norm()) for n, p in model.named_parameters() if n in opt.decoupled_names}
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        idx = torch.randint(0, len(x), (128,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()  # AdamW steps the directions, Adam the gains; W = γ_r Ŵ γ_c is written back into the model
        sched.step()
        opt.zero_grad()
        if step == 0 or (step + 1) % max(1, steps // 5) == 0:
            print(f"step {step + 1:4d}  loss {float(loss.detach()):.4f}")
    with torch.no_grad():
        acc = float((model(x).argmax(-1) == y).float().mean())
    print(f"train accuracy {acc:.3f}\n")

    print("summary() — per matrix: sphere radius ‖Ŵ‖_F, mean row / column gain, the code path of the last step:")
    print(opt.summary())
    print("\nwhat the gains learned, and the sphere:")
    params = dict(model.named_parameters())
    for name in opt.decoupled_names:
        w = params[name]
        g_row, g_col = opt.gain_values(w)  # γ_r as (m, 1), γ_c as (1, n)
        direction = opt.direction(w)  # Ŵ, the unit-free part AdamW trained
        radius = float(opt.state[w]["radius"])
        print(f"  {name:16s} γ_r in [{float(g_row.min()):.3f}, {float(g_row.max()):.3f}]  "
              f"γ_c in [{float(g_col.min()):.3f}, {float(g_col.max()):.3f}]  "
              f"‖Ŵ‖_F {float(direction.norm()):.4f} (radius {radius:.4f})  "
              f"‖W‖_F {norms0[name]:.3f} -> {float(w.detach().norm()):.3f}")
    # the model's tensor is exactly the recomposed product: nothing else to save or load than opt.state_dict()
    w = params[opt.decoupled_names[0]]
    g_row, g_col = opt.gain_values(w)
    err = float((g_row * opt.direction(w) * g_col - w.detach()).abs().max())
    print(f"\nmodel weight == γ_r · Ŵ · γ_c: max difference {err:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

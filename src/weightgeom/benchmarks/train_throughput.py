"""Training throughput: our GPT training step against a plain nanoGPT-style reference, same config.

    python -m weightgeom.benchmarks.train_throughput                # CPU size (4 layers, width 256, T=128, B=8)
    python -m weightgeom.benchmarks.train_throughput --preset gpt2  # GPT-2 small, T=1024 (CUDA; bf16 autocast)
    python -m weightgeom.benchmarks.train_throughput --e2e          # also time a whole `weightgeom.train.train` run
    weightgeom bench train_throughput --quick                       # smoke run
    weightgeom bench train_throughput --quick --compiled            # also with the optimizer step compiled

"Ours" is the trainer's step: ``weightgeom.models`` GPT, batches from ``weightgeom.train.batches``, the LR schedule
applied to every group, global grad-norm clipping (``weightgeom.train.distributed.clip_grad_norm``), AdamW from
``build_optimizer_from_config``. The reference is nanoGPT's ``model.py`` written out plainly below (fused c_attn,
``F.scaled_dot_product_attention``, GELU MLP, tied LM head) with nanoGPT's training loop (random-window
``get_batch``, ``clip_grad_norm_``, fused-free ``torch.optim.AdamW``). Both use identical sizes, batch, optimizer
hyperparameters and dtype. The two are timed in alternating rounds (so a noisy shared machine hits both alike) and the
median step time of each is compared: ratio = tokens/s ours ÷ tokens/s reference (target ≥ 1.0). On a shared CPU
machine the wall clock mostly measures the other jobs, so ``ratio_cpu_time`` (median process CPU time per step) is
reported too. Prints one JSON line.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from weightgeom._cli_args import OneLineParser
from weightgeom.benchmarks._common import bench_command, hardware_tag, steady_allocator, write_markdown
from weightgeom.optim.compiled import WARM_CALLS, compile_step
from weightgeom.train import train
from weightgeom.train.batches import build_batches
from weightgeom.train.config import load_config
from weightgeom.train.distributed import DistInfo, clip_grad_norm
from weightgeom.train.schedule import apply_lr, capture_base_lrs, make_lr_fn
from weightgeom.train.trainer import build_optimizer_from_config, model_from_config


# ------------------------------------------------------------------------------------ reference (nanoGPT model.py)
class RefAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class RefMLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class RefBlock(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=False)
        self.attn = RefAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd, bias=False)
        self.mlp = RefMLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class RefGPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([RefBlock(n_embd, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd, bias=False)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


PRESETS = {
    "cpu": dict(n_layer=4, n_head=4, n_embd=256, block_size=128, batch_size=8, vocab_size=8192),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=16, vocab_size=50304),
}


def main(argv=None) -> dict:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="cpu")
    ap.add_argument("--rounds", type=int, default=10, help="alternating timing rounds")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per round per side")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = leave torch's default)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--e2e", action="store_true", help="also time a full weightgeom.train.train run (ours only)")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 2 steps, 1 warmup step (smoke run)")
    ap.add_argument("--compiled", action="store_true",
                    help="also time our step with the optimizer through weightgeom.optim.compile_step (as "
                         "train.compile_optimizer=on runs it; compiled during the warm-up)")
    ap.add_argument("--markdown", default=None, metavar="FILE",
                    help="put the result into FILE as a markdown table (replacing this benchmark's block for this "
                         "device kind, e.g. in docs/benchmarks.md)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 3, 1, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    steady_allocator()  # steady timings: see its docstring

    P = PRESETS[args.preset]
    dev = torch.device(args.device)
    B, T, V = P["batch_size"], P["block_size"], P["vocab_size"]
    cfg = load_config({
        "run": {"device": dev.type, "dtype": "bfloat16" if dev.type == "cuda" else "float32"},
        "model": {"kind": "gpt", "n_layer": P["n_layer"], "n_head": P["n_head"], "n_embd": P["n_embd"],
                  "block_size": T, "vocab_size": V, "bias": False},
        "data": {"kind": "synthetic", "block_size": T, "batch_size": B},
        "optim": {"name": "adamw", "adamw": {"lr": 6e-4, "weight_decay": 0.1}},
        "schedule": {"kind": "cosine", "warmup": 10},
        "train": {"max_steps": 1000, "grad_clip": 1.0},
    })
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if dev.type == "cuda" else contextlib.nullcontext
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    # ours: the trainer's components
    batches = build_batches(cfg)
    lr_fn = make_lr_fn(cfg.schedule, 1000)
    info = DistInfo(device=dev)

    def ours(compiled: bool):
        """Our training step (the trainer's components); ``compiled``: the optimizer step through compile_step."""
        torch.manual_seed(0)
        model = model_from_config(cfg.model).to(dev)
        opt = build_optimizer_from_config(model, cfg)
        capture_base_lrs(opt)
        step_fn = compile_step(opt) if compiled else opt.step
        params = [p for p in model.parameters() if p.requires_grad]
        state = {"s": 0}

        def step():
            s = state["s"]
            apply_lr(opt, lr_fn(s))
            x, y = batches.get("train", s, 0, dev)
            with amp():
                _, loss = model(x, y)
            loss.backward()
            clip_grad_norm(params, 1.0, info)
            step_fn()
            opt.zero_grad(set_to_none=True)
            state["s"] += 1
            return loss

        return model, step, step_fn

    model, ours_step, _ = ours(False)
    sides = {"ours": ours_step}
    if args.compiled:
        _, sides["ours_compiled"], compiled_fn = ours(True)

    # reference: nanoGPT
    torch.manual_seed(0)
    ref = RefGPT(V, T, P["n_layer"], P["n_head"], P["n_embd"]).to(dev)
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    nodecay = [p for p in ref.parameters() if p.dim() < 2]
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
                                lr=6e-4, betas=(0.9, 0.95))
    data = torch.from_numpy(batches.train.astype("int64"))
    g = torch.Generator().manual_seed(0)

    def ref_step():
        ix = torch.randint(len(data) - T, (B,), generator=g)
        x = torch.stack([data[i:i + T] for i in ix]).to(dev)
        y = torch.stack([data[i + 1:i + 1 + T] for i in ix]).to(dev)
        with amp():
            _, loss = ref(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        return loss

    sides["ref"] = ref_step
    for i in range(max(args.warmup, WARM_CALLS if args.compiled else 0)):
        for name, fn in sides.items():
            if i < args.warmup or name == "ours_compiled":  # the compiled side compiles before the timing
                fn()
    times: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.rounds):
        for name, fn in sides.items():
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                fn()
            sync()
            times[name].append((time.perf_counter() - t0) / args.steps)
            cpu[name].append((time.process_time() - c0) / args.steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    tok = B * T
    out = {
        "preset": args.preset, "device": str(dev), "hardware": hardware_tag(dev), "config": P,
        "threads": torch.get_num_threads(),
        "tokens_per_s_ours": tok / med["ours"], "tokens_per_s_ref": tok / med["ref"],
        "ratio": med["ref"] / med["ours"],
        # process CPU time per step: robust to other jobs on a shared CPU machine (meaningless on CUDA)
        "ratio_cpu_time": cmed["ref"] / cmed["ours"],
        "ms_per_step_ours": med["ours"] * 1e3, "ms_per_step_ref": med["ref"] * 1e3,
        "cpu_ms_per_step_ours": cmed["ours"] * 1e3, "cpu_ms_per_step_ref": cmed["ref"] * 1e3,
        "params_ours": sum(p.numel() for p in model.parameters()),
        "params_ref": sum(p.numel() for p in ref.parameters()),
    }
    if args.compiled:
        out.update(tokens_per_s_ours_compiled=tok / med["ours_compiled"],
                   ratio_compiled=med["ref"] / med["ours_compiled"],
                   ratio_cpu_time_compiled=cmed["ref"] / cmed["ours_compiled"],
                   ms_per_step_ours_compiled=med["ours_compiled"] * 1e3,
                   optimizer_compile_s=compiled_fn.compile_seconds)
    if args.e2e:
        with tempfile.TemporaryDirectory() as d:
            steps = args.rounds * args.steps
            res = train(cfg, run_dir=d, progress=False,
                        overrides=[f"train.max_steps={steps}", f"train.eval_every={steps}", "train.eval_iters=1",
                                   f"train.log_every={steps}"])
            out["tokens_per_s_trainer_e2e"] = res["final"]["tokens_per_s"]
    print(json.dumps(out))
    if args.markdown:
        on_cpu = dev.type == "cpu"
        rows = [[args.preset, "eager", f"{out['tokens_per_s_ours']:.0f}", f"{out['tokens_per_s_ref']:.0f}",
                 f"**{out['ratio']:.3f}**", f"{out['ratio_cpu_time']:.3f}" if on_cpu else "—", "≥ 1.0"]]
        if args.compiled:
            rows.append([args.preset, "compile_step", f"{out['tokens_per_s_ours_compiled']:.0f}",
                         f"{out['tokens_per_s_ref']:.0f}", f"**{out['ratio_compiled']:.3f}**",
                         f"{out['ratio_cpu_time_compiled']:.3f}" if on_cpu else "—", "≥ 1.0"])
        shape = ", ".join(f"{k} {v}" for k, v in P.items())
        table = (f"tokens/s of our training step ÷ a plain nanoGPT loop ({shape}), median of {args.rounds} rounds",
                 ["preset", "our optimizer step", "ours tok/s", "nanoGPT tok/s", "ratio", "ratio (process CPU time)",
                  "target"], rows)
        print(write_markdown(args.markdown, "train_throughput", out["hardware"],
                             bench_command("train_throughput", argv), [table]))
    return out


if __name__ == "__main__":
    main()

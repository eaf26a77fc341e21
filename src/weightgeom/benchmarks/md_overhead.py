"""Magnitude–direction overhead: time of one ``MagnitudeDirection(base).step()`` over the bare ``base.step()``.

Shapes are GPT-2 small's block matrices (PyTorch (out, in) layout), per layer: attn.c_attn (2304, 768),
attn.c_proj (768, 768), mlp.c_fc (3072, 768), mlp.c_proj (768, 3072) — the matrices MD decouples. Embeddings and
1-D params are not decoupled and would only dilute the ratio, so they are left out. The ratio does not depend on the
number of layers (every cost is per matrix), so the CPU default is 1 layer; pass ``--layers 12`` on a GPU.

Both optimizers see the same fixed random gradients; steps of the two are interleaved (base, MD, base, ...) so that
machine load drifts hit both equally, and the median per-step time is reported.

Rows: each AdamW implementation of torch (``default`` — what ``torch.optim.AdamW(params)`` runs, the for-loop on CPU
and foreach on CUDA —, ``foreach``, ``fused``) with MD on its fused CPU path (``md=fused``: one C kernel per matrix,
``weightgeom.optim.md_fused``) and on its eager path (``md=eager``: the base step plus MD's torch ops); and Muon at
MD's default, where Muon's own step runs unfused and MD's passes around it run in C on the CPU (path ``eager-C``:
``kernels.md_split``/``md_finish``; ``--muon-md-path eager`` times the all-torch passes instead). On CUDA the C
passes do not apply (MD runs eagerly there).

``--compiled`` adds a column: MD (``on_nonfinite="skip"``) stepped through ``weightgeom.optim.compile_step`` (one
``torch.compile(fullgraph=True)`` graph per step, the base's step inside it; CUDA graphs on CUDA), compiled before
the timing, timed in the same interleaved loop and divided by the same eager base step.

Usage::

    python -m weightgeom.benchmarks.md_overhead  # all rows, 1 layer, CPU
    python -m weightgeom.benchmarks.md_overhead --quick  # the same rows, 3 timed steps each
    python -m weightgeom.benchmarks.md_overhead --base adamw --adamw-impl default --md-path fused
    python -m weightgeom.benchmarks.md_overhead --device cuda --layers 12 --iters 50 --json md_overhead.json
    python -m weightgeom.benchmarks.md_overhead --quick --compiled --adamw-impl foreach --md-path fused
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time

import torch

from weightgeom._cli_args import OneLineParser
from weightgeom._files import distinct_outputs, write_atomic
from weightgeom.benchmarks._common import bench_command, hardware_tag, steady_allocator, write_markdown
from weightgeom.optim.compiled import WARM_CALLS, compile_step
from weightgeom.optim.magnitude_direction import MagnitudeDirection
from weightgeom.optim.muon import Muon

GPT2_SMALL = {"attn.c_attn": (2304, 768), "attn.c_proj": (768, 768), "mlp.c_fc": (3072, 768),
              "mlp.c_proj": (768, 3072)}
TARGET_RATIO = 1.10


def make_params(layers: int, device: str, dtype: torch.dtype, seed: int = 0) -> tuple[list, list[str]]:
    """GPT-2-small block matrices (std 0.02 init) with fixed random gradients."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    params, names = [], []
    for i in range(layers):
        for name, shape in GPT2_SMALL.items():
            p = torch.nn.Parameter((0.02 * torch.randn(shape, generator=g)).to(device=device, dtype=dtype))
            p.grad = (1e-3 * torch.randn(shape, generator=g)).to(device=device, dtype=dtype)
            params.append(p)
            names.append(f"transformer.h.{i}.{name}.weight")
    return params, names


def make_base(kind: str, params: list, names: list[str], adamw_impl: str = "default",
              **muon_kw: object) -> torch.optim.Optimizer:
    """The bare base optimizer over ``params`` (named groups); ``adamw_impl``: default | foreach | fused;
    ``muon_kw``: further Muon arguments (``on_nonfinite="skip"`` for a compiled step)."""
    if kind == "adamw":
        impl = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[adamw_impl]
        return torch.optim.AdamW([{"params": params, "names": names}], lr=1e-4, weight_decay=0.0, **impl)
    if kind == "muon":
        return Muon([{"params": params, "names": names}], lr=0.02, **muon_kw)
    raise ValueError(f"unknown base {kind!r}")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(kind: str, layers: int, iters: int, warmup: int, device: str, dtype: torch.dtype,
            md_kw: dict | None = None, adamw_impl: str = "default", md_path: str = "fused",
            compiled: bool = False) -> dict:
    """Median seconds per step of the bare base and of MD around an identical base; their ratio.

    ``md_path``: ``"fused"`` (MD's default, ``fused=None``: the fused kernel, or the C passes around another base,
    wherever they apply) or ``"eager"`` (``fused=False``). ``compiled``: also MD with ``on_nonfinite="skip"`` (over
    a Muon base with the same) through ``compile_step``, compiled before the timing (``compiled_ms``,
    ``compiled_ratio``: over the same eager base step; ``compile_s``: its one-off cost).
    """
    p_base, names = make_params(layers, device, dtype)
    p_md, _ = make_params(layers, device, dtype)
    base = make_base(kind, p_base, names, adamw_impl)
    md = MagnitudeDirection(make_base(kind, p_md, names, adamw_impl), fused=None if md_path == "fused" else False,
                            **(md_kw or {}))
    timed: list[tuple[object, list[float]]] = [(base.step, []), (md.step, [])]
    step_c = None
    if compiled:
        p_c, _ = make_params(layers, device, dtype)
        base_c = make_base(kind, p_c, names, adamw_impl, on_nonfinite="skip")
        step_c = compile_step(MagnitudeDirection(base_c, on_nonfinite="skip", **(md_kw or {})))
        for _ in range(WARM_CALLS):  # the eager first step and the two compiling calls, before the timing
            step_c()
        timed.append((step_c, []))
    for it in range(warmup + iters):
        for step, sink in timed:
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            if it >= warmup:
                sink.append(time.perf_counter() - t0)
    b, m = statistics.median(timed[0][1]), statistics.median(timed[1][1])
    paths = sorted({path.split(" (")[0] for path in md._path.values()})
    out = {"base": kind, "md_path": "+".join(paths),
           "layers": layers, "matrices": len(p_base), "params": sum(p.numel() for p in p_base),
           "device": device, "dtype": str(dtype).replace("torch.", ""), "iters": iters, "md": md_kw or {},
           "adamw_impl": adamw_impl if kind == "adamw" else None,
           "base_ms": 1e3 * b, "md_ms": 1e3 * m, "ratio": m / b, "target": TARGET_RATIO}
    if step_c is not None:
        c = statistics.median(timed[2][1])
        out.update(compiled_ms=1e3 * c, compiled_ratio=c / b, compile_s=step_c.compile_seconds)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="adamw,muon", help="comma list of base optimizers (adamw, muon)")
    ap.add_argument("--layers", type=int, default=None, help="GPT-2-small blocks (default 1 on CPU, 12 on CUDA)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (default 10 on CPU, 50 on CUDA)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--gains", default="row+col")
    ap.add_argument("--adamw-impl", default="default,foreach,fused",
                    help="comma list of torch.optim.AdamW implementations of the base (default, foreach, fused)")
    ap.add_argument("--md-path", default="fused,eager",
                    help="comma list of MD paths for AdamW: fused (MD's default) and/or eager (fused=False)")
    ap.add_argument("--muon-md-path", default="default", choices=["default", "eager"],
                    help="MD around Muon: its default (C passes on the CPU) or eager (fused=False: torch ops only)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--quick", action="store_true",
                    help="3 timed steps after 1 warm-up per row (about a minute on a 2-core CPU)")
    ap.add_argument("--compiled", action="store_true",
                    help="add MD stepped through weightgeom.optim.compile_step (torch.compile, fullgraph; compiled "
                         "before the timing, which takes minutes on a CPU)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--markdown", default=None, metavar="FILE",
                    help="put the results table into FILE as markdown (replacing this benchmark's block for this "
                         "device kind, e.g. in docs/benchmarks.md)")
    args = ap.parse_args(argv)
    try:  # two output flags naming one file: one would be written over the other
        distinct_outputs([("--json", args.json), ("--markdown", args.markdown)])
    except ValueError as e:
        ap.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    layers = args.layers or (12 if cuda else 1)
    iters = args.iters or (3 if args.quick else 50 if cuda else 10)
    if args.quick:
        args.warmup = min(args.warmup, 1)
    if iters < 1 or layers < 1 or args.warmup < 0:
        ap.error("--iters and --layers must be ≥ 1, --warmup ≥ 0")
    dtype = getattr(torch, args.dtype)
    impls = [k.strip() for k in args.adamw_impl.split(",") if k.strip()]
    md_paths = [k.strip() for k in args.md_path.split(",") if k.strip()]
    for value, allowed, what in ((impls, ("default", "foreach", "fused"), "--adamw-impl"),
                                 (md_paths, ("fused", "eager"), "--md-path")):
        bad = [v for v in value if v not in allowed]
        if bad:
            ap.error(f"{what}: unknown {bad}; choose from {list(allowed)}")
    rows = []
    for kind in [k.strip() for k in args.base.split(",") if k.strip()]:
        if kind == "adamw":
            rows += [(kind, impl, path) for impl in impls for path in md_paths]
        else:
            rows.append((kind, "default", "fused" if args.muon_md_path == "default" else "eager"))
    steady_allocator()  # steady timings: see its docstring
    tag = hardware_tag(args.device)
    print(f"hardware: {tag}; {layers} layer(s), median of {iters} steps after {args.warmup} warm-up")
    comp_head = f" {'compiled ms':>11s} {'ratio':>7s}" if args.compiled else ""
    print(f"{'base':16s} {'MD path':8s} {'matrices':>8s} {'params':>8s} {'base ms':>9s} {'MD ms':>9s} {'ratio':>7s}"
          f"{comp_head}")
    results = []
    for kind, impl, path in rows:
        r = measure(kind, layers, iters, args.warmup, args.device, dtype, {"gains": args.gains}, impl, path,
                    compiled=args.compiled)
        results.append(r)
        flag = "ok" if r["ratio"] <= TARGET_RATIO else f"above target {TARGET_RATIO}"
        label = f"{kind}({impl})" if kind == "adamw" else kind
        comp = f" {r['compiled_ms']:11.2f} {r['compiled_ratio']:7.3f}" if args.compiled else ""
        print(f"{label:16s} {r['md_path']:8s} {r['matrices']:8d} {r['params'] / 1e6:7.1f}M {r['base_ms']:9.2f} "
              f"{r['md_ms']:9.2f} {r['ratio']:7.3f}{comp}  {flag}", flush=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
            "machine": platform.machine(), "hardware": tag,
            "gpu": torch.cuda.get_device_name() if cuda else None}
    if args.json:
        write_atomic(args.json, json.dumps({"meta": meta, "results": results}, indent=2))
    if args.markdown:
        rows_md = [[f"{r['base']}({r['adamw_impl']})" if r["base"] == "adamw" else r["base"], r["md_path"],
                    r["matrices"],
                    f"{r['params'] / 1e6:.1f}M", f"{r['base_ms']:.2f}", f"{r['md_ms']:.2f}", f"**{r['ratio']:.3f}**",
                    *([f"{r['compiled_ms']:.2f}", f"**{r['compiled_ratio']:.3f}**"] if args.compiled else []),
                    f"≤ {TARGET_RATIO}"] for r in results]
        head = ["base", "MD path", "matrices", "params", "base ms", "MD ms", "ratio",
                *(["compiled MD ms", "compiled ratio"] if args.compiled else []), "target"]
        print(write_markdown(args.markdown, "md_overhead", tag, bench_command("md_overhead", argv), [
            (f"MagnitudeDirection(base).step() ÷ base.step(), {layers} GPT-2-small layer(s), median of {iters} steps",
             head, rows_md)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One prepared GPU check of weightgeom: CUDA tests, bf16 msign accuracy, Muon vs torch.optim.Muon, manifold Muon,
MD overhead and tokens/s of the 124M config, in ≤ 5 minutes on one GPU.

Sections (each runs as its own subprocess of this Python; its wall time and exit code are printed, a failure does not
stop the others; the log is also written to ``--log``):

1. machine: Python, torch, CUDA, GPU name and memory, CPU kind;
2. the CUDA-marked tests (``pytest -m cuda``; with ``--tests DIR``, a source checkout's ``tests/`` folder);
3. msign accuracy and speed: Polar Express in bf16 and fp32 and torch.optim.Muon's quintic in bf16 on GPT-2 shapes and
   a 4096² matrix, max |σ/σ_max − 1| of the direction and ms per call;
4. ``weightgeom bench optimizer_step``: our Muon vs torch.optim.Muon, manifold Muon (Stiefel, DGram), AdamW, on one
   GPT-2-small layer and (on CUDA) on all 12, where same-shape matrices are batched; on CUDA with ``--compiled``,
   eager and compiled steps (``weightgeom.optim.compile_step``: one graph, CUDA graphs) side by side;
5. ``weightgeom bench md_overhead``: the MD wrapper's overhead over AdamW and Muon (on CUDA also compiled);
6. ``weightgeom bench train_throughput --preset gpt2``: tokens/s of the 124M GPT-2 config (ours vs a plain loop; on
   CUDA also with the optimizer step compiled);
7. where a manifold step's time goes (``torch.profiler``, 3 steps of Stiefel and DGram on 12 GPT-2-small layers; one
   layer with ``--device cpu``): wall ms per step, GPU busy ms, kernel launches and host synchronisations per step,
   and the kernels that take the most GPU time — so a launch-bound step (GPU busy ≪ wall) tells itself from an
   arithmetic-bound one.

Usage::

    weightgeom bench gpu_check --tests tests      # on a machine with a CUDA device, from a source checkout
    weightgeom bench gpu_check --tests tests --markdown docs/benchmarks.md   # and regenerate that GPU's tables
    weightgeom bench gpu_check --device cpu       # smoke run of the same path on a CPU (quick settings)

Exit code: 0 when every section passed, 1 when one failed, 2 without a CUDA device (unless ``--device cpu``).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from weightgeom._cli_args import OneLineParser
from weightgeom._files import distinct_outputs, open_append, write_atomic

_MACHINE = r"""
import platform, torch
from weightgeom.benchmarks._common import hardware_tag
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print(hardware_tag(dev))
if dev.type == "cuda":
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}: {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, "
          f"bf16 {torch.cuda.is_bf16_supported()}")
"""

_MSIGN = r"""
import sys, time, torch
from weightgeom.linalg import msign
dev = torch.device(sys.argv[1])
g = torch.Generator().manual_seed(0)

def err(O):
    s = torch.linalg.svdvals(O.double())
    return float((s / s.max() - 1).abs().max())

def ms_per_call(f, reps):
    f()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3

rows = [("polar_express", torch.bfloat16), ("polar_express", torch.float32), ("muon", torch.bfloat16)]
shapes = [(768, 768), (768, 3072), (4096, 4096)]
if dev.type == "cpu":  # smoke run: bf16 is emulated on most CPUs (a minute per call)
    rows, shapes = rows[1:2], shapes[:1]
print(f"{'shape':>12} {'method':>14} {'dtype':>9} {'max|σ/σmax−1|':>14} {'ms/call':>9}")
for shape in shapes:
    # momentum-like input: singular values spread over three decades
    U, _ = torch.linalg.qr(torch.randn(shape[0], min(shape), generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(shape[1], min(shape), generator=g, dtype=torch.float64))
    s = torch.logspace(0, -3, min(shape), dtype=torch.float64)
    G = ((U * s) @ V.T).float().to(dev)
    for method, dtype in rows:
        O = msign(G, method=method, dtype=dtype)
        ms = ms_per_call(lambda: msign(G, method=method, dtype=dtype), 20 if dev.type == "cuda" else 1)
        print(f"{str(shape):>12} {method:>14} {str(dtype)[6:]:>9} {err(O):14.3g} {ms:9.2f}")
"""


_PROFILE = r"""
import sys, time, warnings, torch
from torch.profiler import ProfilerActivity, profile
from weightgeom.benchmarks._common import GPT2_SMALL_SHAPES
from weightgeom.benchmarks.optimizer_step import build
warnings.filterwarnings("ignore")
dev, layers = torch.device(sys.argv[1]), int(sys.argv[2])
cuda = dev.type == "cuda"
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync")

def sync():
    if cuda:
        torch.cuda.synchronize()

def device_ms(e):
    return (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0) / 1e3

for manifold in ("muon", "stiefel", "dgram"):
    torch.manual_seed(0)
    names = [f"h{i}.{n}" for i in range(layers) for n in GPT2_SMALL_SHAPES]
    params = [torch.nn.Parameter(torch.randn(*s, device=dev) / s[1] ** 0.5)
              for _ in range(layers) for s in GPT2_SMALL_SHAPES.values()]
    opt = build("ours", {} if manifold == "muon" else {"manifold": manifold}, params, names)

    def step():
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()

    for _ in range(3):
        step()
    sync()
    n = 3
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        wall = (time.perf_counter() - t) / n * 1e3
    ev = prof.key_averages()
    launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    syncs = sum(e.count for e in ev if e.key in SYNCS)
    busy = sum(device_ms(e) for e in ev) / n
    print(f"{manifold:8s} {layers} layer(s) on {dev}: {wall:.1f} ms/step wall (with the randn gradients), "
          f"GPU busy {busy:.1f} ms, {launches / n:.0f} kernel launches, {syncs / n:.0f} syncs/copies per step")
    key = (lambda e: device_ms(e)) if cuda else (lambda e: e.self_cpu_time_total)
    for e in sorted(ev, key=key, reverse=True)[:10]:
        ms = device_ms(e) / n if cuda else e.self_cpu_time_total / 1e3 / n
        print(f"    {e.key[:70]:70s} x{e.count / n:6.1f}  {ms:7.2f} ms/step")
"""


def _sections(device: str, iters: int, source_tests: Path | None,
              markdown: str | None = None) -> list[tuple[str, list[str]]]:
    py = sys.executable
    quick = ["--quick"] if device == "cpu" else []
    md = ["--markdown", markdown] if markdown else []  # the one-layer optimizer step, MD overhead, throughput
    out: list[tuple[str, list[str]]] = [("machine", [py, "-c", _MACHINE])]
    if device == "cuda" and source_tests is not None:
        out.append(("CUDA tests", [py, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                                   "--continue-on-collection-errors",
                                   str(source_tests)]))
    out.append((f"msign accuracy and speed ({device})", [py, "-c", _MSIGN, device]))
    bench = [py, "-m", "weightgeom.cli", "bench"]
    out.append((f"optimizer step: Muon vs torch.optim.Muon, manifold Muon ({device})",
                [*bench, "optimizer_step", "--device", device, *quick, *([] if quick else ["--iters", str(iters)]),
                 *(["--compiled"] if device == "cuda" else []), *md]))
    if device == "cuda":  # the whole 12-layer model: same-shape matrices batched (manifold groups too, on a GPU)
        out.append(("optimizer step, 12 layers (cuda)",
                    [*bench, "optimizer_step", "--device", "cuda", "--layers", "12", "--iters", str(iters),
                     "--only", "default,torch.optim.Muon", "--compiled"]))  # eager and compiled side by side
    out.append((f"MD overhead ({device})", [*bench, "md_overhead", "--device", device, *quick,
                                             *(["--compiled"] if device == "cuda" else []), *md]))
    if device == "cuda":  # eager and compiled optimizer steps side by side
        out.append(("tokens/s of the 124M config",
                    [*bench, "train_throughput", "--device", "cuda", "--preset", "gpt2", "--rounds", "5",
                     "--compiled", *md]))
    else:
        out.append(("tokens/s (CPU preset, quick)",
                    [*bench, "train_throughput", "--device", "cpu", "--quick", *md]))
    out.append((f"where a manifold step's time goes ({device})",
                [py, "-c", _PROFILE, device, "12" if device == "cuda" else "1"]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default; exit 2 without one) or cpu (a quick smoke run of the same sections)")
    ap.add_argument("--iters", type=int, default=10, help="timed steps of the optimizer benchmark on CUDA")
    ap.add_argument("--log", default="gpu_check.log", help="also write everything printed to this file")
    ap.add_argument("--section-timeout", type=float, default=240.0, metavar="S",
                    help="seconds one section may run before it is killed and counted as failed (default 240)")
    ap.add_argument("--tests", default=None, metavar="DIR",
                    help="a source checkout's tests/ folder: run its CUDA-marked tests first (default: skip them)")
    ap.add_argument("--markdown", default=None, metavar="FILE",
                    help="the one-layer optimizer step, MD overhead and throughput sections put their tables into "
                         "FILE (each replacing its own block for this device kind, e.g. docs/benchmarks.md)")
    args = ap.parse_args(argv)
    try:  # two output flags naming one file: one would be written over the other
        distinct_outputs([("--log", args.log), ("--markdown", args.markdown)])
    except ValueError as e:
        ap.error(str(e))
    tests = Path(args.tests) if args.tests else None
    if tests is not None and not (tests / "conftest.py").is_file():
        print(f"gpu_check: --tests {args.tests}: not a weightgeom tests folder (no conftest.py)", file=sys.stderr)
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); --device cpu runs a smoke "
              "version", file=sys.stderr)
        return 2
    failures = []
    write_atomic(args.log, "")  # a fresh log file (a link at its name is replaced, never written through)
    with open_append(args.log) as log:
        def say(line: str) -> None:
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()

        t_all = time.perf_counter()
        verdicts: list[str] = []  # each section's target lines, repeated at the end as the run's summary
        for name, cmd in _sections(args.device, args.iters, tests, args.markdown):
            say(f"== {name} ==")
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            watchdog = threading.Timer(args.section_timeout, proc.kill)  # a hung section must not eat the lease
            watchdog.start()
            try:
                for line in proc.stdout:
                    say(line.rstrip("\n"))
                    text = line.strip()
                    if ("(target" in text or "above target" in text or text.endswith(" ok")
                            or text.startswith(("FAILED", "ERROR", '{"preset"'))
                            or (" passed" in text and text[:1].isdigit())):
                        verdicts.append(f"[{name}] {text}")
                rc = proc.wait()
            finally:
                watchdog.cancel()
            late = time.perf_counter() - t0 >= args.section_timeout
            say(f"-- {name}: exit {rc}, {time.perf_counter() - t0:.0f} s"
                + (f" (killed after --section-timeout {args.section_timeout:g} s)" if late and rc != 0 else ""))
            if rc != 0:
                failures.append(name)
        if verdicts:
            say("== summary: targets and test results ==")
            for v in verdicts:
                say(v)
        say(f"gpu_check: {len(failures)} section(s) failed{': ' + ', '.join(failures) if failures else ''}; "
            f"{time.perf_counter() - t_all:.0f} s in all; log in {args.log}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

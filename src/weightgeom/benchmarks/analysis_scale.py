"""Streamed continuity analysis at the continuity paper's scale: an 8B-shaped Llama checkpoint in bounded memory.

Checkpoint (generated once into a cache directory, reused afterwards): HF Llama names, 32 layers, hidden 4096, MLP
14336, 32 heads / 8 KV heads (head_dim 128), vocabulary 128256, bf16, 4 safetensors shards with
``model.safetensors.index.json`` — q_proj / o_proj (4096, 4096), k_proj / v_proj (1024, 4096), gate_proj / up_proj
(14336, 4096), down_proj (4096, 14336), embeddings and LM head (128256, 4096): 8.0 G weights, 16 GB on disk. It is
written tensor by tensor (a streaming safetensors writer: memory holds one tensor). Weights are N(0, 0.02²) plus a
rank-8 component per role whose singular directions drift slowly with depth (planted cross-layer structure, so C_v,
C_u and the Gram alignments sit well above their random levels, as in trained models).

Measured in one run:
    read: a plain sequential read of the same files (16 MiB chunks, no parsing), in GB/s — the I/O floor.
    analysis: ``weightgeom analyze``'s streamed ``analyze_full`` (metrics cv, cu, gram; randomised top vectors) in a
        child process: wall time, peak RSS (the child's VmHWM), GB/s over the bytes of the role matrices read and
        over the checkpoint's size. Targets for the 8B shape: ≤ 10 min and ≤ 3 GB RSS on 2 cores.

Measured (Intel Xeon with AMX and AVX512-BF16, 2 cores, the other mostly idle, torch 2.13, one thread,
default ``gram="auto"``): 8B shape, 32 layers: analysis 252 s (7.9 s per layer), peak RSS 1.14 GB; plain read 13.2 s
(page cache). Both targets met.

Measured (AMD EPYC, AVX2, 2 cores shared with other jobs, torch 2.13, one thread; default
``gram="auto"``, i.e. the sketched Gram alignment for every projection but K and V):
    8B shape, 32 layers (16.06 GB, 13.96 GB of role matrices), at load 12–18: analysis 1291 s (40 s per layer),
    peak RSS 1.07 GB; plain read 114 s (0.14 GB/s, not served from the page cache). Per role over the 32 layers:
    Q 85 s, K 29 s, V 35 s, O 133 s, Gate 406 s, Up 309 s, Down 294 s.
    One layer pair per role, exact (``gram="exact"``) vs sketched, same files, load 11–14: 165 s vs 23 s per layer
    (the exact form's k×k products, ≈ 3.5 TFLOP per layer, ran at ≈ 25 GFLOP/s; the sketch is ≈ 0.33 TFLOP but its
    thin products run at 3–10 GFLOP/s). At the load ≈ 5 of the earlier exact measurement (150 s per layer) the same
    7× gives ≈ 21 s per layer, ≈ 11 min for 32 layers: the 10-minute goal needs a quieter machine or two free cores.
    Sketch error there: |sketch − exact| Gram alignment ≤ 2.4e-3 over the seven roles.
    Earlier, with the exact form only: ``--quick`` 14.2 s, peak RSS 0.40 GB; ``--layers 2`` 302 s, 1.22 GB.

Both passes read files the generation just wrote, so the page cache may serve them (the script cannot drop it without
root); the read figure is then a memory-bandwidth figure, and the analysis is compute bound either way.

``--quick`` uses a smaller shape (8 layers, hidden 1024, MLP 3584, 16 / 4 heads, vocabulary 32000, 2 shards, ~0.3 GB)
and says so in its output; it finishes in a few minutes on 2 cores, generation included.

Usage::

    weightgeom bench analysis_scale --quick
    weightgeom bench analysis_scale                      # 8B shape: ~16 GB of disk in the cache directory
    weightgeom bench analysis_scale --cache-dir /data/wg --threads 2

Prints a small table and one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from weightgeom._cache import cache_root
from weightgeom._cli_args import OneLineParser
from weightgeom._files import write_atomic
from weightgeom.benchmarks._common import cpu_kind, hardware_tag

RSS_TARGET_GB = 3.0
TIME_TARGET_S = 600.0


@dataclass(frozen=True)
class Shape:
    """A Llama-style checkpoint shape."""

    layers: int
    hidden: int
    mlp: int
    heads: int
    kv_heads: int
    vocab: int
    shards: int

    @property
    def tag(self) -> str:
        """Cache sub-directory name."""
        return (f"llama_L{self.layers}_d{self.hidden}_f{self.mlp}_h{self.heads}_kv{self.kv_heads}_v{self.vocab}"
                f"_s{self.shards}")

    def matrices(self) -> dict[str, tuple[int, int]]:
        """Per-layer projection shapes, (out, in)."""
        d, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        return {"self_attn.q_proj": (d, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
                "self_attn.o_proj": (d, d), "mlp.gate_proj": (self.mlp, d), "mlp.up_proj": (self.mlp, d),
                "mlp.down_proj": (d, self.mlp)}


FULL = Shape(layers=32, hidden=4096, mlp=14336, heads=32, kv_heads=8, vocab=128256, shards=4)
QUICK = Shape(layers=8, hidden=1024, mlp=3584, heads=16, kv_heads=4, vocab=32000, shards=2)
RANK = 8  # planted shared structure per role


def _tensor_plan(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """All tensors in file order: embeddings, per layer norms and projections, final norm, LM head."""
    plan: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab, shape.hidden))]
    for i in range(shape.layers):
        plan.append((f"model.layers.{i}.input_layernorm.weight", (shape.hidden,)))
        plan += [(f"model.layers.{i}.{k}.weight", s) for k, s in shape.matrices().items()]
        plan.append((f"model.layers.{i}.post_attention_layernorm.weight", (shape.hidden,)))
    plan += [("model.norm.weight", (shape.hidden,)), ("lm_head.weight", (shape.vocab, shape.hidden))]
    return plan


class _Planted:
    """Per role: orthonormal rank-8 bases (U, V) that drift a little from layer to layer, and a decaying spectrum."""

    def __init__(self, shape: Shape, g: torch.Generator):
        self.g = g
        self.state = {k: (torch.linalg.qr(torch.randn(m, RANK, generator=g))[0],
                          torch.linalg.qr(torch.randn(n, RANK, generator=g))[0])
                      for k, (m, n) in shape.matrices().items()}

    def matrix(self, key: str, m: int, n: int) -> torch.Tensor:
        U, V = self.state[key]
        U = torch.linalg.qr(U + 0.15 * torch.randn(m, RANK, generator=self.g) / m**0.5)[0]
        V = torch.linalg.qr(V + 0.15 * torch.randn(n, RANK, generator=self.g) / n**0.5)[0]
        self.state[key] = (U, V)
        s = 0.02 * (m**0.5 + n**0.5) * torch.linspace(3.0, 1.5, RANK)  # above the noise edge 0.02(√m + √n)
        W = torch.randn(m, n, generator=self.g).mul_(0.02)
        W.addmm_(U * s, V.T)
        return W.to(torch.bfloat16)


def _write_safetensors(path: Path, items: list[tuple[str, tuple[int, ...]]], make) -> None:
    """Write one safetensors file tensor by tensor (memory: one tensor): header, then each tensor's bytes."""
    header, off = {}, 0
    for name, shp in items:
        n = 1
        for d in shp:
            n *= d
        header[name] = {"dtype": "BF16", "shape": list(shp), "data_offsets": [off, off + 2 * n]}
        off += 2 * n
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)

    def chunks():
        yield len(h).to_bytes(8, "little")
        yield h
        for name, shp in items:
            t = make(name, shp).contiguous()
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == tuple(shp), name
            yield t.view(torch.int16).numpy().tobytes()

    write_atomic(path, chunks(), fsync=False)


def generate(shape: Shape, root: Path, seed: int = 0, log=print) -> Path:
    """The checkpoint of ``shape`` under ``root`` (generated unless a complete copy is there). Returns its directory."""
    d = root / shape.tag
    done = d / "complete.json"
    if done.is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    planted = _Planted(shape, g)
    plan = _tensor_plan(shape)
    sizes = [2 * torch.Size(s).numel() for _, s in plan]
    per = sum(sizes) / shape.shards
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(shape.shards)]
    acc = 0
    for (name, s), b in zip(plan, sizes):  # by the tensor's midpoint, so a large first tensor leaves no shard empty
        groups[min(int((acc + b / 2) // per), shape.shards - 1)].append((name, s))
        acc += b

    def make(name: str, s: tuple[int, ...]) -> torch.Tensor:
        if len(s) == 1:
            return torch.ones(s, dtype=torch.bfloat16)
        if "layers." not in name:
            return torch.randn(s, generator=g).mul_(0.02).to(torch.bfloat16)
        key = ".".join(name.split(".")[3:-1])
        return planted.matrix(key, *s)

    wmap = {}
    t0 = time.perf_counter()
    for i, items in enumerate(groups):
        fn = f"model-{i + 1:05d}-of-{shape.shards:05d}.safetensors"
        log(f"generating {d / fn} ({len(items)} tensors) ...")
        _write_safetensors(d / fn, items, make)
        wmap.update(dict.fromkeys((n for n, _ in items), fn))
    write_atomic(d / "model.safetensors.index.json", json.dumps({"metadata": {"total_size": sum(sizes)},
                                                                 "weight_map": wmap}, indent=1))
    write_atomic(done, json.dumps({"shape": asdict(shape), "seed": seed, "bytes": sum(sizes),
                                   "generate_s": time.perf_counter() - t0}))
    return d


def sequential_read(d: Path, chunk: int = 16 << 20) -> tuple[int, float]:
    """(bytes, seconds) of reading every shard of ``d`` front to back in ``chunk``-byte pieces."""
    buf = bytearray(chunk)
    total, t0 = 0, time.perf_counter()
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(buf)
                if not n:
                    break
                total += n
    return total, time.perf_counter() - t0


_CHILD = """
import json, sys, time, torch
threads = int(sys.argv[2])
if threads:
    torch.set_num_threads(threads)
from weightgeom.analysis import analyze_full
from weightgeom.analysis.loaders import open_lazy
from weightgeom.analysis.roles import assign_roles
t0 = time.perf_counter()
src = open_lazy(sys.argv[1])
role_bytes = sum(rw.weight.nbytes for items in assign_roles(src.tensors).values() for rw in items)
res = analyze_full(src, metrics=("cv", "cu", "gram"), method="randomized", progress=sys.argv[3] == "1",
                   gram=sys.argv[4])
wall = time.perf_counter() - t0
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
s = res.pairs.groupby("role", sort=False)[["cv", "cv_rand", "gram_in", "gram_in_rand"]].mean()
print(json.dumps({"wall_s": wall, "peak_rss_bytes": peak, "role_bytes": role_bytes, "pairs": len(res.pairs),
                  "sketched": res.meta.get("gram_sketched_roles", []),
                  "summary": s.reset_index().to_dict(orient="records")}))
"""


def main(argv: list[str] | None = None) -> int:
    """Generate (once) and analyse the checkpoint; print the table and a JSON line. Returns 0, or 1 on a failure."""
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shape (8 layers, hidden 1024, ~0.3 GB): minutes")
    ap.add_argument("--cache-dir", default=None,
                    help="where the generated checkpoint is kept (default: analysis_scale/ under weightgeom's "
                         "cache root, $WEIGHTGEOM_CACHE_DIR or ~/.cache/weightgeom)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads in the analysis (default 1: on a shared, oversubscribed 2-core machine two "
                         "OpenMP threads spin-wait on each other and small products run 15× slower; 0: torch's "
                         "default)")
    ap.add_argument("--progress", action="store_true", help="show the analysis's per-matrix progress lines")
    ap.add_argument("--gram", choices=("auto", "exact", "sketch"), default="auto",
                    help="Gram alignment mode of the analysis (default %(default)s: sketched where min(m, n) ≥ 2048, "
                         "i.e. every 8B projection but K and V; exact: the k×k products, ≈ 10× slower at 8B widths)")
    ap.add_argument("--layers", type=int, default=None,
                    help="override the layer count (e.g. 2: the 8B widths, hence the same peak memory, in a fraction "
                         "of the disk and time; the peak does not depend on the number of layers)")
    args = ap.parse_args(argv)
    shape = QUICK if args.quick else FULL
    if args.layers is not None:
        if args.layers < 1:
            ap.error(f"--layers must be ≥ 1, got {args.layers}")
        shape = Shape(**{**asdict(shape), "layers": args.layers})
    root = Path(args.cache_dir) if args.cache_dir else cache_root() / "analysis_scale"
    label = "QUICK shape (not the 8B one)" if args.quick else "8B shape"
    if args.layers is not None:
        label += f", {args.layers} layers instead of {(QUICK if args.quick else FULL).layers}"
    print(f"analysis_scale: {label}: {shape}", flush=True)
    d = generate(shape, root, log=lambda m: print(m, flush=True))
    gen = json.loads((d / "complete.json").read_text())
    nbytes, t_read = sequential_read(d)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(d), str(args.threads), "1" if args.progress else "0",
                          args.gram],
                         stdout=subprocess.PIPE, stderr=None if args.progress else subprocess.PIPE, text=True)
    if out.returncode != 0:
        print(f"analysis_scale: the analysis failed (exit {out.returncode}): {(out.stderr or '').strip()[-2000:]}",
              file=sys.stderr)
        return 1
    r = json.loads(out.stdout.strip().splitlines()[-1])
    gbs_read = nbytes / t_read / 1e9
    gbs_file = nbytes / r["wall_s"] / 1e9
    gbs_roles = r["role_bytes"] / r["wall_s"] / 1e9
    hw = hardware_tag() if not args.threads else f"CPU {cpu_kind()}, {args.threads} threads"
    print(f"checkpoint   {d}  ({nbytes / 1e9:.2f} GB, {shape.shards} shards; generated once in "
          f"{gen['generate_s']:.0f} s)")
    print(f"hardware     {hw}; {os.cpu_count()} cores")
    print(f"plain read   {t_read:8.1f} s   {gbs_read:6.2f} GB/s  (sequential, page cache may serve it)")
    print(f"analysis     {r['wall_s']:8.1f} s   {gbs_file:6.2f} GB/s of checkpoint, {gbs_roles:.2f} GB/s of role "
          f"matrices ({r['role_bytes'] / 1e9:.2f} GB), {r['wall_s'] / t_read:.1f}× the plain read")
    print(f"peak RSS     {r['peak_rss_bytes'] / 1e9:8.2f} GB  (analysis process, Python and torch included)")
    print(f"Gram         {args.gram}: sketched for {', '.join(r['sketched']) or 'no role'}")
    if not args.quick and args.layers is None:
        print(f"targets      ≤ {TIME_TARGET_S / 60:.0f} min, ≤ {RSS_TARGET_GB:.0f} GB RSS on 2 cores: "
              f"time {'met' if r['wall_s'] <= TIME_TARGET_S else 'MISSED'}, "
              f"RSS {'met' if r['peak_rss_bytes'] <= RSS_TARGET_GB * 1e9 else 'MISSED'}")
    for row in r["summary"]:
        print(f"  {row['role']:5s} cv {row['cv']:.3f} ({row['cv_rand']:.3f})  gram_in {row['gram_in']:.3f} "
              f"({row['gram_in_rand']:.3f})")
    print(json.dumps({"benchmark": "analysis_scale", "quick": args.quick, "shape": asdict(shape),
                      "bytes": nbytes, "read_s": t_read, "read_gbps": gbs_read, "analysis_s": r["wall_s"],
                      "analysis_gbps_file": gbs_file, "analysis_gbps_roles": gbs_roles,
                      "peak_rss_bytes": r["peak_rss_bytes"], "pairs": r["pairs"], "cpu_kind": cpu_kind(),
                      "gram": args.gram, "gram_sketched_roles": r["sketched"],
                      "hardware": hw}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

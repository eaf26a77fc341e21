"""A paper sweep on a SLURM (or Ray) cluster, as a dry run: what would be submitted, and the GPU-hours it asks for.

What it shows:

1. ``weightgeom.experiments.cli.execute``, the Python function behind ``weightgeom sweep``: it plans every run of an
   experiment recipe (here the manifold-assignment paper's GPT-2-small/OpenWebText sweep, ``manifolds
   gpt2-small-owt``: 7 arms × the seeds), checks every run's config, and with ``dry_run=True`` prints, without writing
   or submitting anything:

   * per run, the command the cluster job runs and its resources (GPUs, CPUs, memory, time limit);
   * the CPUs and memory it sized from the model (built on PyTorch's meta device: no memory used);
   * the paths the runs read, flagged where they do not exist on this machine (the dataset lives on the cluster);
   * the GPU-hours requested per time-limit window: runs × GPUs per run × time limit;
   * for SLURM, the sbatch script of the job array, written by submitit exactly as it would be submitted.

2. The same sweep from the shell (what this script runs, flag for flag)::

       weightgeom sweep manifolds gpt2-small-owt --set data.path=/data/openwebtext --seeds 0-2 \\
           --launcher slurm --dry-run --partition gpu --gpus-per-run 1 --time-limit 8:00:00 \\
           --slurm-opt account=myproj --slurm-setup 'module load cuda'

   Drop ``--dry-run`` on the cluster's login node to submit. ``--launcher ray --ray-address auto`` sends the same runs
   to a Ray cluster as tasks (the dry run then lists the per-task command and resources and the Ray task spec;
   it needs nothing from Ray, which only the real submission does: ``pip install 'weightgeom[ray]'``).

The GPU-hours line counts one time-limit window per run. A run that needs longer is requeued from its checkpoint
(up to 20 times, ``launchers.MAX_TIMEOUT_REQUEUES``), each requeue another window, as the line says; set
``--time-limit`` near the expected run length for the estimate to be close.

Run:
    python examples/sweep_on_cluster.py                    # the paper sweep, 3 seeds, SLURM
    python examples/sweep_on_cluster.py --launcher ray     # the same as Ray tasks (the dry run needs no Ray)
    python examples/sweep_on_cluster.py --tiny             # the CI-sized preset (what the tests run)

Time on a 2-core CPU: a few seconds at any size (nothing trains). Writes nothing: the sweep directory named in the
output (``--out``, default a temporary path) is only planned.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from weightgeom.experiments.cli import execute


def main(argv: list[str] | None = None) -> int:
    """Plan the sweep and print the dry run."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the CI-sized manifolds preset, one seed")
    p.add_argument("--launcher", choices=["slurm", "ray"], default="slurm")
    p.add_argument("--data-path", default="/data/openwebtext",
                   help="where OpenWebText's nanoGPT train.bin/val.bin are on the cluster (default /data/openwebtext)")
    p.add_argument("--seeds", default="0-2", help="seeds, e.g. 0-2 or 0,1 (default 0-2; --tiny 0)")
    p.add_argument("--out", type=Path, default=None,
                   help="sweep directory on the cluster's shared file system (default: a temporary path; the dry "
                        "run writes nothing there)")
    args = p.parse_args(argv)

    if args.tiny:
        config, seeds, sets = "ci", [0], []
    else:
        config, sets = "gpt2-small-owt", [f"data.path={args.data_path}"]
        lo, _, hi = args.seeds.partition("-")
        seeds = list(range(int(lo), int(hi) + 1)) if hi else [int(s) for s in args.seeds.split(",")]

    # What each run asks for. Keys are the command line's option names (argparse dests); the launcher uses those
    # that apply to it (partition, sbatch options and setup lines are SLURM's; ray_address is Ray's).
    if args.launcher == "slurm":
        cluster = {"gpus_per_run": 1, "time_limit": "8:00:00", "partition": "gpu",
                   "slurm_opt": ["account=myproj"], "slurm_setup": ["module load cuda"]}
    else:
        cluster = {"gpus_per_run": 1, "ray_address": "auto"}

    with tempfile.TemporaryDirectory(prefix="wg-sweep-") as tmp:
        out = args.out if args.out is not None else Path(tmp) / f"manifolds-{config}"
        print(f"planning: weightgeom sweep manifolds {config} --seeds {','.join(map(str, seeds))} "
              f"--launcher {args.launcher} --dry-run{''.join(' --set ' + s for s in sets)}\n")
        try:
            planned, _ = execute("manifolds", config, seeds=seeds, sets=sets, out=out, launcher=args.launcher,
                                 cluster=cluster, dry_run=True)
        except ValueError as e:  # e.g. the launcher's package is missing: one line naming the pip extra
            print(f"cannot plan this sweep here: {e}")
            return 2
        written = out.exists() and any(out.iterdir())  # a dry run plans the directory, it does not create it
        print(f"\n{len(planned['runs'])} runs planned; {'files were' if written else 'nothing was'} written to {out} "
              "and nothing was submitted.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

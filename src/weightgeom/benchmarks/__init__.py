"""Benchmarks that time weightgeom against a reference in one run (interleaved rounds, medians) and print the ratio.

Each module is a script with a ``main(argv)``; run one by name from any directory, also after a plain
``pip install``::

    weightgeom bench                            # list them
    weightgeom bench optimizer_step --quick     # our Muon, manifold Muon vs torch.optim.Muon; msign GFLOP/s
    python -m weightgeom.benchmarks.optimizer_step --quick        # the same

``optimizer_step`` (optimizer step times, msign GFLOP/s), ``md_overhead`` (MagnitudeDirection over its base optimizer),
``train_throughput`` (the trainer's step vs a plain nanoGPT loop), ``analysis_speed`` (continuity analysis of a
30-layer checkpoint vs full SVD). Results and targets: the README's Benchmarks section. Importing this package
imports nothing heavy (``weightgeom bench`` lists the modules without running them).
"""

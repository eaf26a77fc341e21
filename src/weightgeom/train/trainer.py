"""The training loop: one function, :func:`train`, used by the CLI, the experiments and the tests.

Per optimizer step s (1-based): the LR factor of step s−1 is applied to every group (AdamW, Muon, MD gains);
``train.grad_accum`` micro-batches (split across ranks) are forwarded and back-propagated; the mean loss is checked
for divergence *before* the update (NaN/Inf, or larger than ``diverge_factor`` × the best smoothed loss so far);
gradients are clipped to ``train.grad_clip``; the optimizer steps. Then, as due: a ``train`` metrics line, a
``diag`` line (``weightgeom.diagnostics.collect``), an evaluation (``val``), a checkpoint. Metrics are tagged with
s = number of updates done (evaluation at s = 0 is before training).

Divergence is a result, not an error: ``status.json`` becomes ``{"state": "diverged", "step": s, "reason": ...}``,
logs are flushed and kept, and :func:`train` returns normally with ``status="diverged"``.

A run directory has one writer: rank 0 holds :class:`~weightgeom.train.rundir.DirLock` on it from before the first
file is written until :func:`train` returns or raises (a second writer gets a ``LockError``; the lock of a process
killed with ``kill -9`` is stale and taken over). A run that starts from step 0 in a directory an earlier run used
(``resume=False``, or ``"auto"`` without a checkpoint) first moves the earlier run's files into
``previous/<UTC time>/`` (:func:`~weightgeom.train.rundir.archive_previous`), so checkpoints of two runs never share
``checkpoints/``.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import platform
import random
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from weightgeom import __version__
from weightgeom._device import cpu_kind
from weightgeom._files import is_regular, read_json, write_atomic
from weightgeom.diagnostics.monitors import bare_name, grad_norms
from weightgeom.diagnostics.monitors import collect as collect_diagnostics
from weightgeom.models import GPT, Llama, build_model
from weightgeom.optim import MagnitudeDirection, describe
from weightgeom.optim import compiled as compiled_optim
from weightgeom.optim.build import from_config as optimizer_from_config
from weightgeom.optim.muon import FarRetractionWarning
from weightgeom.optim.sharded import is_dtensor
from weightgeom.train import checkpoint as ckpt_mod
from weightgeom.train.auto_assign import AutoAssign
from weightgeom.train.batches import Batches, build_batches
from weightgeom.train.callbacks import CallbackList, TrainContext
from weightgeom.train.config import (
    Config,
    config_hash,
    config_to_dict,
    describe_presets,
    dump_toml,
    load_config,
    preset_report,
)
from weightgeom.train.distributed import (
    DistInfo,
    ShardedStep,
    all_reduce_mean,
    barrier,
    cleanup,
    clip_grad_norm,
    full_state_dict,
    init_distributed,
    wrap_model,
)
from weightgeom.train.logging import MetricsLogger, Progress, read_metrics, write_json_atomic
from weightgeom.train.machine_choice import choice_record, resume_choice
from weightgeom.train.qk_clip import QKClip
from weightgeom.train.restore import check_config_hash, load_model_state, load_optimizer_state
from weightgeom.train.rundir import (
    DirLock,
    LockError,
    archive_previous,
    check_run_dir_contents,
    read_status,
    remove_if_unused,
    safe_child,
)
from weightgeom.train.schedule import apply_lr, capture_base_lrs, make_lr_fn
from weightgeom.train.tracking import trackers_from_config

PARAM_GROUPS_FILE = "param_groups.txt"
"""The run directory's table of which parameter went to which optimizer and manifold (``weightgeom.optim.describe``),
rewritten at every session's start."""

__all__ = ["train", "model_from_config", "build_optimizer_from_config", "explosion"]


# ----------------------------------------------------------------------------------------------------------- builders
def _fill_model_config(cfg: Config, batches: Batches) -> None:
    """Fill data-derived model fields the config leaves out (vocab size, context length, input/output sizes)."""
    m, kind = cfg.model, cfg.model["kind"]
    if kind == "gpt":
        m.setdefault("vocab_size", batches.vocab_size)
        m.setdefault("block_size", cfg.data.block_size)
    elif kind == "llama":
        m.setdefault("vocab_size", batches.vocab_size)
        m.setdefault("max_seq_len", cfg.data.block_size)
    elif kind == "resmlp":
        m.setdefault("in_dim", batches.input_dim)
        m.setdefault("out_dim", batches.vocab_size)
    if batches.kind == "lm" and kind == "resmlp":
        raise ValueError("config: model.kind='resmlp' needs a classification dataset (data.kind='mnist')")
    if batches.kind == "cls" and kind in ("gpt", "llama"):
        raise ValueError(f"config: model.kind={kind!r} needs a token dataset, not data.kind={cfg.data.kind!r}")


def model_from_config(model_cfg: dict[str, Any]) -> nn.Module:
    """A model from a ``[model]`` section (``kind`` + the model config's fields).

    Raises:
        ValueError: unknown kind or bad field (from the model config's ``from_dict``).
    """
    mc = dict(model_cfg)
    kind = mc.pop("kind")
    preset = mc.pop("preset", "") or None
    return build_model(kind, preset=preset, **mc)


def build_optimizer_from_config(model: nn.Module, cfg: Config, verbose: bool = False) -> torch.optim.Optimizer:
    """The optimizer ``cfg.optim`` describes (:func:`weightgeom.optim.build.from_config`)."""
    return optimizer_from_config(model, cfg.optim, verbose=verbose)


# ------------------------------------------------------------------------------------------------------------ helpers
def _check_model_vocab(model: nn.Module, batches: Batches) -> None:
    """Refuse a language model whose vocabulary (``model.vocab_size``; the data's own when left unset) is smaller
    than the data's: token ids at or above it would fail deep inside an embedding lookup mid-run.

    Raises:
        ValueError: one line naming ``model.vocab_size``, both sizes and where the data's comes from.
    """
    if batches.kind != "lm" or not isinstance(model, (GPT, Llama)):  # ResMLP has no vocabulary
        return
    vocab = model.config.vocab_size
    if vocab >= batches.vocab_size:
        return
    source = f", {batches.vocab_source}" if batches.vocab_source else ""
    raise ValueError(f"config key model.vocab_size={vocab}: smaller than the data's vocabulary "
                     f"({batches.vocab_size}{source}); raise it or leave it unset")


def explosion(loss: float, ema: float, ema_n: int, best: float, factor: float, warmup: int,
              smoothing: float) -> str | None:
    """Why ``loss`` counts as a loss explosion, or None.

    The test is on the smoothed loss *including* this step (debiased EMA): it must exceed ``factor`` × the best
    smoothed loss so far, after ``warmup`` steps. Smoothing keeps one noisy minibatch from tripping it when the loss
    is small (a classifier at loss 0.03 routinely sees single batches at 0.15), while a real blow-up (×10⁶ in one
    step, or a sustained rise) still trips it within a step or a few.

    Args:
        loss: this step's mean train loss (finite).
        ema, ema_n: the undebiased EMA and its count before this step.
        best: best debiased smoothed loss so far.
        factor: ``train.diverge_factor`` (0 disables the test).
        warmup: ``train.diverge_warmup`` (steps before the test starts).
        smoothing: ``train.smoothing`` (EMA factor).
    """
    if factor <= 0 or ema_n < warmup or not math.isfinite(best):
        return None
    smoothed = (smoothing * ema + (1 - smoothing) * loss) / (1 - smoothing ** (ema_n + 1))
    if smoothed > factor * best:
        return (f"smoothed loss {smoothed:.4g} (this step {loss:.4g}) > {factor:g} x best smoothed loss "
                f"{best:.4g}")
    return None


def _git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except Exception:
        return None


def device_kind(device: torch.device) -> str:
    """The kind of device a run trained on, as every figure names it: the GPU's name, or ``"CPU AMX, 2 cores"``
    (the CPU's matrix-unit class, which sets bf16 speed, and its core count)."""
    if device.type == "cuda":
        return f"GPU {torch.cuda.get_device_name(device)}"

    return f"CPU {cpu_kind()}, {os.cpu_count()} cores"


def _versions() -> dict[str, str]:
    v = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
         "weightgeom": __version__}
    if torch.cuda.is_available():
        v["cuda"] = str(torch.version.cuda)
    return v


KEEP_ON_FRESH = ("experiment.json",)
"""Files a fresh start leaves in the run directory: a sweep's description of the run, written just before training."""

@contextlib.contextmanager
def _io_path(path: str | os.PathLike):
    """Attach ``path`` to an ``OSError`` raised inside that names no file (e.g. a failed ``write``: disk full), so
    the one-line error the CLI prints says where the write failed."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise


def nonfinite_grads(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the parameters whose gradient holds a NaN or Inf (this rank's shard under FSDP2), in model order."""
    bad = []
    for name, p in named:
        g = p.grad
        if g is None:
            continue
        loc = g.to_local() if is_dtensor(g) else g
        if not bool(torch.isfinite(loc).all()):
            bad.append(name)
    return bad


# -------------------------------------------------------------------------------------------------------------- train
def train(config: str | os.PathLike | dict[str, Any], run_dir: str | os.PathLike | None = None,
          overrides=(), progress: bool = True, resume: bool | str = "auto",
          callbacks: Iterable[Any] | None = None) -> dict[str, Any]:
    """Train a model from a config.

    Args:
        config: path to a TOML/YAML file, a bundled config name, or a (partial) config dict.
        run_dir: the run directory (default ``run.out_dir/run.name``).
        overrides: ``section.key=value`` strings applied on top of ``config``.
        progress: show a tqdm bar (rank 0).
        resume: ``"auto"`` — continue from the newest checkpoint in ``run_dir`` if there is one; ``True`` — require
            one; ``False`` — start fresh. Starting from step 0 in a directory an earlier run used moves that run's
            files into ``run_dir/previous/<UTC time>/`` (never deleted; ``experiment.json`` stays).
        callbacks: :class:`weightgeom.train.callbacks.Callback` objects, called in this order at fixed points of the
            loop (when, and what they see: :mod:`weightgeom.train.callbacks`); their state is kept in checkpoints.

    Returns:
        ``{"status": "done" | "diverged", "run_dir": str, "step": int, "final": {metric: value}}``; a run that was
        already finished (its newest checkpoint is at ``train.max_steps``) is not trained again: the result reports
        its final numbers and has ``"already_done": True``.

    Raises:
        ValueError: bad config (one line naming the key, e.g. a ``run.name`` that leaves ``run.out_dir``, or a
            ``[logging]`` tracker whose package is not installed);
            CheckpointError (a ValueError) for an unusable checkpoint; LockError (a ValueError) when another live
            process writes ``run_dir``.
        OSError: the run directory cannot be written (not a directory, no permission, disk full); ``filename``
            names the path. Files written before stay as they were (checkpoints are replaced atomically).
        CallbackError: a callback raised (the message names it, the hook and the step; status.json: failed).
    """
    import torch.distributed as dist

    cfg = load_config(config, overrides)
    callbacks = [*CallbackList(callbacks), *trackers_from_config(cfg.logging)]  # [logging] wandb / mlflow
    if cfg.optim.strategy == "auto" and not any(isinstance(c, AutoAssign) for c in callbacks):
        callbacks.append(AutoAssign())  # strategy "auto" means the rule runs (default settings unless one is given)
    if cfg.qk_clip.enabled and not any(isinstance(c, QKClip) for c in callbacks):
        callbacks.append(cfg.qk_clip.build())  # [qk_clip] enabled: the clip runs (a QKClip given here takes its place)
    preexisting = dist.is_available() and dist.is_initialized()
    info = init_distributed(cfg.run.device)
    try:
        with warnings.catch_warnings():  # the trainer's models start from a random init: retracting them is expected
            warnings.simplefilter("ignore", FarRetractionWarning)
            return _Trainer(cfg, info, run_dir, progress, resume, CallbackList(callbacks)).run()
    finally:
        if info.enabled and not preexisting:
            cleanup(info)


class _Trainer:
    def __init__(self, cfg: Config, info: DistInfo, run_dir, progress: bool, resume,
                 callbacks: CallbackList | None = None):
        self.cfg, self.info = cfg, info
        self.callbacks = callbacks if callbacks is not None else CallbackList()
        if run_dir is None:
            run_dir = safe_child(cfg.run.out_dir, cfg.run.name, "run.name")
        self.run_dir = Path(run_dir)
        self.progress_on = progress and info.is_main
        self.resume = resume
        self.lock: DirLock | None = None
        self._scope = contextlib.ExitStack()  # what the session holds until it ends (a resumed run's msign choice)
        self._created_dir = False  # this run created run_dir (removed again if it fails before writing a file)

    # -- setup ---------------------------------------------------------------------------------------------------
    def _setup(self) -> None:
        cfg, info = self.cfg, self.info
        seed = cfg.run.seed
        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.manual_seed(seed)
        self.batches = build_batches(cfg)
        _fill_model_config(cfg, self.batches)
        self.presets = preset_report(cfg)
        self.hash = config_hash(cfg)
        tr = cfg.train
        tr.check_processes(info.world_size)
        self.accum_local = tr.grad_accum // info.world_size

        # checkpoint to resume from (and, on ranks > 0 of a sharded run, this rank's own optimizer shard)
        self.payload = None
        self.shard_payload: dict[str, Any] | None = None
        ckdir = self.run_dir / "checkpoints"
        if self.resume:
            latest = ckpt_mod.latest_checkpoint(ckdir)
            if latest is None and self.resume is True:
                raise ValueError(f"resume: no checkpoint in {ckdir}")
            if latest is not None:
                self.payload = ckpt_mod.load_checkpoint(latest)
                check_config_hash(self.payload, latest, self.hash, cfg)
                if self.payload.get("world_size", 1) != info.world_size:
                    raise ckpt_mod.CheckpointError(
                        f"checkpoint {latest}: written by {self.payload.get('world_size')} processes, resuming with "
                        f"{info.world_size}; resume with the same number of processes")
                if info.rank > 0 and self.payload.get("sharded"):
                    shard = ckdir / ckpt_mod.checkpoint_name(self.payload["step"], info.rank)
                    self.shard_payload = ckpt_mod.load_checkpoint(shard)
                    check_config_hash(self.shard_payload, shard, self.hash, cfg)
                self.ckpt_path = latest
        self.device = info.device
        self.meta = self._resume_meta()

        # model (identical init on every rank: same seed), then the optimizer on the unwrapped parameters
        self.model = model_from_config(cfg.model).to(self.device)
        _check_model_vocab(self.model, self.batches)
        if self.payload is not None:
            load_model_state(self.model, self.payload["model"], self.ckpt_path)
        if info.rank > 0:
            torch.manual_seed(seed + 1000003 * info.rank)  # different dropout masks per rank
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        opt = build_optimizer_from_config(self.model, cfg)  # quiet: the table goes to the run directory
        capture_base_lrs(opt)
        self.optimizer = opt
        self.choice = choice_record(opt, self.device)  # what the optimizer took from the per-device choice
        parallel = cfg.run.parallel
        self.fsdp = info.enabled and parallel == "fsdp"
        if info.enabled and isinstance(opt, MagnitudeDirection):
            if self.fsdp:
                raise ValueError(f"config: optim.name={cfg.optim.name!r} (magnitude–direction wrapper) is not "
                                 "supported with run.parallel='fsdp'; use run.parallel='ddp'")
            self.wrapped = wrap_model(self.model, info, parallel)
            self.stepper = opt  # replicated step: every rank computes the same update
            self.sharded = False
        elif info.enabled:
            self.wrapped = wrap_model(self.model, info, parallel)
            sharded_params = dict(self.model.named_parameters()) if self.fsdp else None
            self.stepper = ShardedStep(opt, named, info, sharded_params)
            self.sharded = True
        else:
            self.wrapped = self.model
            self.stepper = opt
            self.sharded = False
        if cfg.run.compile:
            self.wrapped = torch.compile(self.wrapped)
        # train.compile_optimizer: the optimizer step through torch.compile (not the sharded step's gather/scatter)
        self.step_fn = self.stepper.step
        if not self.sharded and compiled_optim.wanted(tr.compile_optimizer, self.device):
            self.step_fn = compiled_optim.compile_step(self.stepper)
        self._compile_logged = False
        self.clip_params = [p for p in self.model.parameters() if p.requires_grad]
        self.lr_fn = make_lr_fn(cfg.schedule, tr.max_steps)

        # trainer state
        self.step = 0
        self.ema, self.ema_n, self.best = 0.0, 0, math.inf
        self.tokens, self.train_time = 0, 0.0
        self.last_val: dict[str, float] = {}
        if self.payload is not None:
            own = self.shard_payload or self.payload
            load_optimizer_state(self.stepper, own["optimizer"], self.model, self.ckpt_path)
            ckpt_mod.set_rng_state(own["rng"])
            st = self.payload["trainer"]
            self.step = self.payload["step"]
            self.ema, self.ema_n, self.best = st["ema"], st["ema_n"], st["best"]
            self.tokens, self.train_time = st["tokens"], st["train_time"]
            self.last_val = st.get("last_val", {})

        dt = cfg.run.dtype
        if dt != "float32":
            self.amp = lambda: torch.autocast(self.device.type, dtype=getattr(torch, dt))
        else:
            self.amp = contextlib.nullcontext

    @contextlib.contextmanager
    def _quiet_compile(self):
        """While a compiled optimizer step (``train.compile_optimizer``) traces — its first
        :data:`~weightgeom.optim.compiled.WARM_CALLS` calls — dynamo's warnings about the graph breaks the step makes
        by design are not printed: the ``on_nonfinite="raise"`` check is a host read, and torch's optimizers wrap
        ``step`` in a profiler hook; on the CPU that was 29 lines of ``W…`` noise per run. Errors still print; the
        compile's cost is logged (split ``compile``)."""
        self._traced_calls = getattr(self, "_traced_calls", 0) + 1
        if not isinstance(self.step_fn, compiled_optim.CompiledStep) or self._traced_calls > compiled_optim.WARM_CALLS:
            yield
            return
        import logging

        log = logging.getLogger("torch._dynamo")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            yield
        finally:
            log.setLevel(level)

    def _resume_meta(self) -> dict[str, Any]:
        """A resumed run's ``meta.json`` (``{}`` for a fresh start or where there is none); its recorded msign and
        constraint-products choice is this process's for the rest of the session (:func:`resume_choice`).

        Raises:
            ValueError: an unreadable ``meta.json``, or an environment forcing another choice than the recorded one.
        """
        path = self.run_dir / "meta.json"
        if self.payload is None or not is_regular(path, "run metadata"):
            return {}
        meta = read_json(path, what="run metadata")
        if not isinstance(meta, dict):
            raise ValueError(f"{path} (run metadata): expected a JSON object, got {type(meta).__name__}")
        self._scope.enter_context(resume_choice(meta, path, self.device))
        return meta

    def _write_run_files(self) -> None:
        if not self.info.is_main:
            return
        rd = self.run_dir
        rd.mkdir(parents=True, exist_ok=True)
        (rd / "checkpoints").mkdir(exist_ok=True)
        ckpt_mod.atomic_write_bytes(rd / "config.resolved.toml", dump_toml(self.cfg).encode())
        meta_path = rd / "meta.json"
        session = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": sys.argv,
                   "world_size": self.info.world_size, "device": str(self.device), "start_step": self.step,
                   "host": platform.node(), "device_kind": device_kind(self.device),
                   **self.choice}  # the msign / constraint-products choice used
        if self.payload is not None and self.meta:
            meta = self.meta
            meta.setdefault("resumes", []).append({**session, "checkpoint": str(self.ckpt_path)})
        else:  # a fresh start: an earlier run's meta.json was moved to previous/ by _archive_previous_run
            meta = {"seed": self.cfg.run.seed, "config_hash": self.hash, "versions": _versions(),
                    "git_commit": _git_commit(), "data": self.batches.meta,
                    "num_params": sum(p.numel() for p in self.model.parameters()), **session}
        if self.presets:
            meta.setdefault("presets", self.presets)  # what each preset set, and the written keys it did not
        write_json_atomic(meta_path, meta)
        # which parameter went to which optimizer and manifold (param_groups' table), as built for this session
        write_atomic(rd / PARAM_GROUPS_FILE, describe(self.optimizer, self.model) + "\n")

    def _status(self, state: str, reason: str | None = None) -> None:
        if self.info.is_main:
            path = self.run_dir / "status.json"
            with _io_path(path):
                write_json_atomic(path, {"state": state, "step": self.step, "reason": reason,
                                         "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})

    # -- ownership of the run directory ----------------------------------------------------------------------------
    def _take_lock(self) -> None:
        """Rank 0 takes the run directory's lock; every rank learns whether it did (so none is left waiting).

        Raises:
            LockError: another live process owns the directory; OSError: the directory cannot be created.
        """
        err: BaseException | None = None
        if self.info.is_main:
            self._created_dir = not self.run_dir.exists()
            lock = DirLock(self.run_dir, "run directory")
            try:
                if self.run_dir.exists() and not self.run_dir.is_dir():
                    raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", str(self.run_dir))
                check_run_dir_contents(self.run_dir)  # before the lock file: a refused folder is left untouched
                lock.acquire()
                self.lock = lock
            except (ValueError, OSError) as e:  # LockError is a ValueError
                err = e
        if self.info.enabled and all_reduce_mean(0.0 if err else 1.0, self.info) < 1.0 and err is None:
            raise LockError(f"run directory {self.run_dir}: rank 0 could not take its lock")
        if err is not None:
            raise err
        prev = self.lock.took_over if self.lock is not None else None
        if prev:
            print(f"weightgeom: run directory {self.run_dir}: taking over from pid {prev.get('pid')} on host "
                  f"{prev.get('host')}, which is no longer running", file=sys.stderr)

    def _release_lock(self) -> None:
        """Release the lock; a run directory this run created and never wrote to (bad data, unusable checkpoint) is
        removed again, so a refused run leaves nothing behind."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
            if self._created_dir:
                remove_if_unused(self.run_dir)

    def _archive_previous_run(self) -> None:
        """Before a start from step 0: move an earlier run's files to ``previous/<UTC time>/`` (rank 0).

        ``check_run_dir_contents`` has already refused a directory holding anything but a weightgeom run, so whatever
        is here besides ``KEEP_ON_FRESH`` (and the lock, ``previous/``) is an earlier run's; an empty directory moves
        nothing.
        """
        if not self.info.is_main:
            return
        dest = archive_previous(self.run_dir, keep=KEEP_ON_FRESH)
        if dest is not None:
            print(f"weightgeom: run directory {self.run_dir} held an earlier run; its files were moved to {dest}",
                  file=sys.stderr)

    # -- pieces of a step --------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean val loss (and accuracy for classification) over ``train.eval_iters`` fixed micro-batches."""
        info, n_iter = self.info, self.cfg.train.eval_iters
        per_rank = math.ceil(n_iter / info.world_size)
        self.model.eval()
        tot = torch.zeros(3, dtype=torch.float64)
        for k in range(per_rank):
            x, y = self.batches.get("val", 0, info.rank + k * info.world_size, self.device)
            with self.amp():
                logits, loss = self.model(x, y)
            tot[0] += float(loss)
            tot[1] += 1
            if self.batches.kind == "cls":
                tot[2] += (logits.argmax(-1) == y).float().mean().item()
        if info.enabled:
            import torch.distributed as dist

            t = tot.to(self.device) if self.device.type == "cuda" else tot
            dist.all_reduce(t)
            tot = t.cpu()
        self.model.train()
        out = {"loss": tot[0].item() / tot[1].item()}
        if self.batches.kind == "cls":
            out["acc"] = tot[2].item() / tot[1].item()
        return out

    def _save(self) -> None:
        info, tr = self.info, self.cfg.train
        ckdir = self.run_dir / "checkpoints"
        model_sd = full_state_dict(self.model) if self.fsdp else {k: v.detach().cpu().clone()
                                                                  for k, v in self.model.state_dict().items()}
        trainer_state = {"ema": self.ema, "ema_n": self.ema_n, "best": self.best, "tokens": self.tokens,
                         "train_time": self.train_time, "last_val": self.last_val, "last_loss": self._last_loss}
        opt_sd = self.stepper.state_dict()
        if info.rank > 0:
            if self.sharded:
                ckpt_mod.save_checkpoint(ckdir / ckpt_mod.checkpoint_name(self.step, info.rank),
                                         {"step": self.step, "config_hash": self.hash, "optimizer": opt_sd,
                                          "rng": ckpt_mod.rng_state(), "rank": info.rank})
            barrier(info)
            barrier(info)
            return
        barrier(info)  # shard files are complete before the main file appears
        path = ckdir / ckpt_mod.checkpoint_name(self.step)
        with _io_path(path):
            ckpt_mod.save_checkpoint(path, {
                "format": "weightgeom-ckpt-2", "step": self.step, "config_hash": self.hash,
                "config": config_to_dict(self.cfg),
                "model": model_sd, "optimizer": opt_sd, "rng": ckpt_mod.rng_state(), "trainer": trainer_state,
                "world_size": info.world_size, "sharded": self.sharded,
                **({"callbacks": cb_state} if (cb_state := self.callbacks.state_dict()) else {})})
        with _io_path(ckdir):
            ckpt_mod.prune_checkpoints(ckdir, tr.keep_checkpoints)
        barrier(info)

    def _diverged(self, reason: str) -> dict[str, Any]:
        self.logger.log(self.step, "train", {"loss": self._last_loss, "diverged": 1})
        self._status("diverged", reason)
        if self.info.is_main:
            self.bar.write(f"weightgeom: run diverged at step {self.step}: {reason}")
        return self._finish("diverged")

    def _finish(self, status: str) -> dict[str, Any]:
        result = {"status": status, "run_dir": str(self.run_dir), "step": self.step, "final": self._final()}
        self._cb("on_train_end", result)
        self.bar.close()
        self.logger.close()
        return result

    def _make_context(self) -> None:
        """The callbacks' context (none without callbacks)."""
        if not self.callbacks:
            return
        info = self.info
        self.ctx = TrainContext(model=self.model, optimizer=self.optimizer, config=self.cfg, run_dir=self.run_dir,
                                step=self.step, start_step=self.step, max_steps=self.cfg.train.max_steps,
                                resumed=self.payload is not None, rank=info.rank, world_size=info.world_size,
                                is_main=info.is_main, device=self.device, fsdp=self.fsdp)

    def _print_presets(self) -> None:
        """One line on stderr per preset in effect: what it set and which written keys it left (rank 0; always, not
        only with the progress bar; the same is recorded in ``meta.json`` under ``presets``)."""
        if self.info.is_main:
            for line in describe_presets(self.presets):
                print(f"weightgeom: {line}", file=sys.stderr)

    def _start_callbacks(self) -> None:
        """The callbacks' state from the checkpoint resumed from; ``on_train_start``."""
        if not self.callbacks:
            return
        if self.payload is not None:
            self.ctx.loaded_state = self.callbacks.load_state_dict(self.payload.get("callbacks"))
        self._cb("on_train_start")

    def _cb(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on every callback with the context at the current step."""
        if self.callbacks:
            self.ctx.step = self.step
            self.callbacks.call(hook, self.ctx, *args)

    def _final(self) -> dict[str, float]:
        """The result's numbers: last and smoothed train loss, last val metrics, steps, tokens, time."""
        return {"train_loss": self._last_loss, "train_loss_smooth": self._smooth(),
                **{f"val_{k}": v for k, v in self.last_val.items()},
                "steps": self.step, "tokens": self.tokens, "train_time_s": self.train_time,
                "tokens_per_s": self.tokens / self.train_time if self.train_time > 0 else float("nan")}

    def _already_done(self) -> dict[str, Any]:
        """The result of a run whose newest checkpoint is at (or past) ``train.max_steps``: nothing is trained.

        The final numbers come from the checkpoint's trainer state, and the last train loss from it or (checkpoints
        that predate it) from the last train line of ``metrics.jsonl`` at that step. ``status.json`` is set to done
        if an interruption after the final checkpoint left it otherwise; nothing else is written.
        """
        last = self.payload["trainer"].get("last_loss")
        if last is None:
            rows = [r for r in read_metrics(self.run_dir, "train") if r.get("step") == self.step]
            last = rows[-1].get("loss") if rows else None
        self._last_loss = float(last) if isinstance(last, (int, float)) else float("nan")
        if self.info.is_main:
            if (read_status(self.run_dir) or {}).get("state") != "done":
                self._status("done")
            print(f"weightgeom: run in {self.run_dir} is already done at step {self.step} (train.max_steps="
                  f"{self.cfg.train.max_steps}); nothing to do: raise train.max_steps to continue it or use "
                  "--fresh to start over", file=sys.stderr)
        return {"status": "done", "run_dir": str(self.run_dir), "step": self.step, "final": self._final(),
                "already_done": True}

    def _smooth(self) -> float:
        sm = self.cfg.train.smoothing
        return self.ema / (1 - sm ** self.ema_n) if self.ema_n else float("nan")

    # -- the loop --------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Own the run directory for the whole run (lock taken first, released on any exit), then train."""
        self._take_lock()
        try:
            with _io_path(self.run_dir), self._scope:
                return self._run_owned()
        finally:
            self._release_lock()

    def _run_owned(self) -> dict[str, Any]:
        self._last_loss = float("nan")
        self._setup()
        info, tr = self.info, self.cfg.train
        if self.payload is not None and self.step >= tr.max_steps:
            return self._already_done()
        self._make_context()
        self._cb("on_setup")  # a callback's refusal comes before anything in the run directory is written or moved
        self._print_presets()
        if self.payload is None:
            self._archive_previous_run()
        self._write_run_files()
        resumed = self.payload is not None
        self.logger = MetricsLogger(self.run_dir, enabled=info.is_main, resume_step=self.step if resumed else None)
        if resumed:
            self.logger.truncate_after(self.step)
        self.bar = Progress(tr.max_steps, self.step, enabled=self.progress_on)
        try:
            self._status("running")
            self._start_callbacks()
            return self._loop()
        except BaseException as e:
            with contextlib.suppress(OSError):  # a full disk must not hide the original error
                self._status("failed", f"{type(e).__name__}: {e}")
            self.bar.close()
            with contextlib.suppress(OSError):
                self.logger.close()
            raise

    def _loop(self) -> dict[str, Any]:
        cfg, info, tr = self.cfg, self.info, self.cfg.train
        ddp = info.enabled and not self.fsdp
        diag_every = cfg.diagnostics.every
        sm = tr.smoothing
        tokens_per_micro = self.batches.batch_size * max(1, self.batches.block_size)
        if self.step == 0:
            self.last_val = self.evaluate()
            self.logger.log(0, "val", self.last_val)
            self._cb("on_eval", self.last_val)
        x = y = None
        while self.step < tr.max_steps:
            t0 = time.perf_counter()
            factor = apply_lr(self.optimizer, self.lr_fn(self.step))
            loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
            for m in range(self.accum_local):
                x, y = self.batches.get("train", self.step, info.rank * self.accum_local + m, self.device)
                sync = self.wrapped.no_sync() if ddp and m < self.accum_local - 1 else contextlib.nullcontext()
                with sync:
                    with self.amp():
                        _, loss = self.wrapped(x, y)
                    (loss / self.accum_local).backward()
                loss_sum += loss.detach().float()
            s_next = self.step + 1
            diag_due = bool(diag_every) and s_next % diag_every == 0 and not self.fsdp
            pre_clip = self._grad_norms() if diag_due else None  # per-module norms of the raw (unclipped) gradients
            # clipped on the device; the loss and the gradient norm are then read together: one device sync per step
            gnorm_t = clip_grad_norm(self.clip_params, tr.grad_clip, info)
            loss_local, gnorm = torch.stack([loss_sum, gnorm_t.to(loss_sum.device, torch.float32)]).tolist()
            loss_val = all_reduce_mean(loss_local / self.accum_local, info)
            self._last_loss = loss_val
            # divergence: checked before the update, so the parameters stay those that produced a finite loss
            if not math.isfinite(loss_val):
                self.step = s_next
                return self._diverged(f"non-finite train loss ({loss_val}) at step {s_next}")
            why = explosion(loss_val, self.ema, self.ema_n, self.best, tr.diverge_factor, tr.diverge_warmup, sm)
            if why:
                self.step = s_next
                return self._diverged(f"loss explosion at step {s_next}: {why}")
            if not math.isfinite(gnorm):
                self.step = s_next
                return self._diverged(self._grad_reason(gnorm, s_next))
            if self.callbacks:  # this step's loss, batch and (clipped) gradients, before the update
                self.ctx.loss, self.ctx.batch, self.ctx.grads_available = loss_val, (x, y), True
                self._cb("on_before_step")
            with self._quiet_compile():
                self.step_fn()
            self.step = s_next
            if not self._compile_logged and getattr(self.step_fn, "compile_seconds", None) is not None:
                self._compile_logged = True  # the compiled optimizer step's one-off cost, once per run
                self.logger.log(self.step, "compile", {"optimizer_compile_s": self.step_fn.compile_seconds})
            self._cb("on_step_end")  # may change the weights (e.g. SigmaCap): before diagnostics and checkpoints
            if diag_due:
                self._diagnostics(x, y, pre_clip)  # weights after this step's update; gradient norms before clipping
            self.stepper.zero_grad(set_to_none=True)
            for p in self.clip_params:  # also parameters an optimizer does not hold (sharded step, frozen groups)
                p.grad = None
            if self.callbacks:
                self.ctx.grads_available = False
            self.ema = sm * self.ema + (1 - sm) * loss_val
            self.ema_n += 1
            self.best = min(self.best, self._smooth())
            dt = time.perf_counter() - t0
            self.train_time += dt
            n_tok = tokens_per_micro * tr.grad_accum
            self.tokens += n_tok
            self.bar.update(1, loss=loss_val, val=self.last_val.get("loss", float("nan")))

            if self.step % tr.log_every == 0 or self.step == tr.max_steps:
                lrs = {}
                for g in self.optimizer.param_groups:
                    key = "lr_" + str(g.get("algorithm", "group"))
                    lrs.setdefault(key, g.get("lr"))
                self.logger.log(self.step, "train", {"loss": loss_val, "loss_smooth": self._smooth(),
                                                     "grad_norm": gnorm, "lr_factor": factor, **lrs,
                                                     "tokens": self.tokens, "tokens_per_s": n_tok / dt,
                                                     "ms_per_step": dt * 1e3, **self.callbacks.metrics()})
            ev = tr.eval_every
            if (ev and self.step % ev == 0) or self.step == tr.max_steps:
                self.last_val = self.evaluate()
                self.logger.log(self.step, "val", self.last_val)
                self._cb("on_eval", self.last_val)
            ce = tr.ckpt_every
            if (ce and self.step % ce == 0) or self.step == tr.max_steps:
                self.logger.flush()
                self._save()
                self._status("running")
                self._cb("on_checkpoint", self.run_dir / "checkpoints" / ckpt_mod.checkpoint_name(self.step))
        self._status("done")
        return self._finish("done")

    def _grad_reason(self, gnorm: float, step: int) -> str:
        """Divergence reason for a non-finite gradient norm, naming the parameters whose gradients are non-finite."""
        bad = nonfinite_grads(list(self.model.named_parameters()))
        if not bad:
            return f"non-finite gradient norm ({gnorm}) at step {step}: every gradient is finite, their norm overflowed"
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return f"non-finite gradient norm ({gnorm}) at step {step}: non-finite gradient in {', '.join(bad[:3])}{more}"

    def _grad_norms(self) -> dict[str, float]:
        return grad_norms((bare_name(n), p.grad) for n, p in self.model.named_parameters())

    def _diagnostics(self, x, y, pre_clip: dict[str, float] | None = None) -> None:
        dc = self.cfg.diagnostics
        rng = torch.get_rng_state()
        d = collect_diagnostics(self.model, self.optimizer, (x, y), grads=pre_clip is None, max_seqs=dc.max_seqs,
                                threshold=dc.saturation_threshold)
        d.update(pre_clip or {})
        torch.set_rng_state(rng)  # diagnostics never change the training trajectory
        self.model.train()
        self.logger.log(self.step, "diag", d)

"""Experiment tracking: send a run's metrics and resolved config to Weights & Biases or MLflow (``[logging]``).

Both are optional: ``[logging] wandb = true`` needs ``pip install 'weightgeom[wandb]'`` and ``mlflow = true``
``pip install 'weightgeom[mlflow]'`` (``mlflow-skinny``); choosing one whose package is missing is one line naming the
extra, before anything is trained. Neither is imported unless it is chosen.

What is sent is exactly what the run writes to ``metrics.jsonl``: every line (splits ``train``, ``val`` and ``diag``)
becomes the metrics ``<split>/<name>`` at its optimizer step, so the tracker, TensorBoard and ``weightgeom report``
show the same numbers. The trackers are trainer callbacks (:class:`~weightgeom.train.callbacks.Callback`, rank 0
only) that read the lines the trainer appended since their last hook, so nothing in the training loop changes. The
resolved config (every key after validation, flattened to ``section.key``) is the run's config / parameters; the
group is ``logging.group``, or the sweep directory's name for a run of ``weightgeom sweep``; a sweep run's recipe,
variant and seed (its ``experiment.json``) become tags.

Offline by default: W&B runs in ``offline`` mode and writes under ``<run dir>/wandb/`` (``wandb sync`` uploads it
later); MLflow's default store is a file store ``mlruns/`` next to the run directory (the sweep directory for a sweep;
``mlflow ui --backend-store-uri <dir>/mlruns`` shows it). Neither needs a network. ``wandb_mode = "online"`` or an
``mlflow_uri`` of a tracking server sends them live.

Resume: each tracker's run id and the last step it sent per split are kept in ``<run dir>/tracking.json``; a resumed
run continues the same W&B / MLflow run and sends only steps after those already sent (training resumes bit-identically
on CPU, so the steps an interrupted session sent are the ones it would send again). A fresh start moves
``tracking.json`` and ``wandb/`` to ``previous/`` with the rest of the earlier run and starts new tracker runs.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from weightgeom._files import read_json
from weightgeom._optional import import_extra
from weightgeom.schema import ConfigError, Section, setting, to_dict
from weightgeom.train.callbacks import Callback, TrainContext
from weightgeom.train.checkpoint import atomic_write_bytes
from weightgeom.train.logging import parse_jsonl_line

__all__ = ["LoggingConfig", "MetricsTracker", "WandbTracker", "MlflowTracker", "trackers_from_config",
           "require_package", "TRACKING_FILE"]

TRACKING_FILE = "tracking.json"
"""The trackers' run ids and last steps sent, in the run directory."""

EXTRAS = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
"""Tracker → (module to import, pip extra of weightgeom that installs it)."""


@dataclass
class LoggingConfig(Section):
    """Experiment tracking (``[logging]``): where a run's metrics go besides ``metrics.jsonl`` and TensorBoard."""

    _prefix: ClassVar[str] = "logging"

    wandb: bool = setting(False, "send metrics and the resolved config to Weights & Biases (needs pip install "
                                 "'weightgeom[wandb]')")
    mlflow: bool = setting(False, "send metrics and the resolved config to MLflow (needs pip install "
                                  "'weightgeom[mlflow]')")
    project: str = setting("weightgeom", "W&B project and MLflow experiment name")
    group: str = setting("", "run group (W&B group, MLflow tag 'group'); empty: the sweep directory's name for a "
                             "sweep run, none otherwise")
    wandb_mode: Literal["offline", "online"] = setting(
        "offline", "offline (written under <run dir>/wandb/, upload later with wandb sync) | online (needs wandb "
                   "login and a network)")
    wandb_entity: str = setting("", "W&B entity (user or team); empty: the login's default")
    mlflow_uri: str = setting("", "MLflow tracking URI (a server http://host:5000, sqlite:///file.db, file:/dir); "
                                  "empty: the file store mlruns/ next to the run directory")

    def check(self) -> None:
        if (self.wandb or self.mlflow) and not self.project.strip():
            raise ConfigError("config key logging.project: must not be empty when a tracker is on")
        bad = sorted(set(self.project) & set(WANDB_PROJECT_FORBIDDEN))
        if self.wandb and (bad or len(self.project) > 128):
            raise ConfigError(f"config key logging.project={self.project!r}: W&B project names are at most 128 "
                              f"characters without any of {WANDB_PROJECT_FORBIDDEN!r}"
                              + (f" (found {''.join(bad)!r})" if bad else ""))
        uri = self.mlflow_uri.strip()
        if self.mlflow and "://" in uri and uri.split("://", 1)[0].split("+", 1)[0] not in MLFLOW_SCHEMES:
            raise ConfigError(f"config key logging.mlflow_uri={uri!r}: unknown scheme; use a server "
                              f"(http://host:5000), sqlite:///file.db, file:/dir or a plain directory path")


WANDB_PROJECT_FORBIDDEN = "/\\#?%:"
"""Characters W&B refuses in a project name."""

MLFLOW_SCHEMES = ("file", "http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks")
"""Tracking-URI schemes MLflow stores understand (``postgresql+psycopg2`` counts as ``postgresql``)."""


def require_package(tracker: str) -> Any:
    """Import the package of ``tracker`` (``"wandb"`` or ``"mlflow"``).

    Raises:
        ValueError: the package is not installed (one line naming the config key and the pip extra).
    """
    module, extra = EXTRAS[tracker]
    return import_extra(module, extra, f"config key logging.{tracker}=true")


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _number(v: Any) -> float | None:
    """A metric value as a float (``"nan"``/``"inf"`` strings of metrics.jsonl included), or None if not a number."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if v in ("nan", "inf", "-inf"):
        return float(v)
    return None


class MetricsTracker(Callback):
    """Base of the trackers: follows ``metrics.jsonl`` and sends each new line once (rank 0 only).

    Subclasses implement :meth:`_open` (start or continue the tracker's run; returns its id), :meth:`_send` (one
    line's metrics at a step) and :meth:`_close`.

    Args:
        config: the ``[logging]`` section.
    """

    name: ClassVar[str] = "tracker"

    def __init__(self, config: LoggingConfig) -> None:
        self.cfg = config
        self.run_dir: Path | None = None
        self._pos = 0
        self._record: dict[str, Any] = {}
        self._active = False
        self.sent = 0

    # -- subclass interface ----------------------------------------------------------------------------------
    def _open(self, ctx: TrainContext, run_id: str | None, params: dict[str, Any], tags: dict[str, str]) -> str:
        raise NotImplementedError

    def _send(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def _close(self, status: str) -> None:
        raise NotImplementedError

    # -- helpers ---------------------------------------------------------------------------------------------
    def _group(self, run_dir: Path) -> str:
        if self.cfg.group:
            return self.cfg.group
        return run_dir.parent.name if (run_dir.parent / "sweep.json").exists() else ""

    def _tags(self, run_dir: Path) -> dict[str, str]:
        try:
            exp = read_json(run_dir / "experiment.json")
        except (OSError, ValueError):
            return {}
        if not isinstance(exp, dict):
            return {}
        return {k: str(exp[k]) for k in ("recipe", "variant", "seed", "part") if k in exp}

    def _load_record(self) -> dict[str, Any]:
        try:
            rec = read_json(self.run_dir / TRACKING_FILE)
        except (OSError, ValueError):
            return {}
        return rec if isinstance(rec, dict) else {}

    def _save_record(self) -> None:
        atomic_write_bytes(self.run_dir / TRACKING_FILE, (json.dumps(self._record, indent=1) + "\n").encode())

    def _pump(self) -> None:
        """Send the complete lines appended to ``metrics.jsonl`` since the last call."""
        path = self.run_dir / "metrics.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n")
        if end < 0:
            return
        self._pos += end + 1
        last = self._record.setdefault(f"{self.name}_last_step", {})
        sent_any = False
        for line in data[:end].splitlines():
            row = parse_jsonl_line(line)
            if row is None or not isinstance(row.get("step"), int):
                continue
            split, step = str(row.get("split", "train")), row["step"]
            if step <= last.get(split, -1):
                continue  # sent by an earlier session of this run (resume)
            metrics = {f"{split}/{k}": x for k, v in row.items() if k not in ("step", "split")
                       and (x := _number(v)) is not None}
            if metrics:
                self._send(step, metrics)
                self.sent += 1
            last[split] = step
            sent_any = True
        if sent_any:
            self._save_record()

    # -- hooks -----------------------------------------------------------------------------------------------
    def on_train_start(self, ctx: TrainContext) -> None:
        if not ctx.is_main:
            return
        self.run_dir = Path(ctx.run_dir)
        self._pos = 0
        self._record = self._load_record()
        key = f"{self.name}_run_id"
        params = _flat(to_dict(ctx.config))
        tags = {**self._tags(self.run_dir), "group": self._group(self.run_dir)}
        try:
            self._record[key] = self._open(ctx, self._record.get(key), params, tags)
        except Exception as e:  # noqa: BLE001 - the tracker's own errors: one line naming the setting
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            where = (f"logging.mlflow_uri={self.tracking_uri(self.run_dir)!r}" if self.name == "mlflow"
                     else f"logging.project={self.cfg.project!r}")
            raise ValueError(f"config key logging.{self.name}=true: {self.name} cannot start a run ({where}): "
                             f"{type(e).__name__}: {(lines[0] if lines else '')[:300]}") from None
        self._active = True
        self._save_record()
        self._pump()

    def on_eval(self, ctx: TrainContext, metrics: dict[str, float]) -> None:
        if self._active:
            self._pump()

    def on_step_end(self, ctx: TrainContext) -> None:
        if self._active:
            self._pump()

    def on_checkpoint(self, ctx: TrainContext, path: Path) -> None:
        if self._active:
            self._pump()

    def on_train_end(self, ctx: TrainContext, result: dict[str, Any]) -> None:
        if not self._active:
            return
        self._pump()
        self._active = False
        self._close(str(result.get("status", "done")))

    def summary(self) -> dict[str, Any]:
        return {f"{self.name}_lines_sent": self.sent}


class WandbTracker(MetricsTracker):
    """Weights & Biases: one W&B run per weightgeom run (offline by default: ``<run dir>/wandb/``)."""

    name = "wandb"

    def __init__(self, config: LoggingConfig) -> None:
        super().__init__(config)
        self._wandb = require_package("wandb")
        self._run = None

    def _open(self, ctx: TrainContext, run_id: str | None, params: dict[str, Any], tags: dict[str, str]) -> str:
        wandb = self._wandb
        run_id = run_id or uuid.uuid4().hex[:12]
        group = tags.pop("group", "") or None
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True,
                                  save_code=False)
        self._run = wandb.init(project=self.cfg.project, entity=self.cfg.wandb_entity or None, group=group,
                               name=self.run_dir.name, id=run_id, resume="allow", mode=self.cfg.wandb_mode,
                               dir=str(self.run_dir), config=params, tags=[f"{k}={v}" for k, v in tags.items()],
                               settings=settings, reinit="create_new")
        return run_id

    def _send(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def _close(self, status: str) -> None:
        if self._run is not None:
            self._run.summary["status"] = status
            self._run.finish(exit_code=0)
            self._run = None


class MlflowTracker(MetricsTracker):
    """MLflow: one MLflow run per weightgeom run in experiment ``logging.project`` (default store: a file store
    ``mlruns/`` next to the run directory)."""

    name = "mlflow"
    BATCH = 500  # metrics per log_batch call (MLflow accepts up to 1000)

    def __init__(self, config: LoggingConfig) -> None:
        super().__init__(config)
        require_package("mlflow")
        self._client = None
        self._run_id: str | None = None

    def tracking_uri(self, run_dir: Path) -> str:
        """``logging.mlflow_uri``, or the file store ``mlruns/`` next to ``run_dir``."""
        uri = self.cfg.mlflow_uri.strip()
        if uri and ":" not in uri.split("/", 1)[0]:  # a plain directory path: MLflow's file store there
            return Path(uri).expanduser().resolve().as_uri()
        if uri:
            return uri
        return (run_dir.parent / "mlruns").resolve().as_uri()

    def _open(self, ctx: TrainContext, run_id: str | None, params: dict[str, Any], tags: dict[str, str]) -> str:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri(self.run_dir)
        if uri.startswith("file:"):
            # MLflow keeps its file store in maintenance mode behind this switch; it is what works without a server
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if uri.startswith(("http:", "https:")):  # a server that does not answer: fail in seconds, not minutes
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self._client = client = MlflowClient(tracking_uri=uri)
        if run_id:
            try:
                client.get_run(run_id)
            except Exception:  # noqa: BLE001 - another store, or the run was deleted: start a new one
                run_id = None
        if run_id:
            client.update_run(run_id, status="RUNNING")
        else:
            exp = client.get_experiment_by_name(self.cfg.project)
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.cfg.project)
            run_id = client.create_run(exp_id, run_name=self.run_dir.name,
                                       tags={k: v for k, v in tags.items() if v}).info.run_id
            items = [Param(k, str(v)[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):
                client.log_batch(run_id, params=items[i:i + 100])
            resolved = self.run_dir / "config.resolved.toml"
            if resolved.exists():
                client.log_artifact(run_id, str(resolved))
        self._run_id = run_id
        return run_id

    def _send(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), self.BATCH):
            self._client.log_batch(self._run_id, metrics=items[i:i + self.BATCH])

    def _close(self, status: str) -> None:
        if self._client is not None and self._run_id is not None:
            self._client.set_tag(self._run_id, "status", status)
            self._client.set_terminated(self._run_id, "FINISHED")


def trackers_from_config(config: LoggingConfig) -> list[MetricsTracker]:
    """The trackers ``[logging]`` turns on (empty when none is).

    Raises:
        ValueError: a chosen tracker's package is missing (one line naming the key and the pip extra).
    """
    out: list[MetricsTracker] = []
    if config.wandb:
        out.append(WandbTracker(config))
    if config.mlflow:
        out.append(MlflowTracker(config))
    return out

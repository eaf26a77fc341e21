"""weightgeom's optimizers inside other training loops: Hugging Face Trainer, accelerate and PyTorch Lightning
(train, checkpoint, resume). docs/training.md, "In other training loops", shows the same code."""

from __future__ import annotations

import accelerate
import lightning
import pytest
import torch
import transformers

from weightgeom.optim import Muon, param_groups

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
           attn_pdrop=0.0)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 50, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**CFG))


def _trainer(out, steps: int) -> tuple[transformers.Trainer, Muon]:
    model = _model()
    opt = Muon(param_groups(model, "hetero", lr=0.02, adamw_lr=1e-3))  # HF GPT-2 Conv1D layouts are recognised
    args = transformers.TrainingArguments(str(out), max_steps=steps, per_device_train_batch_size=4, save_steps=2,
                                          report_to=[], logging_steps=1, use_cpu=True, disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), optimizers=(opt, None)), opt


def test_hf_trainer_trains_checkpoints_and_resumes_with_manifold_muon(tmp_path):
    tr, opt = _trainer(tmp_path / "a", 4)
    out = tr.train()
    assert out.global_step == 4 and torch.isfinite(torch.tensor(out.training_loss))
    groups = [g for g in opt.param_groups if g["manifold"] is not None]
    assert groups and all(len(opt.state[p]["momentum_buffer"]) for g in groups for p in g["params"])
    saved = torch.load(tmp_path / "a" / "checkpoint-2" / "optimizer.pt", weights_only=True)  # no code runs
    fresh = Muon(param_groups(_model(), "hetero", lr=0.02, adamw_lr=1e-3))
    fresh.load_state_dict(saved)  # what Trainer does on resume
    assert len(fresh.state) == len(saved["state"])
    # resume from the step-2 checkpoint: the optimizer state comes back and training continues to step 4
    tr2, opt2 = _trainer(tmp_path / "a", 4)
    out2 = tr2.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert out2.global_step == 4 and torch.isfinite(torch.tensor(out2.training_loss))
    for g in opt2.param_groups:
        if g["manifold"] == "stiefel":  # still on the manifold after the resumed steps (HF Conv1D: stored (in, out))
            for p in g["params"]:
                W = p.detach().double()
                X = W if W.shape[0] >= W.shape[1] else W.T
                assert torch.allclose(X.T @ X, torch.eye(X.shape[1], dtype=X.dtype), atol=1e-4)


def test_accelerate_loop_trains_saves_and_loads_state(tmp_path):
    acc = accelerate.Accelerator(cpu=True)
    model = _model()
    opt = Muon(param_groups(model, "hetero", lr=0.02, adamw_lr=1e-3))
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    batches = iter(loader)
    for _ in range(2):
        b = next(batches)
        loss = model(**b).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    acc.save_state(str(tmp_path / "state"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inner = opt.optimizer if hasattr(opt, "optimizer") else opt
    momentum = [inner.state[p]["momentum_buffer"].clone() for g in inner.param_groups if g["algorithm"] == "muon"
                for p in g["params"]]
    b = next(batches)
    acc.backward(model(**b).loss)
    opt.step()
    opt.zero_grad()
    acc.load_state(str(tmp_path / "state"))  # back to step 2, bit for bit
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    again = [inner.state[p]["momentum_buffer"] for g in inner.param_groups if g["algorithm"] == "muon"
             for p in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(momentum, again)) and len(again) == len(momentum)


class _LitGPT(lightning.LightningModule):
    """A LightningModule whose configure_optimizers returns manifold Muon."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _model()
        self.automatic_optimization = True

    def training_step(self, batch: dict, i: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> Muon:
        return Muon(param_groups(self.model, "hetero", lr=0.02, adamw_lr=1e-3))


def _fit(tmp_path, steps: int, ckpt: str | None = None) -> lightning.Trainer:
    trainer = lightning.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=str(tmp_path))
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=4)
    module = _LitGPT()
    trainer.fit(module, loader, ckpt_path=ckpt)
    return trainer


def test_lightning_trains_checkpoints_and_resumes_with_manifold_muon(tmp_path):
    trainer = _fit(tmp_path, 2)
    ckpt = tmp_path / "two.ckpt"
    trainer.save_checkpoint(str(ckpt))
    saved = torch.load(ckpt, weights_only=True)["optimizer_states"][0]  # tensors and plain values only
    assert saved["state"] and all("momentum_buffer" in s or "exp_avg" in s for s in saved["state"].values())
    resumed = _fit(tmp_path, 4, ckpt=str(ckpt))
    assert resumed.global_step == 4
    opt = resumed.optimizers[0]
    assert isinstance(opt, Muon) and all(len(s) for s in opt.state.values())


class _Seen(transformers.TrainerCallback):
    """Stands for a report_to reporter: records every log it is shown."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        self.logs.append(dict(logs or {}))


def test_hf_trainer_logs_every_param_group_lr(tmp_path):
    from weightgeom.train.hf_callbacks import log_group_lrs

    tr, opt = _trainer(tmp_path / "lr", 2)
    seen = _Seen()
    tr.callback_handler.callbacks.insert(0, seen)  # where Trainer puts the report_to reporters: before user callbacks
    log_group_lrs(tr)
    tr.train()
    names = ["lr/adamw", "lr/adamw-2", "lr/muon-stiefel", "lr/muon-dgram"]  # param_groups(model, "hetero")
    steps = [h for h in tr.state.log_history if "loss" in h and "learning_rate" in h]
    assert len(steps) == 2 and len(seen.logs) >= 2
    for logged in (steps, [s for s in seen.logs if "learning_rate" in s]):
        for h in logged:
            assert [k for k in h if k.startswith("lr/")] == names, h
            assert h["lr/adamw"] == h["learning_rate"]  # Trainer's one rate is the first group's
            # the linear schedule scales every group alike: the Muon groups keep their 0.02 : 1e-3 ratio
            assert h["lr/muon-stiefel"] == pytest.approx(20 * h["learning_rate"]), h
    # the rates each step used (linear decay over 2 steps), not the scheduler's next ones
    assert [h["lr/muon-dgram"] for h in steps] == pytest.approx([0.02, 0.01]) and opt.param_groups[3]["lr"] == 0.0
    assert not any(k.startswith("lr/") for k in tr.state.log_history[-1])  # the end-of-training summary


def test_lightning_logs_every_param_group_lr(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from weightgeom.train.lightning_callbacks import GroupLRMonitor

    logger = CSVLogger(str(tmp_path), name="lr", version=0)
    trainer = lightning.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=logger, log_every_n_steps=1,
                                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                                default_root_dir=str(tmp_path), callbacks=[GroupLRMonitor()])
    trainer.fit(_LitGPT(), torch.utils.data.DataLoader(_Tokens(), batch_size=4))
    lines = (tmp_path / "lr" / "version_0" / "metrics.csv").read_text().splitlines()
    head = lines[0].split(",")
    assert {"lr/adamw", "lr/adamw-2", "lr/muon-stiefel", "lr/muon-dgram"} <= set(head), head
    rows = [dict(zip(head, line.split(","))) for line in lines[1:]]
    logged = [r for r in rows if r.get("lr/muon-stiefel")]
    assert len(logged) == 2, rows  # one row per step (log_every_n_steps=1); Lightning logs float32 values
    assert all(float(r["lr/muon-stiefel"]) == pytest.approx(0.02) and float(r["lr/adamw"]) == pytest.approx(1e-3)
               for r in logged), rows

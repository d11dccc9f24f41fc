"""Runs as ``python lightning_worker.py --out DIR``: Lightning's own CPU DDP launcher starts the
second rank (``Trainer(accelerator="cpu", devices=2)``), and every fit below runs in both.

Each run writes ``<run>.<rank>.pt``: the model's parameters after fit, the LAGS iterations
(None under plain DDP) and the optimizer steps Lightning counted.
  dense        DDPStrategy (Lightning's own), SGD with momentum and weight decay, 2 epochs
  lags-1       LAGSStrategy(density=1.0) on the same: equal to dense up to rounding
  sgd          LAGSStrategy(density=DENSITY), 2 epochs, a checkpoint after each
  sgd-resumed  a fresh model and trainer: fit(ckpt_path=<sgd's epoch-0 checkpoint>) to epoch 2
  adamw, adamw-resumed   the same with AdamW (the local residual: each rank's own model
               until fit ends and averages them)
  amp          sgd under Lightning's 16-mixed plugin and its GradScaler (a scale that doubles every
               2 steps), with autocast off: the loss is scaled by powers of two in float32, so
               the model must be sgd's bit for bit
  clipped      sgd with accumulate_grad_batches=2 and gradient_clip_val (Lightning's own options)
               under bf16-mixed
"""

import argparse
import os
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy

from lags_hvd.lightning import LAGSStrategy

torch.set_num_threads(1)
warnings.filterwarnings("ignore", ".*does not have many workers.*")
DENSITY = 0.05
SAMPLES, BATCH = 96, 8  # 6 steps per epoch on each of 2 ranks


class Regression(pl.LightningModule):
    """A small MLP on a fixed random regression task."""

    def __init__(self, optimizer: str):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
        self.optimizer_name = optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(SAMPLES, 10, generator=g)
        y = torch.sin(x[:, :3]) + 0.1 * torch.randn(SAMPLES, 3, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True)


class ScaledFloat32(MixedPrecision):
    """Lightning's 16-mixed precision plugin, GradScaler and all, with autocast off."""

    def autocast_context_manager(self) -> torch.autocast:
        return torch.autocast("cpu", enabled=False)


def fit(out: Path, run: str, strategy, optimizer="sgd", ckpt_path=None, checkpoints=None, **trainer_options):
    model = Regression(optimizer)
    callbacks = []
    if checkpoints is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_options,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    state = getattr(trainer.strategy, "lags_state", None)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    saved = {
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "iterations": None if state is None else state.iteration,
        "steps": trainer.global_step,
        "scale": None if scaler is None else scaler.get_scale(),
    }
    torch.save(saved, out / f"{run}.{trainer.global_rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    fit(out, "dense", DDPStrategy(process_group_backend="gloo"))
    fit(out, "lags-1", LAGSStrategy(process_group_backend="gloo", density=1.0))
    for optimizer in ("sgd", "adamw"):
        folder = out / f"{optimizer}-checkpoints"
        fit(out, optimizer, LAGSStrategy(density=DENSITY), optimizer, checkpoints=folder)
        resumed = LAGSStrategy(density=DENSITY)
        fit(out, f"{optimizer}-resumed", resumed, optimizer, ckpt_path=folder / "epoch=0.ckpt")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    fit(out, "amp", LAGSStrategy(density=DENSITY), plugins=[ScaledFloat32("16-mixed", "cpu", scaler=scaler)])
    clipped = LAGSStrategy(density=DENSITY)
    fit(out, "clipped", clipped, accumulate_grad_batches=2, gradient_clip_val=0.5, precision="bf16-mixed")


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()

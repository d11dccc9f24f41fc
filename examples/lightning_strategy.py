"""LAGS under PyTorch Lightning: ``python examples/lightning_strategy.py`` (Lightning starts the
second process)."""

import torch

from fashion import Net, command_line, dataset, loss_fn, report

args = command_line(__doc__)
# fmt: off
# [readme]
import lightning.pytorch as pl
from lags_hvd.lightning import LAGSStrategy


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return loss_fn(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05 * self.trainer.world_size, momentum=0.9)


trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=args.steps,
                     strategy=LAGSStrategy(density=0.001))   # was: strategy="ddp"
model = Classifier()
trainer.fit(model, torch.utils.data.DataLoader(dataset(), batch_size=args.batch, shuffle=True))
# [/readme]
# fmt: on
report(args, "lightning", model.net, trainer.global_rank)

"""What the examples share, so that each shows only its door: the Fashion-MNIST CNN, this
rank's batches, the test accuracy and the command line (``--steps``, ``--batch``, ``--out``,
``--test-images``)."""

import argparse
import json
from pathlib import Path

import torch

from lags_hvd.experiments.data import fashion_mnist
from lags_hvd.experiments.models.small import FashionCNN as Net  # noqa: F401 (the examples' model)

loss_fn = torch.nn.functional.cross_entropy


def command_line(doc: str, accumulate: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if accumulate:
        parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=64, help="samples per worker per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the test accuracy here (JSON)")
    parser.add_argument("--test-images", type=_test_images, default=10_000, help="the accuracy's test images (1-10000)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    return args


def _test_images(text: str) -> int:
    images = int(text)
    if not 1 <= images <= 10_000:
        raise argparse.ArgumentTypeError(f"the test set has 10,000 images; asked for {images}")
    return images


def dataset() -> torch.utils.data.TensorDataset:
    train_x, train_y, _, _ = fashion_mnist()
    return torch.utils.data.TensorDataset(train_x, train_y)


def batches(args, rank: int, world: int):
    """``args.steps`` batches of this rank's shard, epoch after epoch (a new order each)."""
    data = dataset()
    sampler = torch.utils.data.DistributedSampler(data, world, rank, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)
    step, epoch = 0, 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            if step == args.steps:
                return
            yield batch
            step += 1
        epoch += 1


@torch.no_grad()
def accuracy(model: torch.nn.Module, images: int = 10_000) -> float:
    """Top-1 accuracy on the first ``images`` of the 10,000 test images."""
    _, _, test_x, test_y = fashion_mnist()
    test_x, test_y = test_x[:images], test_y[:images]
    model.eval()
    correct = sum((model(x).argmax(1) == y).sum().item() for x, y in zip(test_x.split(1000), test_y.split(1000)))
    model.train()
    return correct / len(test_y)


def report(args, example: str, model: torch.nn.Module, rank: int) -> None:
    """Rank 0 prints the test accuracy and writes it to ``--out``."""
    if rank != 0:
        return
    result = {"example": example, "steps": args.steps, "batch": args.batch, "seed": args.seed}
    result["accumulate"] = getattr(args, "accumulate", 1)
    result["test_images"] = args.test_images
    result["accuracy"] = accuracy(model, args.test_images)
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result) + "\n")

"""Build a model with a synthetic batch of the shapes the paper trains on."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .cifar import resnet20, vgg16
from .imagenet import inception_v4, resnet50
from .language import PTB_SEQ_LEN, PTB_VOCAB, CharGPT, lstm_ptb, lstm_ptb_small

GPT_VOCAB, GPT_CONTEXT = 96, 128  # the Shakespeare GPT's sizes (docs/convergence-transformer.md)


@dataclass(frozen=True)
class ModelSpec:
    factory: Callable[[], nn.Module]
    input_shape: tuple  # per sample
    paper_batch: int  # per-worker batch in the paper's experiments
    kind: str  # "image" or "language"
    classes: int


MODELS = {
    "resnet20": ModelSpec(resnet20, (3, 32, 32), 32, "image", 10),
    "vgg16": ModelSpec(vgg16, (3, 32, 32), 128, "image", 10),
    "resnet50": ModelSpec(resnet50, (3, 224, 224), 32, "image", 1000),
    "inception_v4": ModelSpec(inception_v4, (3, 299, 299), 64, "image", 1000),
    "lstm_ptb": ModelSpec(lstm_ptb, (PTB_SEQ_LEN,), 20, "language", PTB_VOCAB),
    "lstm_small": ModelSpec(lstm_ptb_small, (PTB_SEQ_LEN,), 20, "language", PTB_VOCAB),
    "char_gpt": ModelSpec(lambda: CharGPT(GPT_VOCAB, context=GPT_CONTEXT), (GPT_CONTEXT,), 16, "language", GPT_VOCAB),
}


def build(name: str, batch_size: int | None = None, seed: int = 0):
    """``(model, (inputs, targets), loss_fn)`` for a synthetic batch; ``loss_fn(model, batch)``."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    spec = MODELS[name]
    torch.manual_seed(seed)
    model = spec.factory()
    batch_size = batch_size or spec.paper_batch
    gen = torch.Generator().manual_seed(seed + 1)
    if spec.kind == "image":
        inputs = torch.randn(batch_size, *spec.input_shape, generator=gen)
        targets = torch.randint(spec.classes, (batch_size,), generator=gen)

        def loss_fn(m, batch):
            return nn.functional.cross_entropy(m(batch[0]), batch[1])
    else:
        inputs = torch.randint(spec.classes, (batch_size, *spec.input_shape), generator=gen)
        targets = torch.randint(spec.classes, (batch_size, *spec.input_shape), generator=gen)

        def loss_fn(m, batch):
            logits, _ = m(batch[0])
            return nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    return model, (inputs, targets), loss_fn

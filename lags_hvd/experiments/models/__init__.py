"""The paper's models (and ``FashionCNN`` for the real-data runs), written here
(torchvision does not install beside the pinned torch).

``build(name)`` returns ``(model, example_batch, loss_fn)`` for synthetic inputs of
the right shapes; ``MODELS`` lists the names.
"""

from .cifar import resnet20, vgg16
from .imagenet import inception_v4, resnet50
from .language import CharGPT, LSTMLanguageModel, lstm_ptb, lstm_ptb_small
from .registry import MODELS, build
from .small import FashionCNN

__all__ = [
    "MODELS",
    "build",
    "resnet20",
    "vgg16",
    "resnet50",
    "inception_v4",
    "lstm_ptb",
    "lstm_ptb_small",
    "LSTMLanguageModel",
    "CharGPT",
    "FashionCNN",
]

"""What happens to a bucket's gradient before selection, as small steps applied in order.

On the hook of a bucket's last member (``Bucket.start``)::

    densify           a torch.sparse gradient (nn.Embedding(sparse=True)) made dense
    clip_locally      local_clip: the bucket's share of the clip, before accumulation (DGC)
    decay             momentum correction: g + wd x, since the wrapped SGD then has none of its own

and then, in the residual memory, the loss scale's removal (``acc = eps + g / S``) and,
under momentum correction, the velocity (``u = m u + g``; ``acc = eps + u``).
"""

from __future__ import annotations

import warnings

import torch

from .clipping import clip_norm_

__all__ = ["densify", "clip_locally", "decay"]


def densify(params, names, sparse_dims: dict, quiet: bool) -> None:
    """Make every ``torch.sparse`` gradient of ``params`` dense, recording its sparse
    dimension in ``sparse_dims`` so it is handed back sparse after the exchange (as Horovod
    does); the first time, unless ``quiet`` (``sparse_as_dense``), warn of the dense buffer."""
    for p, name in zip(params, names):
        if p.grad is not None and p.grad.is_sparse:
            if not quiet and not sparse_dims:
                warnings.warn(
                    f"lags_hvd: parameter {name!r} has a torch.sparse gradient; it is densified "
                    f"for top-k selection, which costs a dense buffer of {p.numel()} entries "
                    "(pass sparse_as_dense=True to silence this)",
                    stacklevel=5,
                )
            sparse_dims[p] = p.grad.sparse_dim()
            p.grad = p.grad.to_dense()


def clip_locally(params, max_norm: float | None, scale: float) -> None:
    """``local_clip``: clip the gradients of ``params`` together to ``max_norm`` (the bucket's
    share, ``clipping.local_clip_norms``), the loss scale ``scale`` removed; None: no clip."""
    if max_norm is not None:
        clip_norm_([p.grad for p in params if p.grad is not None], max_norm, scale)


def decay(params, weight_decay: float, scale: float) -> None:
    """``g += wd x`` (times the loss scale) on every member, used in this pass or not."""
    if weight_decay:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.add_(p.detach(), alpha=weight_decay * scale)

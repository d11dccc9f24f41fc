"""The compressors of the methods built for Adam, as pure tensor functions (no backend).

``adam_methods`` composes them into the anchors the Adam frontier measures LAGS against:

* ``onebit_``: 1-bit Adam's and 0/1 Adam's compression with error feedback,
  ``c = (||z||_2 / sqrt(n)) sign(z)`` of ``z = x + e``, then ``e = z - c`` (a zero is sent as +1);
* ``Chunks``: DeMo's tiling of a tensor into blocks of at most ``target`` entries a side
  (the largest divisor of each dimension not above ``target``), optionally in the DCT-II
  basis of each block, and a top-k per block (DeMo, SparseLoCo);
* ``orthogonalize_``: PowerSGD's Gram-Schmidt over a matrix's columns.
"""

from __future__ import annotations

import math

import torch

__all__ = ["onebit_", "dct_basis", "smaller_divisor", "Chunks", "orthogonalize_"]


def onebit_(x: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """The 1-bit message of ``x + error`` (its scale times its signs); ``error`` becomes what
    the message left out. One scale per tensor: ``n`` bits and one word on the wire."""
    z = error.add_(x)
    scale = z.norm() / math.sqrt(z.numel())
    sent = torch.where(z >= 0, scale, -scale)
    error.sub_(sent)
    return sent


def dct_basis(n: int, dtype=torch.float32) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``B`` (``B @ x`` transforms, ``B.T @ y`` inverts):
    ``B[k, i] = sqrt(2 / n) c_k cos(pi (2 i + 1) k / (2 n))``, ``c_0 = 1 / sqrt(2)``, else 1."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    basis = math.sqrt(2 / n) * torch.cos(math.pi * (2 * i + 1) * k / (2 * n))
    basis[0] /= math.sqrt(2)
    return basis.to(dtype)


def smaller_divisor(n: int, target: int) -> int:
    """The largest divisor of ``n`` not above ``target`` (DeMo's block side)."""
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


class Chunks:
    """A tensor of ``shape`` as blocks: a matrix (``view(shape[0], -1)`` for more dimensions)
    as ``a x b`` blocks, a vector as runs of ``a``; ``dct`` puts each block in the DCT-II basis.

    ``encode`` gives ``(blocks, block_numel)``, ``decode`` inverts it exactly (up to rounding)."""

    def __init__(self, shape: torch.Size, target: int = 64, dct: bool = False, dtype=torch.float32):
        self.shape = torch.Size(shape)
        rows = self.shape[0] if self.shape else 1
        cols = self.shape.numel() // rows if len(self.shape) > 1 else 0
        self.sides = (smaller_divisor(rows, target),) + ((smaller_divisor(cols, target),) if cols else ())
        self.grid = (rows, cols) if cols else (rows,)
        self.bases = [dct_basis(side, dtype) for side in self.sides] if dct else None

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as ``(number of blocks, block numel)``, each block transformed if ``dct``."""
        if len(self.sides) == 1:
            blocks = x.reshape(-1, self.sides[0])
            return blocks @ self.bases[0].T if self.bases else blocks
        a, b = self.sides
        blocks = x.reshape(self.grid[0] // a, a, self.grid[1] // b, b).permute(0, 2, 1, 3)
        if self.bases:
            blocks = self.bases[0] @ blocks @ self.bases[1].T
        return blocks.reshape(-1, a * b)

    def decode(self, blocks: torch.Tensor) -> torch.Tensor:
        """The tensor of ``shape`` whose ``encode`` is ``blocks``."""
        if len(self.sides) == 1:
            x = blocks @ self.bases[0] if self.bases else blocks
            return x.reshape(self.shape)
        a, b = self.sides
        x = blocks.reshape(self.grid[0] // a, self.grid[1] // b, a, b)
        if self.bases:
            x = self.bases[0].T @ x @ self.bases[1]
        return x.permute(0, 2, 1, 3).reshape(self.shape)

    def take_top_(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The top ``k`` of each block of ``x`` (in the blocks' basis) taken out of ``x`` in
        place: ``(indices, values, taken)``, ``taken`` being what left ``x``, in its shape."""
        indices, values = self.top_k(self.encode(x), k)
        taken = self.decode(self.scatter(indices, values))
        x.sub_(taken)
        return indices, values, taken

    @staticmethod
    def top_k(blocks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` largest magnitudes of each block: ``(indices, values)``, each ``(blocks, k)``."""
        indices = blocks.abs().topk(min(k, blocks.shape[1]), dim=1, sorted=False).indices
        return indices, blocks.gather(1, indices)

    def scatter(self, indices: torch.Tensor, values: torch.Tensor, mean: bool = False) -> torch.Tensor:
        """Blocks of zeros holding ``values`` at ``indices``; with ``mean``, an index sent by
        several (the columns of ``indices`` concatenated over senders) holds their mean."""
        block_numel = math.prod(self.sides)
        out = values.new_zeros(self.shape.numel() // block_numel, block_numel)
        return out.scatter_reduce_(1, indices, values, reduce="mean" if mean else "sum", include_self=False)


def orthogonalize_(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Gram-Schmidt over the columns of ``matrix``, in place (PowerSGD's ``P`` and ``Q``)."""
    for i in range(matrix.shape[1]):
        column = matrix[:, i : i + 1]
        column /= column.norm() + epsilon
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest -= column * (column.T @ rest)
    return matrix

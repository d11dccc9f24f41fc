"""Per-rank training checkpoints that survive crashes (file logic only, no communication).

Layout: ``<folder>/checkpoint.rank<r>.step<N>.pt``, the newest ``keep`` per rank.

* ``save_atomically``: ``torch.save`` to a temporary file in the same folder,
  fsync, then rename: a crash (or a kill) while saving never damages an existing
  checkpoint; only complete files ever carry a checkpoint's name.
* A job killed between two ranks' saves leaves the ranks at different steps.
  ``load_newest`` therefore picks the newest step that *every* rank has, which is
  why each rank keeps more than one.
* A rank with no checkpoint of its own (the job now has more workers than the one
  that saved, or its file was lost) reads rank 0's. LAGS residuals are per worker;
  the optimizer resets them, with a warning, when the file belongs to another rank
  or another worker count (``DistributedOptimizer.load_state_dict``), so a residual
  is never sent twice.
* Files are loaded with ``weights_only=True``: tensors, numbers, strings and
  containers only. A file that needs code to load (a crafted pickle, or one from
  elsewhere) is refused with ``UnsafeCheckpointError`` and nothing of it runs.
* Each file carries the SHA-256 of its content (every tensor's bytes, dtype and shape,
  every key and number) under ``"checksum"``, checked at load: ``torch.load`` reads a
  tensor with a changed byte without complaint, so without it a damaged file would
  resume one rank on other weights for good. A file saved before checksums loads
  with a warning that it was not verified.
* A file that cannot be read (truncated, damaged outside this code, or no longer
  matching its checksum) raises ``UnreadableCheckpointError`` naming it;
  ``load_newest`` then falls back, on every rank alike, to the previous step every
  rank has, with a warning.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = [
    "save_atomically",
    "load_safely",
    "load_newest",
    "UnsafeCheckpointError",
    "UnreadableCheckpointError",
    "DamagedCheckpointError",
    "CheckpointDir",
    "checksum",
]

CHECKSUM = "checksum"
"""The key of a saved state's own digest (``checksum(state)``), removed again at load."""


class UnsafeCheckpointError(ValueError):
    """The file is not a plain checkpoint: loading it would run code."""


class UnreadableCheckpointError(ValueError):
    """The file cannot be read as a checkpoint (truncated or damaged)."""


class DamagedCheckpointError(UnreadableCheckpointError):
    """The file loads, but its content is not what was saved: it no longer matches its checksum."""


def checksum(state) -> str:
    """``"sha256:<hex>"`` of ``state``'s content: containers walked in order, each tensor's
    dtype, shape and bytes, every other value's type and repr (exact for numbers). The
    content, not the file's bytes, so that it can travel inside the file it describes."""
    digest = hashlib.sha256()

    def feed(tag: str, data: bytes) -> None:
        digest.update(f"{tag}:{len(data)}:".encode())
        digest.update(data)

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            feed(f"tensor {value.dtype} {tuple(value.shape)}", flat.view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            feed("dict", str(len(value)).encode())
            for key, item in value.items():
                walk(key)
                walk(item)
        elif isinstance(value, (list, tuple)):
            feed("sequence", str(len(value)).encode())
            for item in value:
                walk(item)
        else:
            feed(type(value).__name__, repr(value).encode())

    walk(state)
    return f"sha256:{digest.hexdigest()}"


def load_safely(path) -> dict:
    """``torch.load(path, weights_only=True)``, its checksum verified and removed; a file that
    needs more raises ``UnsafeCheckpointError`` naming it, and none of its code runs; one whose
    content differs from its checksum raises ``DamagedCheckpointError``."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as refused:
        raise UnsafeCheckpointError(
            f"{path} is not a plain checkpoint (tensors, numbers, strings, containers): loading it "
            f"would run code, so it is refused. Torch said: {_first_line(refused)}"
        ) from None
    except (RuntimeError, EOFError, OSError) as broken:
        raise UnreadableCheckpointError(
            f"{path} cannot be read as a checkpoint (truncated or damaged?): {_first_line(broken)}"
        ) from broken
    if not isinstance(state, dict) or CHECKSUM not in state:
        warnings.warn(f"{path} carries no checksum (saved before checksums): loaded unverified", stacklevel=2)
        return state
    saved = state.pop(CHECKSUM)
    if checksum(state) != saved:
        raise DamagedCheckpointError(
            f"{path} cannot be read as the checkpoint saved there: its content no longer matches the "
            "checksum saved with it (a byte changed after the save: a damaged disk or copy?)"
        )
    return state


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0][:300]


def save_atomically(state: dict, path: Path) -> None:
    """Write ``state`` and its checksum with torch.save so that ``path`` is either the old file
    or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save({**state, CHECKSUM: checksum(state)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class CheckpointDir:
    """One rank's view of a checkpoint folder."""

    PATTERN = re.compile(r"checkpoint\.rank(\d+)\.step(\d+)\.pt")

    def __init__(self, folder: Path, rank: int, keep: int = 2):
        if keep < 2:
            raise ValueError(
                "keep at least 2 checkpoints per rank: ranks killed between their "
                "saves need the previous one to agree on a step"
            )
        self.folder, self.rank, self.keep = Path(folder), rank, keep

    def path(self, step: int, rank: int | None = None) -> Path:
        return self.folder / f"checkpoint.rank{self.rank if rank is None else rank}.step{step}.pt"

    def steps(self, rank: int | None = None) -> list[int]:
        """Steps of the complete checkpoints of ``rank`` (this rank by default), ascending."""
        rank = self.rank if rank is None else rank
        found = (self.PATTERN.fullmatch(p.name) for p in self.folder.glob("checkpoint.rank*.step*.pt"))
        return sorted(int(m[2]) for m in found if m and int(m[1]) == rank)

    def available(self) -> list[int]:
        """Steps this rank can resume from: its own, else rank 0's."""
        return self.steps() or self.steps(0)

    def save(self, state: dict, step: int) -> Path:
        """Save atomically, then delete this rank's checkpoints older than the newest ``keep``."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(step)
        save_atomically(state, path)
        for old in self.steps()[: -self.keep]:
            self.path(old).unlink(missing_ok=True)
        return path

    def load(self, step: int) -> dict:
        path = self.path(step)
        return load_safely(path if path.exists() else self.path(step, 0))


def load_newest(checkpoints: CheckpointDir, gather: Callable[[object], list]) -> tuple[int, dict]:
    """The newest step every rank has and can read, and this rank's state of it.
    Collective: ``gather(x)`` returns every rank's ``x`` in rank order, so the ranks choose
    the same step. A step that some rank cannot read (``UnreadableCheckpointError``) is
    passed over with a warning naming the file; a file that would run code
    (``UnsafeCheckpointError``) stops the resume on its rank. FileNotFoundError, on every
    rank, when no step is left."""
    per_rank = gather(checkpoints.available())
    for step in sorted(set(per_rank[0]).intersection(*per_rank[1:]), reverse=True):
        try:
            state, problem = checkpoints.load(step), None
        except UnreadableCheckpointError as unreadable:
            state, problem = None, str(unreadable)
        problems = [p for p in gather(problem) if p is not None]
        if not problems:
            return step, state
        warnings.warn(
            f"--resume: step {step} cannot be resumed ({'; '.join(problems)}); trying the "
            "previous checkpoint every rank has",
            stacklevel=2,
        )
    raise FileNotFoundError(
        f"no checkpoint step that all {len(per_rank)} workers can load in "
        f"{checkpoints.folder} (steps per rank: {per_rank})"
    )

"""Ranks agree, or every rank fails with the same clear error.

Two checks, both cheap next to the exchanges they guard:

* **At construction**, ``agree_on_settings``: one object allgather of each rank's
  settings (the model's parameters, the exchange units, k per unit or the adaptive
  bounds, every option that changes the math) or of the error its own validation
  raised. Every rank compares all of them and raises the same ``RanksDisagreeError``
  naming the first difference, before any gradient is exchanged.
* **Every iteration**, ``StepToken``: an allreduce (sum) of a P x 8 integer matrix in
  which each rank fills its own row, started by the iteration's first backward hook
  (so its latency hides behind backprop) and checked in ``synchronize()`` first,
  before any exchange is waited for::

      [ 1 (training), 2 (in lags_hvd.join()) or 3 (in average_models()), iteration,
        fresh gradients (0/1), digest of every unit's k,
        1 + position of the first parameter whose requires_grad changed (0: none),
        the loss scale's float64 bits (1.0 without a GradScaler),
        digest of the wrapped optimizer's hyper-parameters (lr, momentum, betas, ...),
        digest of the optimizer's collective names (which optimizer's check this is) ]

  A rank in ``lags_hvd.join()`` (out of batches) keeps taking part with zero gradients
  and a row marked 2, which the checks leave out; ``check`` says who has joined, the
  iteration of the ranks still training, and which rank joined last. (Horovod's own
  ``hvd.join()`` cannot serve: it runs no allgather or alltoall while a rank is in it.)

  "Fresh" means a backward pass ran on this rank since its last step, or every
  gradient is None or zero (an empty batch, which Horovod allows); a rank that calls
  ``step()`` twice sends the previous step's merged gradients, which are neither.
  Horovod matches collectives by name only, so a rank a step ahead or behind, one
  that called ``step()`` twice, one whose k drifted, one that froze a parameter,
  one whose GradScaler scales differently or one whose learning rate was changed alone
  would otherwise be summed with the others silently (or hang at the end). With the
  token every rank raises the same ``OutOfStepError`` naming the ranks and values.
  ``average_models()`` sends a row marked 3 first, so a rank that calls it alone meets the
  others' next check and every rank names it, instead of a collective of another size.
  On a backend that matches collectives by order, two optimizers whose checks crossed
  (their exchanges started in different orders on different ranks) are named as such.
"""

from __future__ import annotations

import collections
import struct
import zlib
from collections.abc import Callable
from typing import NamedTuple

import torch

from .collectives import Collectives, allgather_object
from .errors import OutOfStepError, RanksDisagreeError

__all__ = ["agree_on_settings", "settings_to_agree", "hyperparameter_digest", "k_digest", "StepCheck", "StepToken"]


def _first_difference(mine, theirs) -> str:
    """Where two settings values differ, for the error message."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in list(mine) + [k for k in theirs if k not in mine]:
            if mine.get(key, "<absent>") != theirs.get(key, "<absent>"):
                return f"[{key!r}]: {mine.get(key, '<absent>')!r:.200} vs {theirs.get(key, '<absent>')!r:.200}"
    return f": {mine!r:.300} vs {theirs!r:.300}"


def _model_difference(mine: list, theirs: list, rank: int) -> str:
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return (
                f"the model differs across ranks: parameter #{i} is {a} on rank 0 but {b} on "
                f"rank {rank} of the process set"
            )
    return f"the model differs across ranks: rank 0 has {len(mine)} trainable parameters, rank {rank} has {len(theirs)}"


def agree_on_settings(
    settings: dict | None, error: BaseException | None, collectives: Collectives, timeout: float | None
) -> None:
    """Collective: raise on every rank unless every rank validated the same ``settings``.

    ``settings`` maps a setting's name to a picklable value; ``"model"`` holds the list of
    ``(name, shape, dtype)`` of the trainable parameters. A rank whose own validation
    failed passes its ``error`` (and None): it re-raises it, the others raise
    ``RanksDisagreeError`` quoting it, so no rank is left waiting in a collective.
    """
    report = None if error is None else f"{type(error).__name__}: {error}"
    gathered = allgather_object(collectives, (settings, report), "lags.settings", timeout)
    if error is not None:
        raise error
    ranks = collectives.global_ranks
    for rank, (_, theirs) in zip(ranks, gathered):
        if theirs is not None:
            raise RanksDisagreeError(
                f"rank {rank} refused its DistributedOptimizer settings ({theirs}); "
                "every rank stops here, before any exchange"
            )
    reference = gathered[0][0]
    for rank, (other, _) in zip(ranks, gathered):
        if other == reference:
            continue
        if other["model"] != reference["model"]:
            raise RanksDisagreeError(_model_difference(reference["model"], other["model"], rank))
        for key in reference:
            if other.get(key) != reference[key]:
                raise RanksDisagreeError(
                    f"ranks disagree on {key}{_first_difference(reference[key], other.get(key))} "
                    f"(rank {ranks[0]} vs rank {rank}); these settings must be identical on every rank, "
                    "and every rank stops here, before any exchange"
                )


def settings_to_agree(units, k: dict, options, context, wiring, wrapped_class: type, param_groups) -> dict:
    """What every rank of one optimizer must set alike (``agree_on_settings`` compares it):
    the model, its units and k, the options and the update rule in force, the
    wrapped optimizer's class and param groups' keys and parameters (the keys' values are
    compared at every step, so that Horovod's pattern of aligning them with
    ``broadcast_optimizer_state`` works), and how the exchanges reduce (``wiring``: the
    front-end's ``optimizer.Wiring``)."""
    config = context.config
    names = {p: name for name, p, _ in context.watched}
    return {
        "model": [
            (name, tuple(p.shape), str(p.dtype)) for unit in units for name, p in zip(unit.param_names, unit.params)
        ],
        "exchange units": [unit.name for unit in units],
        "collective names": config.namespace,
        "k": dict(k),
        "options": options.shared_settings(),
        "update rule in force": context.rule.name,
        "wrapped optimizer": {
            "class": wrapped_class.__qualname__,
            "param groups": [
                {
                    "keys": sorted(key for key in group if key != "params"),
                    "parameters": [names[p] for p in group["params"]],
                }
                for group in param_groups
            ],
        },
        "exchange": {
            "op": "average" if config.average else "sum",
            "gradient_predivide_factor": config.gradient_predivide_factor,
            "compression": getattr(config.compression, "__name__", type(config.compression).__name__),
            "backward_passes_per_step": wiring.backward_passes_per_step,
            "sparse_as_dense": bool(wiring.sparse_as_dense),
        },
    }


def hyperparameter_digest(param_groups) -> int:
    """A 31-bit digest of every param group's hyper-parameters (every key but ``params``),
    as the settings agreement compares them at construction. A tensor off the CPU (a
    capturable lr on a GPU) is left out: reading it here, in a backward hook, would wait
    for its stream."""
    parts = []
    for group in param_groups:
        for key in sorted(group):
            value = group[key]
            if key == "params" or isinstance(value, torch.Tensor) and value.device.type != "cpu":
                continue
            parts.append(f"{key}={value.tolist() if isinstance(value, torch.Tensor) else value!r}")
    return zlib.crc32("\0".join(parts).encode()) & 0x7FFFFFFF


def k_digest(k: dict[str, int]) -> int:
    """A 31-bit digest of every unit's name and k (identical buckets and plans, identical digests)."""
    return zlib.crc32(",".join(f"{name}={value}" for name, value in sorted(k.items())).encode()) & 0x7FFFFFFF


_NAMESPACES_TAKEN: collections.Counter = collections.Counter()


def wire_namespace(parameter_names: list[str]) -> str:
    """The prefix of every collective one optimizer starts, the same on every rank:
    ``lags.<crc32 of its parameters' names>.<n>``, n the number of optimizers over the
    same names this process made before it. Horovod matches collectives by name, so two
    optimizers of one process whose exchanges may be in flight at once (a GAN's two, a
    model and a copy of it) must not share a name; optimizers over different parameters
    get theirs whatever order they are made in, and copies of one model in the order
    every rank makes them (the settings agreement compares the result)."""
    digest = f"{zlib.crc32(chr(0).join(sorted(parameter_names)).encode()):08x}"
    ordinal = _NAMESPACES_TAKEN[digest]
    _NAMESPACES_TAKEN[digest] += 1
    return f"lags.{digest}.{ordinal}"


def release_namespace(namespace: str) -> None:
    """Give back ``wire_namespace``'s latest name when the optimizer that took it was refused
    (a rank refused its options, the ranks' settings differ): a rank that refused before taking
    one and a rank that took one then stay alike, so every rank's next optimizer over the same
    parameters gets the same name. A name taken before a later one stays taken."""
    _, digest, ordinal = namespace.split(".")
    if _NAMESPACES_TAKEN[digest] == int(ordinal) + 1:
        _NAMESPACES_TAKEN[digest] -= 1


class StepCheck(NamedTuple):
    """What a passed step check says: ``joined``, the ranks in ``lags_hvd.join()``;
    ``iteration``, that of the ranks still training (None when every rank has joined);
    ``last``, the rank that joined last (the most iterations; the lowest such rank)."""

    joined: list[int]
    iteration: int | None
    last: int


TRAINING, JOINED, AVERAGING = 1, 2, 3  # a row's first field


class StepToken:
    """The per-iteration agreement check (see the module docstring). ``start`` once per
    iteration, ``check`` in ``synchronize()`` before any exchange is waited for."""

    FIELDS = 8

    def __init__(self, collectives: Collectives, timeout: float | None, namespace: str):
        self._collectives, self._timeout = collectives, timeout
        self._handle = None
        self._iteration = 0
        self.name = f"{namespace}.step"  # the optimizer's own (``wire_namespace``)
        self._owner = zlib.crc32(namespace.encode()) & 0x7FFFFFFF

    @property
    def started(self) -> bool:
        return self._handle is not None

    def start(
        self,
        iteration: int,
        fresh: bool,
        digest: int,
        changed: int,
        loss_scale: float,
        hyperparameters: int,
        kind: int = TRAINING,
    ) -> None:
        """Post this rank's row; ``kind``: ``TRAINING``, ``JOINED`` or ``AVERAGING``."""
        self._iteration = iteration
        scale_bits = struct.unpack("<q", struct.pack("<d", loss_scale))[0]
        token = torch.zeros(self._collectives.size, self.FIELDS, dtype=torch.int64)
        token[self._collectives.rank] = torch.tensor(
            [kind, iteration, int(fresh), digest, changed, scale_bits, hyperparameters, self._owner],
            dtype=torch.int64,
        )
        self._handle = self._collectives.allreduce(
            token, self.name, "sum", what=f"the step check '{self.name}' of iteration {iteration}"
        )

    def forget(self) -> None:
        """Drop an unchecked token (an error came first; waiting on it could hang)."""
        self._handle = None

    def done(self) -> bool:
        """Whether every rank's token has arrived (``check`` will not wait)."""
        return self._collectives.done(self._handle)

    def crossed(self) -> OutOfStepError | None:
        """Without waiting: where this check has arrived and holds another optimizer's row (their
        checks crossed), the error ``check`` would raise; else None. For a rank whose own check
        lost its partner, so that it names the crossing too, not only the peer that left."""
        if self._handle is None or not self.done():
            return None
        rows = self._collectives.wait(self._handle, f"the step check '{self.name}'", self._timeout).tolist()
        try:
            self._check_owner_and_averaging(self._collectives.global_ranks, rows)
        except OutOfStepError as error:
            return error
        return None

    def verdict(self, parameter_name: Callable[[int], str]) -> OutOfStepError | None:
        """Without waiting: where this check has arrived and finds the ranks out of step, the
        ``OutOfStepError`` ``check`` raises; else None. For a rank that lost a peer after the
        check arrived: the peer that read the check first raised that error and left, so this
        rank names the same cause, not only the loss."""
        if self._handle is None or not self.done():
            return None
        try:
            self.check(parameter_name)
        except OutOfStepError as error:
            return error
        except Exception:  # the check failed too (the peer's loss): the caller's error says it
            pass
        return None

    def check(self, parameter_name: Callable[[int], str]) -> StepCheck:
        """Wait for every rank's token; raise ``OutOfStepError`` unless every rank still
        training agrees with the others."""
        handle, self._handle = self._handle, None
        rows = self._collectives.wait(
            handle, f"the step check '{self.name}' of iteration {self._iteration}", self._timeout
        ).tolist()
        ranks = self._collectives.global_ranks
        self._check_owner_and_averaging(ranks, rows)
        if rows[0][0] == AVERAGING:  # every rank is in average_models()
            return StepCheck([], self._iteration, ranks[0])
        absent = [rank for rank, row in zip(ranks, rows) if row[0] not in (TRAINING, JOINED)]
        if absent:
            raise OutOfStepError(
                f"ranks {absent} sent no step check at iteration {self._iteration}: they called Horovod's own "
                "horovod.torch.join(), under which Horovod runs no allgather. Ranks out of batches call "
                "lags_hvd.join() instead (import lags_hvd as hvd; hvd.join())"
            )
        joined = [rank for rank, row in zip(ranks, rows) if row[0] == JOINED]
        last = max(zip(ranks, rows), key=lambda rank_row: (rank_row[1][1], -rank_row[0]))[0]
        present = [(rank, row[1:7]) for rank, row in zip(ranks, rows) if row[0] == TRAINING]
        if not present:
            return StepCheck(joined, None, last)
        return StepCheck(joined, _agreed_iteration(present, parameter_name), last)

    def _check_owner_and_averaging(self, ranks: list[int], rows: list[list[int]]) -> None:
        """``OutOfStepError`` where a row is another optimizer's (two optimizers' checks
        crossed) or where some ranks, not all, are in ``average_models()``."""
        foreign = [rank for rank, row in zip(ranks, rows) if row[0] and row[7] != self._owner]
        if foreign:
            raise OutOfStepError(
                f"the step check '{self.name}' of iteration {self._iteration} met another optimizer's on ranks "
                f"{foreign}: the ranks started two optimizers' collectives in different orders. torch.distributed "
                "matches collectives by order, and where one backward pass feeds two DistributedOptimizers, a "
                "parameter unused on some ranks starts its optimizer's exchanges later there. Give both "
                "optimizers' parameters to one DistributedOptimizer (a param group each), run a backward pass per "
                "optimizer, or make every rank use every parameter"
            )
        averaging = [rank for rank, row in zip(ranks, rows) if row[0] == AVERAGING]
        if averaging and len(averaging) < len(ranks):
            others = [rank for rank in ranks if rank not in averaging]
            raise OutOfStepError(
                f"average_models() is collective: ranks {averaging} called it, ranks {others} did not (they "
                f"went on to iteration {self._iteration} or joined). Call it on every rank at the same point, "
                "after step()"
            )


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _agreed_iteration(present: list[tuple[int, list]], parameter_name: Callable[[int], str]) -> int:
    """The iteration every training rank's row (``(rank, row[1:7])`` in ``present``) agrees on;
    ``OutOfStepError`` naming the first difference otherwise."""
    for rank, (_, _, _, changed, _, _) in present:
        if changed:
            raise OutOfStepError(
                f"rank {rank}: parameter {parameter_name(changed - 1)!r} changed requires_grad after "
                "DistributedOptimizer() was built, so its gradient would no longer be exchanged (or "
                "would be trained while frozen). Build a new optimizer and wrap it again, on every "
                "rank, after changing which parameters train."
            )
    first_rank, (iteration0, fresh0, digest0, _, scale0, hyper0) = present[0]
    for rank, (iteration, fresh, digest, _, scale, hyper) in present:
        if iteration != iteration0:
            raise OutOfStepError(
                f"ranks are out of step: rank {first_rank} is at iteration {iteration0}, rank {rank} at "
                f"iteration {iteration}. A rank called step() more or fewer times than the others or "
                "resumed from another checkpoint (after loading on one rank only, or after hvd.join(), "
                "call lags_hvd.broadcast_optimizer_state, which also shares the LAGS iteration and plan)."
            )
        if fresh != fresh0:
            without, with_ = (first_rank, rank) if not fresh0 else (rank, first_rank)
            raise OutOfStepError(
                f"ranks are out of step at iteration {iteration0}: rank {without} reached step() or "
                f"synchronize() with no backward pass since its last step and non-zero gradients, "
                f"rank {with_} after one (step() called twice?)"
            )
        if digest != digest0:
            raise OutOfStepError(
                f"ranks send different k at iteration {iteration0} (plan digest {digest0} on rank "
                f"{first_rank}, {digest} on rank {rank}): their density plans diverged"
            )
        if scale != scale0:
            raise OutOfStepError(
                f"ranks scale their losses differently at iteration {iteration0}: {_float(scale0):g} on rank "
                f"{first_rank}, {_float(scale):g} on rank {rank} (each rank's GradScaler must start from the "
                "same init_scale and be enabled alike)"
            )
        if hyper != hyper0:
            raise OutOfStepError(
                f"the wrapped optimizer's hyper-parameters differ between rank {first_rank} and rank {rank} "
                f"at iteration {iteration0} (lr, momentum, weight decay, betas, ...: digest {hyper0} vs "
                f"{hyper}): one was changed on some ranks only (a scheduler stepped, or a param group "
                "edited, on one rank); every rank must change them alike"
            )
    return iteration0

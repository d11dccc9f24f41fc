"""Measurements the density planner needs: backprop timing and the network's cost models.

* ``BackwardTimer``: per exchange unit, when its gradient became ready (relative to the
  first hook of the iteration) and how long its selection took, over a window of recent
  iterations; stamped with the host's clock, or with CUDA events where the parameters are
  on a GPU (``DeviceStamps``: the device's times, not the launches').
* ``profile_network``: times allgather and allreduce of a few sizes across all
  ranks (the slowest rank counts); ``fit_cost_model`` makes each a cost model through
  the samples (``alpha + beta * bytes`` beyond them).
* ``save_network_profile`` / ``load_network_profile``: the fitted models as JSON,
  validated on load (fields, number of workers).
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections import deque
from pathlib import Path

import numpy as np

from .planner import CostModel, NetworkModel, UnitProfile
from .sparse import index_dtype_for

__all__ = [
    "BackwardTimer",
    "DeviceStamps",
    "HostStamps",
    "monotone",
    "fit_cost_model",
    "profile_network",
    "save_network_profile",
    "load_network_profile",
    "DEFAULT_SIZES",
    "sizes_up_to",
]

DEFAULT_SIZES = tuple(2**e for e in range(10, 23, 2))  # 1 KiB .. 4 MiB


def sizes_up_to(nbytes: float) -> tuple[int, ...]:
    """The ``DEFAULT_SIZES`` a model whose largest message is ``nbytes`` needs measured: those
    below it and the first at or above it (at least two, for a fit), so a small model on a
    slow link is not held up timing 4 MiB collectives it never sends."""
    count = next((i + 1 for i, size in enumerate(DEFAULT_SIZES) if size >= nbytes), len(DEFAULT_SIZES))
    return DEFAULT_SIZES[: max(2, count)]


class HostStamps:
    """Stamps of the host's clock: a stamp is the time itself (on a CPU, where the work a hook
    launches is done when the hook returns)."""

    def __init__(self, clock=time.perf_counter):
        self._clock = clock

    def stamp(self) -> float:
        return self._clock()

    def seconds(self, stamps: list) -> list[float]:
        return stamps


class DeviceStamps:
    """Stamps of a CUDA stream: a stamp is an event recorded where the stream has got to, so
    a hook's stamps time the device's work, not the launches. ``seconds`` waits for the last
    event once and reads every stamp of the iteration; the events are reused from iteration
    to iteration (``event``: ``torch.cuda.Event``'s constructor, replaceable for tests)."""

    def __init__(self, event=None):
        import torch

        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._pool: list = []
        self._used = 0

    def stamp(self):
        if self._used == len(self._pool):
            self._pool.append(self._event())
        event = self._pool[self._used]
        self._used += 1
        event.record()
        return event

    def seconds(self, stamps: list) -> list[float]:
        """Each stamp's seconds after the iteration's first (one wait for the device)."""
        self._used = 0
        if not stamps:
            return []
        stamps[-1].synchronize()
        first = stamps[0]
        return [first.elapsed_time(event) / 1000.0 for event in stamps]


class BackwardTimer:
    """Hook timestamps and selection times of the last ``window`` iterations.

    ``stamps``: where the hooks' times come from (``HostStamps``, or ``DeviceStamps`` for
    parameters on a GPU); they are turned into seconds once per iteration, at its end."""

    def __init__(self, window: int = 5, clock=time.perf_counter, stamps=None):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._clock = clock
        self._stamps = stamps or HostStamps(clock)
        self.stamp = self._stamps.stamp
        """A hook's stamp (``stamps``): where its bucket's work stands now."""
        self._iterations: deque[dict[str, tuple[float, float]]] = deque(maxlen=window)
        self._marks: list[tuple[str, object, object]] = []  # this iteration's (unit, ready, selected)
        self._last_end: float | None = None
        self.last_synchronize = {"wait": 0.0, "merge": 0.0, "merge_shared": 0.0, "zero": 0.0, "select": 0.0}
        self.iteration_seconds: deque[float] = deque(maxlen=64)  # between consecutive ends

    def now(self) -> float:
        """The host's clock (``synchronize()``'s phases)."""
        return self._clock()

    def unit_ready(self, name: str, ready, selected) -> None:
        """Unit ``name``'s gradient was ready at stamp ``ready``; its selection done at ``selected``."""
        self._marks.append((name, ready, selected))

    def _current(self) -> dict[str, tuple[float, float]]:
        """This iteration's ``{unit: (ready after the first unit, selection seconds)}``."""
        seconds = self._stamps.seconds([stamp for _, ready, selected in self._marks for stamp in (ready, selected)])
        first = seconds[0] if seconds else 0.0
        return {
            name: (seconds[2 * i] - first, seconds[2 * i + 1] - seconds[2 * i])
            for i, (name, _, _) in enumerate(self._marks)
        }

    def end_iteration(
        self, wait: float = 0.0, merge: float = 0.0, zero: float = 0.0, merge_shared: float = 0.0
    ) -> None:
        """Close the iteration; ``wait``, ``merge`` and ``zero``: seconds ``synchronize()``
        spent waiting for the network, merging, and zeroing the merge targets (work per
        element, the same for any bucketing); ``merge_shared``: the part of ``merge`` done
        once per arena or iteration (the same for any bucketing). Kept with the selection total in
        ``last_synchronize``."""
        current = self._current()
        self.last_synchronize = {
            "wait": wait,
            "merge": merge,
            "merge_shared": merge_shared,
            "zero": zero,
            "select": sum(s for _, s in current.values()),
        }
        now = self._clock()
        if self._last_end is not None:
            self.iteration_seconds.append(now - self._last_end)
        self._last_end = now
        if current:
            self._iterations.append(current)
        self._marks = []

    @property
    def iterations(self) -> int:
        return len(self._iterations)

    def profile(self, units) -> list[UnitProfile]:
        """Median ready and selection times per unit over the window.

        A unit never seen during backprop (unused on this rank) is placed at the end
        of backprop with no selection cost.
        """
        if not self._iterations:
            raise RuntimeError("no backward pass has been timed yet")
        end = max(r for it in self._iterations for r, _ in it.values())
        profiles = []
        for unit in units:
            seen = [it[unit.name] for it in self._iterations if unit.name in it]
            ready = statistics.median(r for r, _ in seen) if seen else end
            select = statistics.median(s for _, s in seen) if seen else 0.0
            profiles.append(
                UnitProfile(
                    unit.name,
                    unit.numel,
                    ready,
                    select,
                    value_bytes=unit.dtype.itemsize,
                    index_bytes=index_dtype_for(unit.numel).itemsize,
                )
            )
        return profiles


def monotone(seconds) -> list[float]:
    """The non-decreasing sequence nearest ``seconds`` in least squares (pool adjacent
    violators): a larger message never costs less, and one noisy sample moves no more
    than its neighbours' mean."""
    blocks: list[list[float]] = []  # [mean, count]
    for t in seconds:
        blocks.append([float(t), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(n)]


def fit_cost_model(nbytes, seconds) -> CostModel:
    """The cost model of measured (bytes, seconds) samples: through the samples, made
    non-decreasing (``monotone``; repeated sizes averaged), and beyond them the slope of the
    least-squares line ``alpha + beta * bytes`` (both clamped at zero), which
    ``alpha`` and ``beta`` report."""
    nbytes, seconds = np.asarray(nbytes, float), np.asarray(seconds, float)
    if nbytes.size < 2 or np.ptp(nbytes) == 0:
        raise ValueError("fitting a cost model needs at least two different sizes")
    beta, alpha = np.polyfit(nbytes, seconds, 1)
    if alpha < 0:  # refit through the origin
        alpha, beta = 0.0, float(np.dot(nbytes, seconds) / np.dot(nbytes, nbytes))
    sizes = np.unique(nbytes)
    means = [float(seconds[nbytes == size].mean()) for size in sizes]
    points = tuple(zip(map(float, sizes), monotone(means)))
    return CostModel(float(max(alpha, 0.0)), float(max(beta, 0.0)), points)


def profile_network(collectives, sizes=DEFAULT_SIZES, repeats: int = 5) -> tuple[NetworkModel, dict]:
    """Time the collectives on every member of ``collectives`` (all must call it) and fit them.

    Returns the model and the raw samples ``{"allgather": [[bytes, s], ...], "allreduce": ...}``.
    Each time is the slowest rank's median over ``repeats`` (after one warm-up).
    """
    import torch

    samples = {"allgather": [], "allreduce": []}
    for nbytes in sizes:
        for kind in samples:
            if kind == "allgather":
                tensor = torch.zeros(nbytes, dtype=torch.uint8)
                start = functools.partial(collectives.allgather, tensor, f"lags.profile.ag.{nbytes}")
            else:
                tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
                start = functools.partial(collectives.allreduce, tensor, f"lags.profile.ar.{nbytes}", "sum")
            times = []
            for _ in range(repeats + 1):  # one name per size: a response cache applies, as for the exchanges
                collectives.barrier()
                begin = time.perf_counter()
                collectives.wait(start(), f"the network profile at {nbytes} bytes", None)
                times.append(time.perf_counter() - begin)
            local = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
            slowest = collectives.wait(
                collectives.allreduce(local, f"lags.profile.max.{kind}.{nbytes}", "max"), "the network profile", None
            ).item()
            samples[kind].append([nbytes, slowest])
    model = NetworkModel(
        collectives.size, fit_cost_model(*zip(*samples["allgather"])), fit_cost_model(*zip(*samples["allreduce"]))
    )
    return model, samples


def save_network_profile(model: NetworkModel, path, samples: dict | None = None) -> None:
    data = dict(model.to_dict(), samples=samples or {})
    Path(path).write_text(json.dumps(data, indent=1))


def load_network_profile(path, world_size: int | None = None) -> NetworkModel:
    """Read a profile written by ``save_network_profile``; clear errors for bad files."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"cannot read network profile {path}: {error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"network profile {path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"network profile {path} must hold a JSON object")
    return NetworkModel.from_dict(data, world_size)

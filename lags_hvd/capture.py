"""A bucket's top-k selection as a CUDA graph: one launch in place of seven kernels.

On a GPU the hook of a sparse bucket costs host time per kernel it launches, whatever the
bucket's size (docs/gpu.md: 0.3 to 0.8 ms a bucket). Most of those kernels are the selection,
``select_torch(acc, k)``: the magnitude keys, the composite with the positions, ``topk``, the
sort of the k indices and the gather of their values. None of them reads a value to the host
or has a size that depends on the data, so the whole selection can be captured once and
replayed (``torch.cuda.CUDAGraph``).

``CapturedSelection`` (one per bucket, ``LAGSOptions.cuda_graphs``) holds a graph per

    (the address, size and dtype of acc, k)

and replays it: acc is the bucket's range of the residual memory's staging buffer, one of
two addresses (the buffers swap at each commit), and k is fixed between the density
warm-up's stages and the plans, so a bucket holds two graphs, and drops them when its k
changes. A graph reads acc where it lies at replay time, so any tensor at that address, of
that size and dtype, is selected correctly.

What a graph costs: its capture synchronises the device and empties the allocator's cache
(``torch.cuda.graph``), once per bucket, buffer and k (the first two iterations, each stage
of the density warm-up, each plan that changes k). Every graph on a device captures its
temporaries from one memory pool and replays on one stream, in turn, whatever the order of
the buckets: so the pool holds about the largest bucket's temporaries (12 bytes an entry up
to ``COMPOSITE_MAX``, about 17 above), not every bucket's. Each replay waits for the current
stream and makes it wait in turn.

Its outputs, the values and the indices, are two tensors of its own, allocated outside the
pool (so that no other graph's temporaries can land on them) and rewritten by its next
replay, in a later iteration: the optimizer is done with a bucket's selection by the end of
the iteration it was made in. An exchange observer that keeps them must copy them first.

The accumulate, ``acc = eps + g``, stays outside the graph: the gradients' addresses change
whenever the user sets ``.grad`` to None, so a graph that read them would have to be
recaptured or fed by a copy, an extra pass over gradient memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from . import selection

__all__ = ["CapturedSelection", "GRAPHS_PER_BUCKET", "CAPTURABLE", "capturable", "cuda_graph"]

GRAPHS_PER_BUCKET = 4  # two staging buffers at one k; more only if a bucket's buffers move
CAPTURABLE = (selection.select_sampled, selection.select_torch)
"""The selectors whose CUDA path (``select_torch``) a graph captures; a user's callable runs as
it is (it may read to the host)."""

Selection = tuple[torch.Tensor, torch.Tensor]


def capturable(device: torch.device) -> bool:
    """Whether a selection on ``device`` can be captured: CUDA devices."""
    return device.type == "cuda"


def cuda_graph(run: Callable[[], Selection], device: torch.device) -> Callable[[], Selection]:
    """``run`` captured as a CUDA graph in ``device``'s pool and on its stream (``_resources``):
    run once there first (the libraries' lazy set-up, which must not be captured), then
    captured. The replay runs the graph on that stream, after the current stream's work and
    before any the current stream queues next, and returns the graph's outputs."""
    pool, stream = _resources(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        outputs = run()

    def replay() -> Selection:
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            graph.replay()
        current.wait_stream(stream)
        return outputs

    return replay


class CapturedSelection:
    """``select_torch(x, k)`` replayed from a graph per (x's address, size and dtype, k);
    ``capture(run, device)`` makes the graph of ``run`` (``cuda_graph``)."""

    def __init__(self, capture: Callable, limit: int = GRAPHS_PER_BUCKET):
        self._capture, self._limit = capture, limit
        self._graphs: OrderedDict[tuple, Callable[[], Selection]] = OrderedDict()

    def __call__(self, x: torch.Tensor, k: int) -> Selection:
        key = (x.data_ptr(), x.numel(), x.dtype, k)
        replay = self._graphs.get(key)
        if replay is None:
            for held in [held for held in self._graphs if held[3] != k]:  # k changed: the old graphs go
                del self._graphs[held]
            if len(self._graphs) >= self._limit:
                self._graphs.popitem(last=False)
            replay = self._graphs[key] = self._capture(_selection_into(x, k), x.device)
        else:
            self._graphs.move_to_end(key)
        return replay()

    def __len__(self) -> int:
        """The graphs held."""
        return len(self._graphs)

    def reset(self) -> None:
        """Drop every graph."""
        self._graphs.clear()


def _selection_into(x: torch.Tensor, k: int) -> Callable[[], Selection]:
    """``select_torch(x, k)`` copied into two tensors of its own, allocated here (outside any
    capture): a graph's outputs, which no other graph's work can land on."""
    values = torch.empty(k, dtype=x.dtype, device=x.device)
    indices = torch.empty(k, dtype=torch.int64, device=x.device)
    positions = _positions(x.device)

    def run() -> Selection:
        found_values, found_indices = selection.select_torch(x, k, positions=positions)
        values.copy_(found_values)
        indices.copy_(found_indices)
        return values, indices

    return run


_POSITIONS: dict = {}
_RESOURCES: dict = {}


def _positions(device: torch.device) -> torch.Tensor:
    """``arange(COMPOSITE_MAX)`` on ``device``, which every graph there reads: made once and
    never replaced (a graph holds its address)."""
    held = _POSITIONS.get(device)
    if held is None:
        held = _POSITIONS[device] = torch.arange(selection.COMPOSITE_MAX, device=device)
    return held


def _resources(device: torch.device):
    """The memory pool every graph on CUDA ``device`` captures from and the stream they are
    captured and replayed on (replays in turn, so that they may share the pool)."""
    held = _RESOURCES.get(device)
    if held is None:
        held = _RESOURCES[device] = (torch.cuda.graph_pool_handle(), torch.cuda.Stream(device))
    return held

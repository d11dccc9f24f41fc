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
warm-up's stages and the plans, so a bucket holds two graphs per k it has used, at most
``GRAPHS_PER_BUCKET`` (the oldest dropped). A graph reads acc where it lies at replay time,
so any tensor at that address, of that size and dtype, is selected correctly. Its outputs,
the values and the indices, are the graph's own tensors: each replay rewrites them, which
is safe here because the optimizer is done with a bucket's selection by the end of the
iteration and the next replay of the same graph comes two iterations later (the other
buffer's graph runs in between).

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

GRAPHS_PER_BUCKET = 16
CAPTURABLE = (selection.select_sampled, selection.select_torch)
"""The selectors whose CUDA path (``select_torch``) a graph captures; a user's callable runs as
it is (it may read to the host)."""

Selection = tuple[torch.Tensor, torch.Tensor]


def capturable(device: torch.device) -> bool:
    """Whether a selection on ``device`` can be captured: CUDA devices."""
    return device.type == "cuda"


def cuda_graph(run: Callable[[], Selection], stream: torch.cuda.Stream) -> Callable[[], Selection]:
    """``run`` captured as a CUDA graph on ``stream``: run once there first (the libraries'
    lazy set-up, which must not be captured), then captured; the replay launches the graph
    on the current stream and returns the graph's outputs."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        outputs = run()

    def replay() -> Selection:
        graph.replay()
        return outputs

    return replay


class CapturedSelection:
    """``select_torch(x, k)`` replayed from a graph per (x's address, size and dtype, k);
    ``capture(run, stream)`` makes the graph of ``run`` (``cuda_graph``)."""

    def __init__(self, capture: Callable, limit: int = GRAPHS_PER_BUCKET):
        self._capture, self._limit = capture, limit
        self._graphs: OrderedDict[tuple, Callable[[], Selection]] = OrderedDict()

    def __call__(self, x: torch.Tensor, k: int) -> Selection:
        key = (x.data_ptr(), x.numel(), x.dtype, k)
        replay = self._graphs.get(key)
        if replay is None:
            if len(self._graphs) >= self._limit:
                self._graphs.popitem(last=False)
            positions, stream = _device_resources(x.device)
            replay = self._graphs[key] = self._capture(
                lambda: selection.select_torch(x, k, positions=positions), stream
            )
        else:
            self._graphs.move_to_end(key)
        return replay()

    def __len__(self) -> int:
        """The graphs held."""
        return len(self._graphs)

    def reset(self) -> None:
        """Drop every graph (and the memory each holds for its work and its outputs)."""
        self._graphs.clear()


_RESOURCES: dict = {}


def _device_resources(device: torch.device):
    """The positions ``arange(COMPOSITE_MAX)`` that every graph on ``device`` reads (made once
    and never replaced: a graph holds its address) and the stream they are captured on (None
    off CUDA)."""
    held = _RESOURCES.get(device)
    if held is None:
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        held = _RESOURCES[device] = (torch.arange(selection.COMPOSITE_MAX, device=device), stream)
    return held

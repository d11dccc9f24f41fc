"""A sparse bucket's device work in the hook as a CUDA graph: one launch in place of many.

On a GPU the hook of a sparse bucket costs host time per kernel it launches, whatever the
bucket's size (docs/gpu.md: 0.3 to 0.8 ms a bucket). Its device work is

    v   = rule(g)            the update rule's (``UpdateRule.local``): nothing for plain
                             error feedback; DGC's decay and velocity, one kernel or two
                             per member
    acc = r eps + f v        one kernel per member (``ResidualMemory.accumulate``)
    s   = TopK(acc, k)       ``select_torch``: the magnitude keys, the composite with the
                             positions, ``topk``, the sort of the k indices, the gather
    the message              s times the loss scale, times 1/f under Average, compressed,
                             copied into the send buffer (``Aggregation.packer``)

None of it reads a value to the host or has a size that depends on the data, so it can be
captured once and replayed (``torch.cuda.CUDAGraph``): the hook is then one replay and the
collective's launch. A graph reads its inputs where they lay at capture, so
``BucketGraphs`` (one per bucket, ``LAGSOptions.cuda_graphs``) holds a graph per

    (the addresses of eps and acc, k, r, the loss scale, the message's buffer, what the
     rule bakes in (``UpdateRule.replayed``: its hyper-parameters and memories' ranges, or
     f), and each input's address and strides)

and replays the one whose key the call matches: any tensors at those addresses, of those
layouts, are worked on correctly. The inputs are the members' gradients, or the rule's
result where the rule cannot be replayed (Adam's, whose bias correction changes every
step). eps and acc are ranges of the residual memory's two buffers, which swap at each
commit (as the rule's memories do), and k is fixed between the density warm-up's stages and
the plans, so a bucket whose gradients stay where they are holds two graphs, and drops them
when its k changes.

The gradients stay put where autograd adds into them (``zero_grad(set_to_none=False)``,
DDP's buckets) and, in a steady training loop, usually where it allocates them anew: the
caching allocator hands out the same blocks in the same order each iteration. Where they
move (more than ``GRAPHS_PER_BUCKET`` graphs at one k, say), or a baked value changes every
iteration (``lr_scaled_residual`` under a schedule), the bucket stops capturing all but the
selection: it does the rest as it would without graphs and replays the selection alone
(and the packing), keyed on acc's address and k.

What a graph costs: its capture synchronises the device and empties the allocator's cache
(``torch.cuda.graph``), once per bucket, buffer and k (the first two iterations, each stage
of the density warm-up, each plan that changes k). The call that captures runs the work
once, then captures it without running it (the rule's decay changes the gradient in place:
it must run once per iteration). Every graph on a device captures its temporaries from one
memory pool and replays in turn (``_InTurn``), whatever the order of the buckets: so the
pool holds about the largest bucket's temporaries (12 bytes an entry up to
``COMPOSITE_MAX``, about 17 above), not every bucket's. A replay runs on the hook's current
stream, so a gradient freed after the hook is not reused before the graph has read it, and
costs the host one launch (a replay on another stream than the last waits for it first).

Its outputs, the values and the indices (and the values times the loss scale), are tensors
of its own, allocated outside the pool (so that no other graph's temporaries can land on
them) and rewritten by its next replay, in a later iteration: the optimizer is done with a
bucket's selection by the end of the iteration it was made in. An exchange observer that
keeps them must copy them first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from . import selection
from .aggregation.base import Packer

__all__ = ["BucketGraphs", "GRAPHS_PER_BUCKET", "CAPTURABLE", "capturable", "cuda_graph"]

GRAPHS_PER_BUCKET = 4
"""Graphs a bucket holds at one k: two staging buffers, and room for gradients that settle in
a second place. A bucket that captures more at one k captures its selection alone."""
CAPTURABLE = (selection.select_sampled, selection.select_torch)
"""The selectors whose CUDA path (``select_torch``) a graph captures; a user's callable runs as
it is (it may read to the host)."""

Replay = Callable[..., tuple]


def capturable(device: torch.device) -> bool:
    """Whether a bucket's work on ``device`` can be captured: CUDA devices."""
    return device.type == "cuda"


def cuda_graph(run: Replay, inputs: Sequence, device: torch.device) -> tuple[Replay, tuple]:
    """``run(*inputs)`` run once on ``device``'s capture stream, then captured as a CUDA graph
    in the device's pool (``_resources``): ``(replay, the run's outputs)``. The run is this
    call's work (and the libraries' lazy set-up, which must not be captured): ``run`` may
    change its inputs in place (the weight decay on a gradient), so it must not run twice.
    The replay takes the same arguments and ignores them (the graph reads the inputs where
    they lay at capture, as the caller's key ensures); it runs the graph on the current
    stream, after the device's last replay (``_InTurn``), and returns the graph's outputs
    (the same tensors as the run's)."""
    pool, stream, in_turn = _resources(device)
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        outputs = run(*inputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        captured = run(*inputs)
    current.wait_stream(stream)

    def replay(*_inputs) -> tuple:
        in_turn.take(torch.cuda.current_stream(device))
        graph.replay()
        return captured

    return replay, outputs


class _InTurn:
    """The replays of one device's graphs, one after another: they share one pool, so two
    must never run at once. A replay runs on the stream current in its hook (queued after
    the gradient it reads, and before what that stream queues next: the collective's launch,
    the allocator's reuse of a gradient freed after the hook); ``take`` makes a stream other
    than the last replay's wait for that one first, which a backward pass on one stream never
    needs. Any order of replays is safe so: nothing a graph leaves in the pool outlives its
    replay (its outputs lie outside it)."""

    __slots__ = ("last",)

    def __init__(self):
        self.last = None  # the stream of the last replay

    def take(self, stream) -> None:
        """``stream`` is where the next replay runs: after the last replay, wherever that ran."""
        if self.last is not None and self.last != stream:
            stream.wait_stream(self.last)
        self.last = stream


class BucketGraphs:
    """One bucket's device work in the hook, replayed from a graph per key (the module
    docstring); ``capture(run, inputs, device)`` runs ``run`` once and makes its graph
    (``cuda_graph``)."""

    def __init__(self, capture: Callable, limit: int = GRAPHS_PER_BUCKET):
        self._capture, self._limit = capture, limit
        self._graphs: OrderedDict[tuple, Replay] = OrderedDict()
        self._k: int | None = None  # the k of every graph held
        self._captured = 0  # graphs of the whole captured at this k
        self.accumulates = True
        """Whether the graphs start from the inputs (the rule's work and the accumulate in
        them); False once the inputs proved unsettled at this k (the selection alone)."""

    def __call__(
        self,
        residuals,
        name: str,
        inputs: Sequence[torch.Tensor | None],
        prologue: Callable,
        baked,
        k: int,
        residual_scale: float,
        scale: float = 1.0,
        packer: Packer | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``prologue(*inputs) -> (parts, f)``, then ``selection.accumulate_select(residuals,
        name, parts, k, f, residual_scale, select_torch)``, the values times the loss scale
        ``scale`` and (``packer``) packed into the message, from a graph: ``(acc, values,
        indices, values times scale)``. ``baked``: what the prologue's kernels bake in besides
        the inputs' addresses (f, or the rule's hyper-parameters and memories)."""
        self._at(k)
        if self.accumulates:
            eps, acc = residuals.stage(name)
            key = (eps.data_ptr(), acc.data_ptr(), baked, residual_scale, scale, packer, *map(_layout, inputs))
            replay = self._graphs.get(key)
            if replay is not None:
                return (acc, *replay(*inputs))
            if self._may_capture():
                run = _accumulated(_selection_into(acc, k, scale, packer), residuals, name, prologue, residual_scale)
                return (acc, *self._add(key, run, inputs, acc.device))
        parts, factor = prologue(*inputs)
        acc = residuals.accumulate(name, parts, grad_scale=factor, residual_scale=residual_scale)
        key = ("select", acc.data_ptr(), acc.numel(), acc.dtype, scale, packer)
        replay = self._graphs.get(key)
        if replay is not None:
            return (acc, *replay(acc))
        return (acc, *self._add(key, _selection_into(acc, k, scale, packer), (acc,), acc.device))

    def _at(self, k: int) -> None:
        """A new k: the graphs of the old one go, and the whole is captured again."""
        if k != self._k:
            self.reset()
            self._k = k

    def _may_capture(self) -> bool:
        """Whether one more graph of the whole may be captured at this k; if not, the bucket
        captures its selection alone until k changes (those graphs go)."""
        if self._captured < self._limit:
            self._captured += 1
            return True
        self.accumulates = False
        self._graphs.clear()
        return False

    def _add(self, key: tuple, run: Replay, inputs: Sequence, device: torch.device) -> tuple:
        """Capture ``run`` as the graph of ``key``; its first run's outputs."""
        if len(self._graphs) >= self._limit:
            self._graphs.popitem(last=False)
        self._graphs[key], outputs = self._capture(run, inputs, device)
        return outputs

    def __len__(self) -> int:
        """The graphs held."""
        return len(self._graphs)

    def reset(self) -> None:
        """Drop every graph; capture the whole again."""
        self._graphs.clear()
        self._k, self._captured, self.accumulates = None, 0, True


def _layout(t: torch.Tensor | None) -> tuple | None:
    """Where a graph reads the member's part ``t``: its address and strides (its shape and
    dtype are its parameter's, as ``.grad``'s setter and the rules' memories ensure)."""
    return None if t is None else (t.data_ptr(), t.stride())


def _accumulated(select: Replay, residuals, name: str, prologue: Callable, residual_scale: float) -> Replay:
    """``run(*inputs)``: ``parts, f = prologue(*inputs)``, ``acc = residual_scale * eps + f
    parts`` staged in ``residuals`` for ``name``, then ``select(acc)``. It holds no input: an
    input kept alive could never be met again at its address."""

    def run(*inputs):
        parts, factor = prologue(*inputs)
        return select(residuals.accumulate(name, parts, grad_scale=factor, residual_scale=residual_scale))

    return run


def _selection_into(acc: torch.Tensor, k: int, scale: float, packer: Packer | None) -> Replay:
    """``run(x)``: ``select_torch(x, k)`` copied into tensors allocated here, outside any
    capture (a graph's outputs, where no other graph's work can land), the values times
    ``scale`` beside them (unless it is 1), then packed (``packer``)."""
    values = torch.empty(k, dtype=acc.dtype, device=acc.device)
    indices = torch.empty(k, dtype=torch.int64, device=acc.device)
    scaled = values if scale == 1.0 else torch.empty_like(values)
    positions = _positions(acc.device)

    def run(x: torch.Tensor):
        found_values, found_indices = selection.select_torch(x, k, positions=positions)
        values.copy_(found_values)
        indices.copy_(found_indices)
        if scale != 1.0:
            torch.mul(values, scale, out=scaled)
        if packer is not None:
            packer.pack(scaled, indices)
        return values, indices, scaled

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
    """What every graph on CUDA ``device`` shares: the memory pool it captures from, the
    stream it is captured on, and the turns its replays take (``_InTurn``: one after another,
    so that they may share the pool)."""
    held = _RESOURCES.get(device)
    if held is None:
        held = _RESOURCES[device] = (torch.cuda.graph_pool_handle(), torch.cuda.Stream(device), _InTurn())
    return held

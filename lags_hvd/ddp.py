"""LAGS for ``DistributedDataParallel``: a communication hook, one line on an existing DDP job.

    state = LAGSHookState(density=0.001, named_parameters=model.named_parameters())
    ddp_model.register_comm_hook(state, lags_hook)

DDP hands the hook each gradient bucket as soon as backprop has filled it and overlaps its
communication with the rest of backprop: that is LAGS's pipelining, bucket by bucket. The
sparsification is layer-wise, as in the paper: for every parameter l of bucket b (its range
of DDP's flat buffer ``g``, d_l entries) on worker p::

    acc_l  = eps_l + g_l                  eps_l: the parameter's residual
    s_l    = TopK(acc_l, k_l)             k_l = max(1, ceil(density_t * d_l)); all d_l entries
                                          for a 1-D parameter under dense_params="1d"
    start allgather(s_b)                  the bucket's s_l in one fixed-size message
    eps_l' = acc_l - s_l                  staged
    ... when it arrives:
    grad_b = (1/P) sum_p s_b,p            dense, shaped like the bucket: DDP writes it into .grad
    eps'   committed at the iteration's end, for every bucket, if every grad_b is finite
           (every rank sees the same grad_b; else no residual changes, and the NaN or Inf
           reaches .grad, where a GradScaler skips the step)

Selecting per parameter makes the update independent of how DDP groups parameters into
buckets: the same whatever ``bucket_cap_mb``, before and after DDP rebuilds its buckets
from the observed gradient order (after the first iteration, and again in a resumed job),
so a checkpoint resumes bit for bit. DDP's bucket is only the transport: one collective
for all its parameters.

Nothing is lost: what a worker does not send stays in its residual (error feedback).
density_t follows DGC's warm-up (``density_warmup`` iterations from ``density_warmup_start``).
With ``local_clip=C`` each worker's bucket gradient is first clipped to
``C sqrt(P) sqrt(d_b / d)`` (DGC's local clip; needs ``named_parameters`` for d).

Residuals are kept per parameter, so they survive DDP's bucket rebuild after the first
iteration (and any later change of the buckets): a bucket whose parameters changed takes
each parameter's residual from wherever it was. The hook reads no tensor value to the host.

DGC's momentum correction, with ``momentum=m`` (and ``weight_decay=w``) given to the state
instead of the optimizer (build the optimizer with momentum 0 and weight decay 0)::

    u_l    = m u_l + g_l + w x_l          the velocity, per parameter
    acc_l  = eps_l + u_l                  then as above; u_l cleared where s_l was taken
                                          (momentum-factor masking), kept for one sent whole

so the optimizer's step ``x -= lr grad`` applies the momentum the exchange carried, as
DGC (and the optimizer's recipe) do. Without it the hook sends the gradient and the
optimizer's own momentum acts on the sparse average. Both at once would apply momentum
twice: given ``optimizer=``, the state refuses one with momentum (or, under the hook's
weight decay, weight decay); without it, it warns. A NaN or Inf is averaged into
``.grad`` as DDP would (a GradScaler then skips the step) while residuals and velocities
stay as they were.

Ranks agree, or every rank fails with the same clear error. At its first call the hook
compares every rank's settings (one object allgather, before its first exchange): the
model, density, warm-up, ``dense_params``, ``local_clip``, momentum, weight decay, the
selector and the iteration; ranks that differ raise ``RanksDisagreeError`` naming the
setting, all of them, where a different density or warm-up would abort Gloo on a size
mismatch and a different momentum would run unnoticed. DDP waits for the hook's futures
itself, so the bound on a stalled peer is the process group's ``timeout``
(``init_process_group(timeout=...)``). A bucket's allgather that fails (the timeout ran
out: ``ExchangeTimeoutError``; a peer died: ``WorkerLostError``, naming the bucket and the
iteration) merges nothing and commits no residual of its iteration. DDP re-raises it from
``backward()`` inside a ``RuntimeError`` whose message starts with its name (a torch
future keeps only an error's text); the state keeps it as ``failure`` and the hook's next
call raises it as it is.
"""

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import selection, sparse
from .agreement import agree_on_settings
from .checks import check_count, check_number
from .clipping import clip_norm_
from .collectives.torch_distributed import TorchDistributedCollectives, all_gather_single
from .density import check_density, k_for_density, warmup_density
from .errors import ExchangeTimeoutError, WorkerLostError

__all__ = ["LAGSHookState", "lags_hook"]


MEMORIES = {"residual": "residuals", "velocity": "velocities"}
"""The flat buffers a bucket keeps per parameter, and their names in ``state_dict()``."""


@dataclass(eq=False)
class _BucketMemory:
    """One DDP bucket as the hook last saw it: its parameters in buffer order, where each
    starts in the buffer, which are sent whole, and per memory (``MEMORIES``: the residual,
    and the velocity under momentum correction) the committed and the staged buffer."""

    params: tuple
    starts: tuple[int, ...]
    whole: tuple[bool, ...]
    kept: dict[str, torch.Tensor]
    staged: dict[str, torch.Tensor]
    columns: dict = field(default_factory=dict)  # k -> (MessageColumns, MergeColumns) of the merge

    def merge_columns(self, k: int, world: int, value_dtype, index_dtype) -> tuple:
        """The merge's column maps for a message of k entries, built once per k."""
        if k not in self.columns:
            numel, device = self.kept["residual"].numel(), self.kept["residual"].device
            self.columns = {
                k: (
                    sparse.MessageColumns((k,), world, value_dtype, index_dtype, device),
                    sparse.MergeColumns(((0, k, numel),), device),
                )
            }
        return self.columns[k]


class LAGSHookState:
    """What ``lags_hook`` keeps across buckets and iterations (PowerSGD's ``PowerSGDState``
    plays the same part for ``powerSGD_hook``).

    Args:
        process_group: the DDP model's group (None: the default one).
        density: the fraction of each parameter's entries sent.
        named_parameters: the model's ``named_parameters()``: names the residuals in
            ``state_dict()`` and gives ``local_clip`` the model's size. Required for both.
        density_warmup, density_warmup_start: DGC's density warm-up over that many
            iterations (0: none), as the optimizer's options.
        dense_params: ``"1d"`` sends 1-D parameters (biases, norms) whole; ``"none"``
            sparsifies them like the rest.
        local_clip: DGC's clip of each worker's bucket gradient before accumulation.
        selector: ``"sampled"``, ``"torch"`` or a callable ``select(x, k)``.
        momentum, weight_decay: DGC's momentum correction in the hook (the module
            docstring): the optimizer then gets momentum 0 and weight decay 0.
        optimizer: the model's optimizer, only to check that: under ``momentum`` one of its
            param groups with momentum (or, under ``weight_decay``, weight decay) is refused.
            Not given, ``momentum`` warns instead.
    """

    def __init__(
        self,
        process_group=None,
        density: float = 0.001,
        *,
        named_parameters=None,
        density_warmup: int = 0,
        density_warmup_start: float = 0.25,
        dense_params: str = "none",
        local_clip: float | None = None,
        selector="sampled",
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        optimizer=None,
    ):
        self.process_group = process_group
        self.density = check_density(density, "density")
        self.density_warmup = check_count(density_warmup, "density_warmup")
        self.density_warmup_start = check_density(density_warmup_start, "density_warmup_start")
        if dense_params not in ("none", "1d"):
            raise ValueError(f"dense_params must be 'none' or '1d', got {dense_params!r}")
        self.dense_params = dense_params
        self.names = {p: name for name, p in named_parameters} if named_parameters is not None else None
        if local_clip is not None:
            check_number(local_clip, "local_clip", 0.0, low_open=True)
            if self.names is None:
                raise ValueError("local_clip needs named_parameters (the model's size sets each bucket's share)")
        self.local_clip = local_clip
        self.model_size = sum(p.numel() for p in self.names if p.requires_grad) if self.names else 0
        self.select = selection.get_selector(selector)
        self.selector = (
            selector
            if isinstance(selector, str)
            else f"{getattr(selector, '__module__', '?')}.{getattr(selector, '__qualname__', '?')}"
        )
        self.momentum = check_number(momentum, "momentum", 0.0, 1.0, high_open=True)
        self.weight_decay = check_number(weight_decay, "weight_decay", 0.0)
        if self.weight_decay and not self.momentum:
            raise ValueError("weight_decay is momentum correction's (it joins the velocity): give momentum too")
        if self.momentum:
            check_optimizer(optimizer, self.weight_decay)
        self.memories = ("residual", "velocity") if self.momentum else ("residual",)
        self.iteration = 0
        self._buckets: dict[int, _BucketMemory] = {}
        self._home: dict[torch.Tensor, tuple[_BucketMemory, int]] = {}  # parameter -> its residual's bucket
        self._loaded: dict[str, dict] = {}  # memory -> name -> tensor from state_dict, until its bucket is seen
        self.in_flight: list[torch.futures.Future] = []  # this iteration's buckets before the last
        self.staged: list[tuple[_BucketMemory, torch.Tensor]] = []  # arrived buckets: memory, finite?
        self.agreed = False  # every rank's settings compared (the hook's first call)
        self.failure: WorkerLostError | None = None  # a failed exchange's error, raised again at the next call

    # ------------------------------------------------------------------ the group
    @property
    def world(self) -> int:
        return dist.get_world_size(self.process_group)

    def k(self, numel: int) -> int:
        """k_l for a parameter of ``numel`` entries at this iteration."""
        density = warmup_density(self.iteration, self.density, self.density_warmup_start, self.density_warmup)
        return k_for_density(density, numel)

    def agree(self, bucket: dist.GradBucket) -> None:
        """Collective, once, at the hook's first call: raise ``RanksDisagreeError`` on every
        rank unless every rank has the same settings (``agreement.agree_on_settings``). The
        model is the trainable parameters' names, shapes and dtypes (without
        ``named_parameters``: those of the first bucket's, unnamed)."""
        params = [p for p in self.names if p.requires_grad] if self.names else list(bucket.parameters())
        settings = {
            "model": [(self.names[p] if self.names else None, tuple(p.shape), str(p.dtype)) for p in params],
            "density": self.density,
            "density_warmup": self.density_warmup,
            "density_warmup_start": self.density_warmup_start,
            "dense_params": self.dense_params,
            "local_clip": self.local_clip,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "selector": self.selector,
            "iteration": self.iteration,
        }
        try:  # bounded by the process group's timeout
            agree_on_settings(settings, None, TorchDistributedCollectives(self.process_group), None)
        except RuntimeError as error:
            raise self.fail(error, "the settings check of the hook's first call") from error
        self.agreed = True

    def fail(self, error: BaseException, what: str) -> WorkerLostError:
        """``what``, a collective of the hook's, failed with ``error``: the error that names it
        (``collective_failure``), kept as ``failure`` if it is the first (the cause: the
        collectives after it fail with it)."""
        failure = collective_failure(error, what)
        if self.failure is None:
            self.failure = failure
        return failure

    # ------------------------------------------------------------------ residuals per parameter
    def memory(self, bucket: dist.GradBucket) -> _BucketMemory:
        """The bucket's memory; rebuilt, residuals carried parameter by parameter, when DDP
        has changed which parameters the bucket holds."""
        params = tuple(bucket.parameters())
        memory = self._buckets.get(bucket.index())
        if memory is not None and len(memory.params) == len(params) and all(map(tensor_is, memory.params, params)):
            return memory
        grads, buffer = bucket.gradients(), bucket.buffer()
        starts = tuple((g.data_ptr() - buffer.data_ptr()) // buffer.element_size() for g in grads)
        kept = {kind: torch.zeros_like(buffer) for kind in self.memories}
        for p, start in zip(params, starts):
            for kind, flat in kept.items():
                view = flat[start : start + p.numel()]
                if p in self._home:
                    old, old_start = self._home[p]
                    view.copy_(old.kept[kind][old_start : old_start + p.numel()])
                elif self.names is not None and self.names.get(p) in self._loaded.get(kind, {}):
                    view.copy_(self._loaded[kind].pop(self.names[p]).reshape(-1))
        whole = tuple(self.dense_params == "1d" and p.dim() == 1 for p in params)
        memory = _BucketMemory(params, starts, whole, kept, {kind: torch.empty_like(buffer) for kind in kept})
        self._buckets[bucket.index()] = memory
        for p, start in zip(params, starts):
            self._home[p] = (memory, start)
        return memory

    def commit(self, result: torch.Tensor) -> torch.Tensor:
        """The iteration's end: every arrived bucket's staged residual (and velocity) becomes
        its own if every bucket's average is finite, else none does (no host read). Returns
        ``result``."""
        finite = torch.stack([flag for _, flag in self.staged]).all()
        for memory, _ in self.staged:
            for kind, kept in memory.kept.items():
                torch.where(finite, memory.staged[kind], kept, out=kept)
        self.staged = []
        return result

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The iteration, this rank's residuals by parameter name, and the world and rank they
        belong to (``torch.save`` it beside the model's and the optimizer's)."""
        if self.names is None:
            raise ValueError("state_dict() needs the LAGSHookState built with named_parameters")
        saved = {MEMORIES[kind]: dict(self._loaded.get(kind, {})) for kind in self.memories}
        for p, (memory, start) in self._home.items():
            for kind in self.memories:
                flat = memory.kept[kind][start : start + p.numel()]
                saved[MEMORIES[kind]][self.names[p]] = flat.detach().clone().view(p.shape)
        return {
            "iteration": self.iteration,
            "world_size": self.world,
            "rank": dist.get_rank(),
            "density": self.density,
            "momentum": self.momentum,
            **saved,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s state, all or nothing. Residuals (and velocities) of
        another world size or rank restart from zero, with a warning (they are one worker's
        unsent gradient); those of parameters this model does not have, or of another shape,
        or a state saved with momentum correction on where it is off here (or off where it is
        on), are refused."""
        if self.names is None:
            raise ValueError("load_state_dict() needs the LAGSHookState built with named_parameters")
        if bool(state.get("momentum", 0.0)) != bool(self.momentum):
            raise ValueError(
                f"the checkpoint was saved with momentum {state.get('momentum', 0.0)} in the hook, this state has "
                f"{self.momentum}: its velocities would be missing or meaningless here"
            )
        shapes = {name: p.shape for p, name in self.names.items()}
        memories = {kind: state[MEMORIES[kind]] for kind in self.memories}
        for tensors in memories.values():
            foreign = sorted(set(tensors) - set(shapes))
            if foreign:
                raise ValueError(f"the checkpoint holds state of parameters this model does not have: {foreign[:5]}")
            wrong = sorted(n for n, r in tensors.items() if r.shape != shapes[n])
            if wrong:
                raise ValueError(f"the checkpoint's residuals have other shapes than this model's: {wrong[:5]}")
        if (state["world_size"], state["rank"]) != (self.world, dist.get_rank()):
            warnings.warn(
                f"lags_hvd.ddp: the checkpoint's residuals belong to rank {state['rank']} of {state['world_size']} "
                f"workers, this is rank {dist.get_rank()} of {self.world}: they restart from zero",
                RuntimeWarning,
                stacklevel=2,
            )
            memories = {}
        self.iteration = state["iteration"]
        self._buckets, self._home = {}, {}
        self._loaded = {kind: {n: r.detach().clone() for n, r in tensors.items()} for kind, tensors in memories.items()}

    def __reduce__(self):
        raise TypeError(
            "a LAGSHookState holds a process group and live buffers: save state_dict() and "
            "restore it into a new LAGSHookState with load_state_dict()"
        )


def tensor_is(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b


def check_optimizer(optimizer, weight_decay: float) -> None:
    """Under the hook's momentum correction: refuse an optimizer whose own momentum (or, with
    the hook's weight decay, weight decay) would apply a second time; warn without one."""
    if optimizer is None:
        warnings.warn(
            "lags_hvd.ddp: momentum correction in the hook: build the optimizer with momentum 0 (and weight "
            "decay 0 under the hook's weight_decay), or momentum applies twice; LAGSHookState(optimizer=...) "
            "checks it",
            UserWarning,
            stacklevel=3,
        )
        return
    for i, group in enumerate(optimizer.param_groups):
        for key in ("momentum", "weight_decay") if weight_decay else ("momentum",):
            if group.get(key, 0):
                raise ValueError(
                    f"the optimizer's param group {i} has {key} {group[key]}, and the hook applies {key} itself "
                    f"(momentum correction): build the optimizer with {key} 0"
                )


def collective_failure(error: BaseException, what: str) -> WorkerLostError:
    """A failed collective of the hook's as the error that names it: ``ExchangeTimeoutError``
    when the process group's timeout ran out, else ``WorkerLostError``."""
    if isinstance(error, WorkerLostError):
        return error
    said, rank = str(error)[:300], dist.get_rank()
    if "timed out" in said.lower() or "timeout" in said.lower():
        return ExchangeTimeoutError(
            f"lags_hvd.ddp: {what} waited past the process group's timeout on rank {rank} for ranks that never "
            "joined it: one stalled, is busy with other work, or runs fewer iterations than this rank. Nothing it "
            "received is used; restart from the last checkpoint, or raise init_process_group(timeout=...) if a "
            f"rank legitimately works alone this long. The backend said: {said}"
        )
    return WorkerLostError(
        f"lags_hvd.ddp: {what} failed on rank {rank}: a worker died or left the job. Nothing it received is "
        f"used; this rank stops too (restart from the last checkpoint). The backend said: {said}"
    )


def lags_hook(state: LAGSHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """LAGS-SGD for one DDP bucket (``lags_hvd.ddp`` has the math):

    1. per parameter, ``acc = eps + g`` (after the local clip, if any; ``eps + u`` with the
       velocity ``u = m u + g + w x`` under momentum correction), staged, in one pass with its
       selection where the selector allows;
    2. its k largest entries by magnitude (all of them for a parameter sent whole), the
       staged residual (and velocity) cleared there;
    3. the bucket's entries in one fixed-size message, allgathered asynchronously;
    4. when it arrives: the P workers' entries averaged into a dense tensor shaped like
       the bucket; after the iteration's last bucket, every staged residual committed if
       every bucket's average is finite and every bucket's allgather succeeded.

    The first call compares every rank's settings first (``LAGSHookState.agree``).
    """
    if state.failure is not None:
        raise state.failure
    if not state.agreed:
        state.agree(bucket)
    memory, g = state.memory(bucket), bucket.buffer()
    if state.local_clip is not None:
        budget = state.local_clip * state.world**0.5 * (g.numel() / state.model_size) ** 0.5
        clip_norm_([g], budget)
    eps_all, acc_all = memory.kept["residual"], memory.staged["residual"]
    values, indices = [], []
    for p, start, whole in zip(memory.params, memory.starts, memory.whole):
        end = start + p.numel()
        acc, eps, grad = acc_all[start:end], eps_all[start:end], g[start:end]
        if state.momentum:  # u = m u + g + w x, staged: what is added to the residual
            grad = torch.add(
                grad, memory.kept["velocity"][start:end], alpha=state.momentum, out=memory.staged["velocity"][start:end]
            )
            if state.weight_decay:
                grad.add_(p.detach().view(-1), alpha=state.weight_decay)
        if whole:
            torch.add(eps, grad, out=acc)
            chosen, where = acc.clone(), torch.arange(p.numel(), device=g.device)
        elif state.select is selection.select_sampled:
            chosen, where = selection.add_select(acc, eps, grad, state.k(p.numel()))
        else:
            torch.add(eps, grad, out=acc)
            chosen, where = state.select(acc, state.k(p.numel()))
        if state.momentum and not whole:  # momentum-factor masking: u restarts where sent
            grad[where] = 0
        values.append(chosen)
        indices.append(where + start)
    values, indices = torch.cat(values), torch.cat(indices)
    acc_all[indices] = 0
    world, index_dtype = state.world, sparse.index_dtype_for(g.numel())
    message = sparse.pack(values, indices, index_dtype)
    gathered = message.new_empty(world * message.numel())
    what = f"the allgather of DDP bucket {bucket.index()} at iteration {state.iteration}"
    try:
        work = all_gather_single(gathered, message, group=state.process_group, async_op=True)
    except RuntimeError as error:
        raise state.fail(error, what) from error
    message_columns, merge_columns = memory.merge_columns(values.numel(), world, g.dtype, index_dtype)

    def merge(done) -> torch.Tensor:
        try:
            done.value()  # raises if the allgather failed: ``gathered`` then holds no message
        except RuntimeError as error:
            raise state.fail(error, what) from error
        all_values, all_indices = sparse.unpack_many([gathered], message_columns)
        merged = torch.zeros_like(g)
        sparse.merge_into(merged, all_values, all_indices, merge_columns, divide_by=world)
        state.staged.append((memory, torch.isfinite(merged.sum())))
        return merged

    arrived = work.get_future().then(merge)
    if not bucket.is_last():
        state.in_flight.append(arrived)
        return arrived
    # DDP's bucket 0 is the last of an iteration: once every bucket has arrived, commit
    # every staged residual, or none if any bucket's average is not finite or any failed
    state.iteration += 1
    every, state.in_flight = [*state.in_flight, arrived], []

    def finish(_) -> torch.Tensor:
        if state.failure is not None:
            state.staged = []
            raise state.failure
        return state.commit(arrived.value())

    return torch.futures.collect_all(every).then(finish)

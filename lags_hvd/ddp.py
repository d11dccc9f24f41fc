"""LAGS for ``DistributedDataParallel``: a communication hook, one line on an existing DDP job.

    optimizer = torch.optim.AdamW(model.parameters(), lr=...)     # or SGD with momentum
    state = LAGSHookState(named_parameters=model.named_parameters(), optimizer=optimizer)
    ddp_model.register_comm_hook(state, lags_hook)
    ...  loss.backward(); optimizer.step()                         # as before

This door runs the optimizer doors' LAGS itself, not a copy of it: ``LAGSHookState`` wraps the
optimizer exactly as ``lags_hvd.distributed.DistributedOptimizer`` does (the same options,
defaults, validation, update rules, step check, bounded waits and checkpoints), except that
DDP's hook, not the optimizer's own backward hooks, reports the gradients. For each DDP bucket
b, as backprop fills it, on worker p::

    for each parameter of b:  its bucket u of the LAGS engine (planned buckets, or one per
                              parameter) starts as in the optimizer: the update rule's local
                              step (momentum or Adam correction), acc = eps + ..., s = TopK(acc, k_u),
                              the asynchronous exchange of s
    after DDP's last bucket:  synchronize(): every exchange merged, (1/P) sum_p s_p, the
                              residuals committed (or, with a NaN or Inf, none)
    every bucket's future:    its parameters' merged gradients, laid out as DDP's buffer, which
                              DDP writes into ``.grad``; ``optimizer.step()`` then applies them
                              with the rule (``x -= lr * merged`` under momentum correction,
                              ``x -= merged`` under Adam correction, else the optimizer's step)

DDP's buckets are only the moment gradients are reported: the LAGS buckets are its own, so the
update is the same whatever ``bucket_cap_mb``, before and after DDP rebuilds its buckets, and
the same as the optimizer door's with the same options. The hook waits for the exchanges once,
in the last bucket, where DDP would wait for its futures; every wait is bounded by
``exchange_timeout``.

Without ``optimizer=`` the hook keeps a placeholder optimizer of its own: the gradient itself
is sent (plain error feedback) and the user's optimizer steps on the merged average, so the
momentum and Adam corrections the default recipe relies on at density 0.001 are lost (a
warning says so).
"""

import warnings  # no ``from __future__ import annotations``: DDP checks the hook's annotations

import torch
import torch.distributed as dist

from .collectives.torch_distributed import TorchDistributedCollectives
from .optimizer import Wiring, _InBackward, _initialises_state, _LAGSOptimizer, wrap

__all__ = ["LAGSHookState", "lags_hook"]

WITHOUT_OPTIMIZER = (
    "lags_hvd.ddp: LAGSHookState without optimizer= sends the gradient itself (plain error feedback) and "
    "leaves the step to your optimizer, which cannot apply the momentum correction (SGD with momentum) or "
    "the Adam correction (Adam, AdamW) the default recipe uses: pass optimizer=your_optimizer to keep them"
)


class LAGSHookState:
    """What ``lags_hook`` keeps across buckets and iterations (PowerSGD's ``PowerSGDState`` plays
    the same part for ``powerSGD_hook``): the LAGS optimizer the hook reports to.

    Args:
        process_group: the DDP model's group (None: the default one).
        named_parameters: the DDP model's ``named_parameters()``: names the buckets, the
            residuals in checkpoints and the settings compared across ranks.
        optimizer: the ``torch.optim`` optimizer that trains the model, re-classed in place as
            ``lags_hvd.distributed.DistributedOptimizer`` does (call ``optimizer.step()`` as
            before); None: a placeholder of the hook's own (module docstring).
        options: ``lags_hvd.options.LAGSOptions``, keyword-only, with the optimizers' names,
            defaults and errors (``density``, ``recipe``, ``aggregation``, ...).

    Collective over the group: every rank compares its settings with the others' here and
    raises ``RanksDisagreeError`` where they differ.
    """

    def __init__(self, process_group=None, *, named_parameters, optimizer=None, **options):
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                "LAGSHookState's first argument is the process group (None: the default one), got "
                f"{type(process_group).__name__} {process_group!r}: give the LAGS options by keyword, "
                "LAGSHookState(named_parameters=..., optimizer=..., density=...)"
            )
        moved = sorted(set(options) & {"momentum", "weight_decay"})
        if moved:
            raise TypeError(
                f"LAGSHookState takes no {', '.join(moved)}: momentum correction is the update rule of the "
                "optimizer, as in the optimizer doors; pass optimizer=torch.optim.SGD(..., momentum=m, "
                "weight_decay=w) and the default recipe applies it"
            )
        named = list(named_parameters)
        self._steps_here = optimizer is not None  # the user's optimizer calls step(); a placeholder never does
        if optimizer is None:
            warnings.warn(WITHOUT_OPTIMIZER, UserWarning, stacklevel=2)
            trained = [p for _, p in named if isinstance(p, torch.Tensor) and p.requires_grad]
            optimizer = torch.optim.SGD(trained, lr=1.0)  # never stepped: its groups name the parameters
        collectives = TorchDistributedCollectives(process_group)
        wiring = Wiring(collectives, collectives.member, named)
        self.optimizer = wrap(optimizer, wiring, options, front=DDPDrivenOptimizer)
        self._waiting: list[tuple[torch.futures.Future, tuple, torch.Tensor, list]] = []

    @property
    def iteration(self) -> int:
        """Iterations exchanged so far."""
        return self.optimizer.lags_state.iteration

    def average_models(self) -> None:
        """``optimizer.average_models()``: under the local residual (Adam correction's default),
        every rank's model made the average before evaluating or saving it (collective)."""
        self.optimizer.average_models()

    def state_dict(self) -> dict:
        """This rank's LAGS state, in the optimizers' checkpoint format
        (``checkpointing.FORMAT``; ``optimizer.state_dict()`` holds it too, under ``'lags'``)."""
        return self.optimizer.lags_state_dict()

    def gathered_state_dict(self, root_rank: int = 0) -> dict | None:
        """Collective over every rank: every rank's ``state_dict()`` in one object on global rank
        ``root_rank`` (None on the others), for "save on rank 0, load everywhere": every rank's
        ``load_state_dict`` of it takes its own part (``checkpointing``)."""
        return self.optimizer.gathered_lags_state_dict(root_rank)

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s or ``gathered_state_dict()``'s state (or the former hook's,
        ``checkpointing.migrated``), all or nothing, with the optimizers' checks and warnings."""
        self.optimizer.load_lags_state_dict(state)

    def __reduce__(self):
        raise TypeError(
            "a LAGSHookState holds a process group and live buffers: save state_dict() and "
            "restore it into a new LAGSHookState with load_state_dict()"
        )

    def bucket_ready(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """``lags_hook``'s body (its docstring)."""
        buffer = bucket.buffer()
        params = tuple(bucket.parameters())
        views = bucket_views(buffer, params)
        future = torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
        self._waiting.append((future, params, buffer, views))
        try:
            joined = torch._C._current_graph_task_id() < 0  # DDP's join(): zero buckets, no backward
            self.optimizer.bucket_ready(params, views, bucket.is_last(), self._steps_here, joined)
            if bucket.is_last():
                for waiting, bucket_params, laid_out, bucket_grads in self._waiting:
                    # in place, as DDP's allreduce hook reduces (no allocation); one launch per bucket on a GPU
                    torch._foreach_copy_(bucket_grads, self.optimizer.merged_grads(bucket_params))
                    waiting.set_result(laid_out)
                self._waiting = []
        except BaseException as error:
            for waiting, *_ in self._waiting:
                if not waiting.done():
                    waiting.set_exception(error)
            self._waiting = []
            raise
        return future


class DDPDrivenOptimizer(_LAGSOptimizer):
    """The LAGS optimizer as DDP drives it: DDP's hook, not backward hooks of its own, reports
    the gradients (``bucket_ready``), the merge happens inside backward (in DDP's last bucket),
    and ``.grad`` is DDP's, which copies the merged gradients in; ``step()`` applies them."""

    _owns_grads = False
    _bucket_views: bool | None = None  # DDP's gradient_as_bucket_view, once a .grad has shown it
    _undecided: tuple = ()  # this iteration's .grad made DDP's view before that was known

    def bucket_ready(self, params, grads, last: bool, steps_here: bool, joined: bool = False) -> None:
        """One DDP bucket's ``params`` and their gradients ``grads`` (DDP's views of its buffer,
        ``bucket_views``, which hold the gradients even where ``.grad`` does not). Each parameter
        goes the way of the optimizer's own backward hook, its ``.grad`` holding its gradient
        where the merge will reach it (``_hold_gradient``). After the iteration's ``last``
        bucket the exchanges are merged (inside backward, where DDP waits for its buckets'
        results); with ``steps_here`` False (no optimizer of the user's to call ``step()``) the
        iteration ends there, as ``step()`` would end it. So it does where this rank has
        ``joined`` (DDP's ``join()``: out of batches, it runs the hook on buckets of zeros
        outside any backward, and steps nothing, as under plain DDP)."""
        with _InBackward(self):
            unknown = [tuple(p.shape) for p in params if not self._engine.owns(p)]
            if unknown:
                raise ValueError(
                    f"DDP's bucket holds parameters (shapes {unknown[:5]}) that are not among the LAGS state's: "
                    "build LAGSHookState with this DDP model's named_parameters() (and its optimizer)"
                )
            if any(grad.is_sparse or p.grad is not None and p.grad.is_sparse for p, grad in zip(params, grads)):
                raise TypeError(
                    "lags_hvd.ddp: DDP hands the hook torch.sparse gradients (nn.Embedding(sparse=True)): use "
                    "dense gradients under DDP, or lags_hvd.distributed.DistributedOptimizer, which takes them"
                )
            self._plan_next()  # a merge whose step was skipped (a GradScaler's overflow) planned nothing yet
            for p, grad in zip(params, grads):
                if joined:  # DDP's zeros, not its buckets: nothing to learn of its layout
                    p.grad = grad
                else:
                    self._hold_gradient(p, grad)
                self._engine.gradient_ready(p, self.overlap)
            if last:
                self._synchronize()
                if self._bucket_views is False:
                    for p in self._undecided:
                        p.grad = self._engine.grads.views[p]  # the merge is there too
                self._undecided = ()
        if last and (joined or not steps_here):
            self._phase.apply()  # the iteration ends here: no step() of the user's will consume it
            self._plan_next()

    def _hold_gradient(self, p: torch.Tensor, view: torch.Tensor) -> None:
        """Make ``p.grad`` hold the gradient in DDP's bucket ``view`` in memory that the merge
        will reach, whatever DDP does after the hook: DDP copies each bucket's merged result
        into ``.grad``, except for a parameter that no rank used this iteration
        (``find_unused_parameters``), whose ``.grad`` it leaves as the hook made it. So ``.grad``
        is ``view`` itself under ``gradient_as_bucket_view`` (which DDP requires there, and
        which the merge is written into), else the engine's view of the merge buffer (DDP
        refuses a ``.grad`` that aliases its bucket there). Which of the two DDP runs shows,
        once, in the first ``.grad`` the hook meets (in DDP's bucket, or a tensor of its own);
        a ``.grad`` of None before that is made ``view`` and, at the iteration's end, the
        merge's view where DDP's views turn out not to be wanted."""
        grad = p.grad
        if self._bucket_views is None and grad is not None:
            self._bucket_views = _same_storage(grad, view)
        if self._bucket_views is not False:
            if grad is None or not _same_storage(grad, view):
                p.grad = view
                if self._bucket_views is None:
                    self._undecided += (p,)
            return
        merged = self._engine.grads.views[p]
        if grad is not merged:  # one that is already holds the gradient DDP copied into its bucket
            merged.copy_(view)
            p.grad = merged

    def merged_grads(self, params) -> list:
        """The merged gradients of ``params`` (views of the engine's buffer; ``.grad`` is DDP's)."""
        return [self._engine.grads.views[p] for p in params]

    def synchronize(self) -> None:
        """Nothing to do: DDP's hook synchronized inside backward (refused without a backward)."""
        if not self._member:
            return super().synchronize()
        self._check_usable()
        if not self._phase.merged:
            raise RuntimeError(
                "optimizer.synchronize() under DDP without a backward pass through the DDP model: "
                "DDP's hook exchanges inside backward; call synchronize() (or nothing) after backward"
            )

    def step(self, closure=None):
        """Apply the gradients DDP's hook exchanged inside backward: that of ``closure`` where
        one is given (Lightning's automatic optimization; its backward through the DDP model
        exchanges as any other), else the last one before this call."""
        if not self._member:
            return super().step(closure)
        self._check_usable()
        self._refuse_an_unpassed_grad_scaler()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._phase.merged:
            if _initialises_state(self):  # Horovod's broadcast_optimizer_state on a fresh optimizer
                return None if self._context.rule.steps_itself else self._wrapped_step()
            raise RuntimeError(
                "optimizer.step() without a backward pass through the DDP model since the last step (or only "
                "under no_sync()): there are no exchanged gradients to apply. Backpropagate through the "
                "DistributedDataParallel module whose comm hook is lags_hook, then step"
            )
        self._apply()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._phase.merged and not self._phase.skip:
            self._check_usable()
            raise RuntimeError(
                "optimizer.zero_grad() between the backward pass through the DDP model and optimizer.step(): "
                "that backward's gradients were exchanged (their residuals are committed) and would be "
                "dropped. Call step() before zero_grad()"
            )
        return super().zero_grad(set_to_none=set_to_none)


def lags_hook(state: LAGSHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """LAGS-SGD for one DDP bucket (the module docstring has the math):

    1. each parameter of the bucket goes the way of the optimizer door's backward hook: into
       its LAGS bucket, which starts its exchange once its last member has arrived;
    2. after DDP's last bucket, ``synchronize()`` merges every exchange and commits the
       residuals (a NaN or Inf skips the step on every rank and commits none);
    3. every bucket's future gets its parameters' merged gradients in DDP's buffer layout.
    """
    return state.bucket_ready(bucket)


def bucket_views(buffer: torch.Tensor, params) -> list[torch.Tensor]:
    """DDP's views of its bucket ``buffer`` (the parameters back to back, in bucket order), each
    laid out as DDP lays out that parameter's gradient (its "gradient layout contract"): with
    the parameter's strides where they are dense (``dense_strides``), else row-major.
    ``GradBucket.gradients()`` views every one row-major, which reads a channels_last or
    transposed parameter's gradient in the wrong order."""
    flat, views, offset = buffer.view(-1), [], 0
    for p in params:
        n = p.numel()
        if dense_strides(p):  # a contiguous parameter too: its size-1 dimensions' strides count
            views.append(flat.as_strided(p.shape, p.stride(), flat.storage_offset() + offset))
        else:
            views.append(flat[offset : offset + n].view(p.shape))
        offset += n
    return views


def dense_strides(t: torch.Tensor) -> bool:
    """Whether ``t``'s entries fill one block of memory without gaps or overlaps: its strides,
    sorted, are the row-major strides of its sizes in that order (size-1 dimensions aside;
    a tensor of no entries is)."""
    if t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` lies in ``b``'s memory (DDP's test of a ``.grad`` against its bucket)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

"""LAGS under PyTorch Lightning, one line: ``Trainer(strategy=LAGSStrategy(density=0.001))``.

Lightning's ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` registers a comm hook on
CUDA devices only (a CPU job trains dense, without a word) and writes rank 0's optimizer state
alone into its checkpoints (a resume restarts every other rank's residuals from zero).
``LAGSStrategy`` is Lightning's DDP strategy with the DDP door of ``lags_hvd.ddp`` built in:

1. once Lightning has wrapped the model in DDP and built the optimizer (``setup``),
   ``LAGSHookState`` wraps that optimizer and ``lags_hook`` is registered, on every device
   type; ``configure_optimizers`` returns one optimizer (SGD with momentum or AdamW take the
   default recipe's corrections, as in the other doors);
2. a checkpoint's optimizer state is the optimizer's ``gathered_state_dict()``: every rank's
   residuals and rule memories in the one file rank 0 writes, and ``Trainer.fit(ckpt_path=...)``
   gives each rank its own part back, so a resume is bit-exact;
3. under mixed precision with a GradScaler (``precision="16-mixed"``), the precision plugin's
   scaler is the LAGS ``grad_scaler``, so the residuals are kept unscaled and an overflow skips
   the step everywhere and leaves them untouched;
4. under a rule that keeps each rank's residual in its parameters (Adam correction's local
   residual, AdamW's default), ``average_models()`` when training ends, so the model fit
   returns is the ranks' average (during training each rank validates its own model).

Everything else is Lightning's: the launchers, logging, ``accumulate_grad_batches`` (DDP's
``no_sync`` until the last micro-batch, whose backward exchanges), ``gradient_clip_val`` (it
clips the merged gradient; the recipe's own clip is ``local_clip``), LR schedulers.
"""

import difflib
import inspect
from dataclasses import fields

from torch.nn.parallel import DistributedDataParallel

try:
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as error:  # pragma: no cover - the module is optional
    raise ImportError("lags_hvd.lightning needs PyTorch Lightning 2: pip install lightning") from error

from .ddp import LAGSHookState, lags_hook
from .options import LAGSOptions

__all__ = ["LAGSStrategy"]

LAGS_OPTION_NAMES = frozenset(f.name for f in fields(LAGSOptions))
_HOOK_ARGUMENTS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
_STRATEGY_NAMES = frozenset(inspect.signature(DDPStrategy.__init__).parameters) - {"self", "kwargs"}
_DDP_NAMES = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}


class LAGSStrategy(DDPStrategy):
    """``DDPStrategy`` whose gradients go through ``lags_hook`` (module docstring).

    Args:
        kwargs: the LAGS options (``lags_hvd.options.LAGSOptions``: ``density``, ``recipe``,
            ``aggregation``, ...), validated here, before any process starts; every other
            keyword goes to ``DDPStrategy`` (``accelerator``, ``process_group_backend``,
            ``timeout``, ``start_method``, and DDP's own: ``bucket_cap_mb``, ``static_graph``...).

    After ``setup``, ``lags_state`` is the ``LAGSHookState`` (its ``iteration``,
    ``average_models()``, ``state_dict()``).
    """

    def __init__(self, **kwargs):
        taken = [name for name in _HOOK_ARGUMENTS if name in kwargs]
        if taken:
            raise TypeError(
                f"LAGSStrategy registers lags_hook itself: it takes no {', '.join(taken)} "
                "(pass the LAGS options by keyword, e.g. LAGSStrategy(density=0.001))"
            )
        if "grad_scaler" in kwargs:
            raise TypeError(
                "LAGSStrategy takes no grad_scaler: it passes the GradScaler of Lightning's precision plugin "
                "(Trainer(precision='16-mixed'), or plugins=[MixedPrecision(..., scaler=...)]) itself"
            )
        self._lags_options = {name: kwargs.pop(name) for name in list(kwargs) if name in LAGS_OPTION_NAMES}
        known = LAGS_OPTION_NAMES | _STRATEGY_NAMES | _DDP_NAMES
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                raise TypeError(
                    f"LAGSStrategy got an unknown option {name!r}"
                    + (f" (did you mean {close[0]!r}?)" if close else "")
                    + ": it takes the LAGS options (lags_hvd.options.LAGSOptions), DDPStrategy's and DDP's"
                )
        LAGSOptions(**self._lags_options)  # a bad option fails here, in the launching process
        super().__init__(**kwargs)
        self.lags_state: LAGSHookState | None = None

    def _register_ddp_hooks(self) -> None:
        """Nothing yet: ``setup`` registers the hook once the optimizer exists."""

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        optimizers = [_unwrapped(optimizer) for optimizer in self.optimizers]
        if len(optimizers) != 1:
            raise ValueError(
                f"LAGSStrategy trains with one optimizer; configure_optimizers gave {len(optimizers)}: "
                "return a single optimizer over every trained parameter (its param groups may differ)"
            )
        scaler = getattr(self.precision_plugin, "scaler", None)  # Lightning's own GradScaler, if any
        self.lags_state = LAGSHookState(
            named_parameters=self.model.module.named_parameters(),
            optimizer=optimizers[0],
            grad_scaler=scaler,
            **self._lags_options,
        )
        if isinstance(self.precision_plugin, MixedPrecision):  # its clipping refuses an optimizer that unscales
            self.lags_state.optimizer._grad_scaler_watch = False  # and no GradScaler but its own steps it
        self.model.register_comm_hook(self.lags_state, lags_hook)

    def optimizer_state(self, optimizer) -> dict:
        """Collective over every rank (Lightning builds a checkpoint on every rank and rank 0
        writes it): on rank 0 the optimizer's state with every rank's LAGS state in it."""
        optimizer = _unwrapped(optimizer)
        if self.lags_state is None or optimizer is not self.lags_state.optimizer:
            return super().optimizer_state(optimizer)
        gathered = optimizer.gathered_state_dict(root_rank=0)
        return gathered if gathered is not None else {}  # only rank 0 writes the checkpoint

    def on_train_end(self) -> None:
        super().on_train_end()
        if self.lags_state is not None:
            self.lags_state.average_models()  # nothing to do unless the rule keeps local models


def _unwrapped(optimizer):
    """The ``torch.optim`` optimizer inside Lightning's ``LightningOptimizer``."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

"""The keyword-only LAGS options of ``DistributedOptimizer``, validated in one place."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .aggregation import AGGREGATIONS
from .checks import check_count, check_flag, check_number, is_count
from .collectives import DEFAULT_TIMEOUT
from .density import ADAPTIVE, PAPER_DENSITY, check_density
from .planner import NetworkModel

__all__ = ["LAGSOptions", "RECIPES", "DEFAULT_DENSITY_WARMUP"]

RECIPES = ("dgc", "paper")
DEFAULT_DENSITY_WARMUP = 200
"""``recipe="dgc"``: iterations of density warm-up unless ``density_warmup`` says otherwise."""


@dataclass(frozen=True)
class LAGSOptions:
    """LAGS-SGD settings.

    Attributes:
        recipe: the defaults of the fidelity options (``density_warmup``,
            ``momentum_correction``, ``dense_params``) and of ``buckets``; an option given
            explicitly always wins.

            * ``"dgc"`` (default): Deep Gradient Compression's recipe on planned buckets
              (its accuracy against dense and the paper's: docs/convergence.md):
              ``buckets="auto"``, a density warm-up over ``DEFAULT_DENSITY_WARMUP``
              iterations, 1-D parameters sent dense, and momentum correction where it
              applies (a wrapped ``torch.optim.SGD`` with momentum > 0, dampening 0 and no
              Nesterov in every param group, at least one sparse unit, and no
              ``lr_scaled_residual``), Adam correction likewise for a wrapped
              ``torch.optim.Adam`` or ``AdamW`` (no amsgrad, no maximize); otherwise plain
              error feedback (``lags_hvd.updates``). A user who clips
              the gradient passes the clip as ``local_clip`` (DGC's clip) instead of
              clipping after ``synchronize()``.
            * ``"paper"``: the paper's Algorithm 1 exactly: ``buckets="layer"``, density
              fixed from the first iteration, every parameter sparse, plain error feedback.
        density: fraction of each unit's entries sent per iteration, in (0, 1];
            ``k = max(1, ceil(density * d))``; 1.0 means Horovod's dense allreduce.
            None: the update rule's, 0.001 (the paper's), 0.01 under Adam correction
            (docs/convergence-adam.md); ``recipe="paper"``: 0.001.
            ``"adaptive"``: each unit's density follows its communication-to-
            computation ratio (``lags_hvd.planner``), between ``min_density`` and
            ``max_density``.
        layer_densities: ``{unit name: density}`` overriding a fixed ``density``
            per unit (a unit's name is its parameter's name).
        selector: ``"sampled"`` (default: fast and exact), ``"torch"`` (plain
            ``torch.topk``, the reference) or a callable ``select(x, k) -> (values,
            indices)`` returning the exact top-k by magnitude (``lags_hvd.selection``).
        lr_scaled_residual: keep the residual in the paper's learning-rate-scaled
            space: when the lr changes from eta_{t-1} to eta_t the residual is scaled
            by eta_{t-1}/eta_t, so plain SGD follows the paper's update exactly. The
            default keeps it in gradient space (eps = acc - s), independent of the
            schedule.
        monitor_every: every this many iterations, measure the convergence
            assumption's delta for every sparse unit (one extra dense allreduce of
            each unit's accumulated vector; ``lags_hvd.assumption``) and append it to
            ``optimizer.assumption_log``. 0 (default) never measures.
        grad_scaler: the ``torch.amp.GradScaler`` scaling this model's loss, if any.
            Residuals are then kept on unscaled gradients (``acc = eps + g / S``) and
            the exchanged values are rescaled by S, so the GradScaler's unscale,
            overflow check and skipped steps work as with a plain optimizer (an
            overflow skips the step on every rank and leaves residuals untouched).
            ``step()`` must then follow an explicit ``synchronize()`` (see README). A
            GradScaler stepping an optimizer without it is refused at its first step.
        trust_selector: a callable ``selector``'s result is checked at every call (two 1-D
            tensors of length k, indices distinct and in range, values equal to the input at
            those indices; one device-to-host read per unit), since a wrong result would add
            gradient that never existed. True skips the check. Built-in selectors are exact
            by construction and never checked.
        cuda_graphs: capture each sparse bucket's device work in the hook on CUDA tensors
            (the rule's velocity, the accumulate, the top-k selection, the packing of the
            message) as a CUDA graph per k and replay it (``lags_hvd.capture``): one launch in
            place of one or more kernels per member and about ten more, the same result bit
            for bit. Where a bucket's gradients do not stay at the same addresses between
            iterations, its selection alone is replayed. Built-in selectors only; parameters
            on other devices work as before. Off (default) until measured on a GPU
            (docs/gpu.md).
        exchange_timeout: seconds a rank waits in one collective for the other ranks before
            it raises ``ExchangeTimeoutError`` naming the exchange (default 600; None waits
            forever, as Horovod does). A peer that died raises ``WorkerLostError`` at once.
        density_warmup: DGC's density warm-up, in iterations (None: the recipe's,
            ``DEFAULT_DENSITY_WARMUP`` or 0; 0 is off). Over
            the first ``density_warmup`` iterations every sparse unit's density falls in 4
            geometric steps from ``density_warmup_start`` to its own (``lags_hvd.density``).
        density_warmup_start: the warm-up's first density (None: the update rule's, DGC's 0.25,
            or 0.05 under Adam correction, where the warm-up's traffic bought no perplexity:
            docs/convergence-adam.md).
        momentum_correction: DGC's momentum correction with momentum-factor masking, for a
            wrapped ``torch.optim.SGD`` with momentum m (dampening 0, no Nesterov). Each
            worker keeps a velocity ``u = m u + g + wd x`` and accumulates it into the
            residual, ``eps = eps + u``; TopK selects from ``eps``; the sent entries are
            cleared in both ``eps`` and ``u``. The merged result is then the update
            itself, so ``step()`` applies ``x -= lr * update`` in place of the wrapped SGD's
            step (its param groups untouched; its step hooks do not run; ``torch.optim.SGD``
            itself only, not a subclass, whose own step this would skip).
            Dense units keep their velocity unmasked, which makes them exactly momentum SGD.
            True refuses an optimizer it cannot apply to; None: the recipe's (see
            ``recipe``; the optimizer resolves it to True or False as it wraps).
        adam_correction: error feedback on Adam's step for a wrapped ``torch.optim.Adam`` or
            ``torch.optim.AdamW`` (``lags_hvd.updates.adam_correction``): each worker keeps
            Adam's moments of its own gradient and accumulates Adam's step (learning rate and
            bias correction included) into the residual, ``acc = eps + d``; ``step()`` applies
            ``x <- x (1 - lr wd) - merged`` (the decay if decoupled, as AdamW's) in place of the
            wrapped optimizer's step, so the update is linear in what is sent. Units sent
            whole step exactly as Adam on the merged gradient. ``local_clip`` clips each
            worker's gradient before its moments; ``max_grad_norm`` clips the merge, which is
            then the step itself (its norm, learning rate included). True refuses an
            optimizer it cannot apply to; None: the recipe's.
        local_residual: under Adam correction, each worker's parameters also hold its own
            residual, ``x_p = x - eps_p`` (``lags_hvd.updates.local_adam_correction``, CSER's
            partial synchronisation): a worker's gradient is taken where its own steps have
            gone, not a thousand steps behind them. Ranks' parameters then differ by their
            residuals; ``average_models()`` makes them the average, every step applied.
            None: the recipe's (True under Adam correction, the default for Adam and AdamW;
            False for ``recipe="paper"``); False: the consensus on every rank; True without
            Adam correction raises ValueError.
        dense_params: ``"1d"`` sends every unit whose parameters are all 1-D (biases,
            norm scales) dense, as DGC does; ``"none"`` treats them like the rest; None:
            the recipe's (``"1d"`` for ``"dgc"``, ``"none"`` for ``"paper"``).
            ``layer_densities`` still wins for the units it names.
        local_clip: clip each worker's gradient before accumulation, unit by unit, to the
            norm ``local_clip * sqrt(d_u / d) * sqrt(P)`` with ``op=Average`` (``/ sqrt(P)``
            with ``op=Sum``; d_u the unit's entries, d the model's): DGC's local clipping, in
            place of a clip of the merged gradient to ``local_clip`` (P independent gradients
            of that norm merge to about ``local_clip``; ``lags_hvd.clipping``). None
            (default) never clips locally.
        max_grad_norm: clip the merged gradient g inside ``synchronize()`` to this 2-norm,
            ``g <- c g`` with ``c = min(1, C / (||g|| + 1e-6))`` (as
            ``torch.nn.utils.clip_grad_norm_`` would after it), and give what the clip
            removes from each worker's sparse contribution back to that worker's
            residual: ``eps[i] += (1 - c) s_p[i]`` for every entry i it sent that the merge
            applied. The clip then delays residual mass instead of destroying it (a
            sent entry carries many iterations' gradient). Dense units lose their
            clipped part, as with Horovod, so at density 1 this is dense SGD with the
            clip. ``optimizer.grad_norm`` holds ||g|| before the clip. While the clip
            keeps biting, the residuals grow by about ||g|| - C per iteration: mass the
            clip holds back is applied later, not dropped (an outlier gradient too).
            Ranks outside the ``process_set`` step on local gradients and do not clip.
            None (default): no clip here; a clip the user applies after
            ``synchronize()`` loses what it removes.
        buckets: which parameters are selected and exchanged together (a bucket, or
            exchange unit); None: the recipe's (``"auto"``, or ``"layer"`` for
            ``recipe="paper"``). ``"auto"``: per-layer through the density warm-up
            and ``bucket_warmup`` iterations more, while the engine's cost per bucket and
            the gradients' ready times are measured, then the buckets that minimise the predicted
            iteration time (``lags_hvd.planner.plan_buckets``; per-layer and one bucket
            are among the plans it weighs), decided on rank 0 and applied on every rank;
            the network model comes from ``network_profile`` or is measured then, once.
            The plan depends on measured times, so two runs may choose different buckets
            (``bucket_history`` records it in this process, checkpoints keep it). ``"layer"``: one
            bucket per parameter, the paper's layer-wise setting, exactly reproducible.
            An integer n: consecutive parameters (in backward order, within a param
            group) of fewer than n entries merge into buckets of at least n, so biases
            and norms do not each pay a message start-up. Explicit buckets: Horovod's
            ``groups`` / ``num_groups`` arguments (the default is then those groups).
        bucket_warmup: iterations measured before ``buckets="auto"`` plans (default 10),
            counted from the end of the density warm-up, so that the plan is made at the k
            the buckets will send (the adaptive mode's baseline likewise starts there).
        aggregation: how a sparse bucket's P selections are combined. ``"allgather"``
            (default): every worker receives every other's k entries, (P-1) k per worker,
            and the merged gradient holds up to P k entries. ``"reduce_scatter"``: Ok-Topk's
            split-and-reduce: each worker sends the entries of region r to rank r (one
            alltoall), rank r sums them and keeps its share of the top K (k, or more with
            ``owner_keep``), and one allgather shares those; about (k + K) (P-1)/P per
            worker each way (k >= P), and the merged gradient holds at most K entries. A
            callable ``selector`` may return its indices in any order. What a worker sent and the second selection
            dropped returns to its residual, so nothing is lost (``lags_hvd.regions``).
            Costs two collectives per bucket and one host read of the region counts
            (Horovod's alltoall takes them on the host).
        owner_keep: ``aggregation="reduce_scatter"`` only: c, the region owners keep
            K = min(n, ceil(c k)) entries between them (1, the default: the global
            top-k, as Ok-Topk). A larger c applies more of what the workers sent each
            step, toward the allgather's union of up to P k entries, for (c - 1) k (P-1)/P
            more rows per worker each way (``lags_hvd.regions``); a number >= 1, taken
            as the decimal it prints as (1.1 k = 55 for k = 50).
        regional_selection: ``aggregation="reduce_scatter"`` only. False (default): each
            worker selects its top k over the whole bucket, as Ok-Topk; what arrives at an
            owner then depends on where the selections fall, and the regions are
            rebalanced every ``regions.REBALANCE_EVERY`` iterations. True: each worker
            selects its top ``k_r`` in every region r, ``k_r`` its share of k by the
            region's size (at least 1), so every owner receives exactly (P-1) k_r rows in
            every iteration, whatever the gradients: no hotspot, no balancing summaries and
            no host read of the counts. The regions stay as they are (equal ones from the
            start). It selects by region as LAGS selects by layer.

    Adaptive mode only:
        min_density, max_density: bounds of every unit's density.
        warmup_iterations: iterations at ``min_density`` before a plan; all but the
            first are measured (the baseline), and as many time each trial plan.
        replan_every: iterations from one baseline to the next, each plan made from
            fresh measurements (``lags_hvd.adaptive`` describes the loop).
        max_slowdown: a plan is kept only if the median iteration time with it is
            within this fraction of the baseline's; otherwise it is scaled back.
        network_profile: a ``NetworkModel``, a dict or the path of a JSON file from
            ``python -m lags_hvd.experiments.netprofile``; None measures the network at the first plan
            (this and ``buckets="auto"``'s).
        plan_slack: the exchanges may end this fraction of the backprop span later
            than with ``min_density`` everywhere.
        plan_report_dir: where rank 0 writes ``plan-<iteration>.json`` and ``.png`` at
            each plan; None writes nothing.
        verbose: rank 0 prints each plan.
    """

    density: float | str | None = None
    recipe: str = "dgc"
    layer_densities: dict[str, float] = field(default_factory=dict)
    selector: str | Callable = "sampled"
    lr_scaled_residual: bool = False
    grad_scaler: Any = None
    trust_selector: bool = False
    cuda_graphs: bool = False
    exchange_timeout: float | None = DEFAULT_TIMEOUT
    buckets: str | int | None = None
    aggregation: str = "allgather"
    owner_keep: float = 1.0
    regional_selection: bool = False
    bucket_warmup: int = 10
    monitor_every: int = 0
    density_warmup: int | None = None
    density_warmup_start: float | None = None
    momentum_correction: bool | None = None
    adam_correction: bool | None = None
    local_residual: bool | None = None
    dense_params: str | None = None
    local_clip: float | None = None
    max_grad_norm: float | None = None
    min_density: float = 0.001
    max_density: float = 1.0
    warmup_iterations: int = 6
    replan_every: int = 500
    max_slowdown: float = 0.03
    network_profile: Any = None
    plan_slack: float = 0.02
    plan_report_dir: str | None = None
    verbose: bool = False

    def __post_init__(self):
        """Resolve the recipe's defaults and validate every option; the options are frozen after."""
        self._resolve()
        self._validate()

    def _resolve(self) -> None:
        """The recipe's defaults for what was left None, and the densities checked and normalised."""

        def resolve(name: str, value) -> None:
            object.__setattr__(self, name, value)

        if self.recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {', '.join(map(repr, RECIPES))}, got {self.recipe!r}")
        paper = self.recipe == "paper"
        for name, paper_value, dgc_value in (
            ("buckets", "layer", "auto"),
            ("density_warmup", 0, DEFAULT_DENSITY_WARMUP),
            ("dense_params", "none", "1d"),
        ):
            if getattr(self, name) is None:
                resolve(name, paper_value if paper else dgc_value)
        for name in ("momentum_correction", "adam_correction", "local_residual"):
            if getattr(self, name) is None and (paper or self.lr_scaled_residual):
                resolve(name, False)  # else the optimizer decides where it applies (``updates.rule_for``)
        if self.local_residual and self.adam_correction is None:
            resolve("adam_correction", True)  # the local residual is a form of Adam correction
        if self.density is None and paper:
            resolve("density", PAPER_DENSITY)
        if self.density == ADAPTIVE:
            if self.layer_densities:
                raise ValueError("layer_densities applies to a fixed density, not to density='adaptive'")
        elif self.density is not None:  # None: the update rule's (``engine.engine_context``)
            resolve("density", check_density(self.density, "density"))
        resolve(
            "layer_densities",
            {
                name: check_density(value, f"layer_densities[{name!r}]")
                for name, value in (self.layer_densities or {}).items()
            },
        )
        for name in ("min_density", "max_density", "density_warmup_start"):
            if getattr(self, name) is not None:
                resolve(name, check_density(getattr(self, name), name))

    def _validate(self) -> None:
        """Every other option checked (a clear ValueError or TypeError naming it)."""
        if self.min_density > self.max_density:
            raise ValueError(f"min_density ({self.min_density}) exceeds max_density ({self.max_density})")
        if self.buckets not in ("layer", "auto") and not (is_count(self.buckets) and self.buckets >= 1):
            raise ValueError(f"buckets must be 'layer', 'auto' or a number of entries >= 1, got {self.buckets!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation must be one of {', '.join(map(repr, AGGREGATIONS))}, got {self.aggregation!r}"
            )
        object.__setattr__(self, "owner_keep", check_number(self.owner_keep, "owner_keep", 1.0))
        for name, needs in (
            ("owner_keep", self.owner_keep != 1),
            ("regional_selection", check_flag(self.regional_selection, "regional_selection")),
        ):
            if needs and self.aggregation != "reduce_scatter":
                raise ValueError(
                    f"{name}={getattr(self, name)!r} applies to aggregation='reduce_scatter' only "
                    f"(the regions' owners); aggregation is {self.aggregation!r}"
                )
        for name in ("warmup_iterations", "replan_every", "bucket_warmup"):
            check_count(getattr(self, name), name, 1)
        for name in ("monitor_every", "density_warmup"):
            check_count(getattr(self, name), name, 0)
        for name in ("plan_slack", "max_slowdown"):
            check_number(getattr(self, name), name, 0.0)
        for name in ("local_clip", "max_grad_norm", "exchange_timeout"):  # exchange_timeout None: no bound
            check_number(getattr(self, name), name, 0.0, low_open=True, none=True)
        if self.grad_scaler is not None and not all(
            callable(getattr(self.grad_scaler, m, None)) for m in ("get_scale", "is_enabled")
        ):
            raise TypeError(
                "grad_scaler must be a torch.amp.GradScaler (get_scale() and "
                f"is_enabled()), got {type(self.grad_scaler).__name__}"
            )
        check_flag(self.trust_selector, "trust_selector")
        check_flag(self.cuda_graphs, "cuda_graphs")
        for name in ("momentum_correction", "adam_correction", "local_residual"):
            check_flag(getattr(self, name), name, none="the recipe's")
        if self.momentum_correction and self.adam_correction:
            raise ValueError("momentum_correction (SGD) and adam_correction (Adam) exclude each other")
        if self.local_residual and (self.momentum_correction or self.adam_correction is False):
            raise ValueError("local_residual applies under adam_correction (its residual is a step)")
        if self.dense_params not in ("none", "1d"):
            raise ValueError(f"dense_params must be '1d', 'none' or None (the recipe's), got {self.dense_params!r}")
        for name in ("momentum_correction", "adam_correction"):
            if getattr(self, name) and self.lr_scaled_residual:
                raise ValueError(
                    f"{name} keeps the residual in its own space; it cannot be combined with lr_scaled_residual"
                )
        if (
            self.network_profile is not None
            and not isinstance(self.network_profile, (NetworkModel, dict, str))
            and not hasattr(self.network_profile, "__fspath__")
        ):
            raise TypeError("network_profile must be a NetworkModel, a dict or a JSON file path")

    @property
    def adaptive(self) -> bool:
        return self.density == ADAPTIVE

    def shared_settings(self) -> dict:
        """The options every rank must set alike (they change the math or the collectives),
        as plain values for ``agreement.agree_on_settings``; k itself is compared separately."""
        selector = (
            self.selector
            if isinstance(self.selector, str)
            else f"{getattr(self.selector, '__module__', '?')}.{getattr(self.selector, '__qualname__', '?')}"
        )
        shared = {
            "density": self.density,
            "recipe": self.recipe,
            "selector": selector,
            "lr_scaled_residual": self.lr_scaled_residual,
            "grad_scaler": self.grad_scaler is not None,
            "monitor_every": self.monitor_every,
            "buckets": self.buckets,
            "aggregation": self.aggregation,
            "owner_keep": self.owner_keep,
            "regional_selection": self.regional_selection,
            "density_warmup": self.density_warmup,
            "density_warmup_start": self.density_warmup_start,
            "momentum_correction": self.momentum_correction,
            "adam_correction": self.adam_correction,
            "local_residual": self.local_residual,
            "dense_params": self.dense_params,
            "local_clip": self.local_clip,
            "max_grad_norm": self.max_grad_norm,
        }
        if self.buckets == "auto":
            shared["bucket_warmup"] = self.bucket_warmup
        if self.adaptive:
            shared.update(
                {
                    name: getattr(self, name)
                    for name in (
                        "min_density",
                        "max_density",
                        "warmup_iterations",
                        "replan_every",
                        "max_slowdown",
                        "plan_slack",
                    )
                }
            )
        return shared

"""The checkpoints of every door: the optimizer's ``state_dict``, an all-or-nothing
``load_state_dict``, and the LAGS state shared from one rank by ``broadcast_optimizer_state``.

The LAGS state (``lags_state_dict()``; under the optimizer state's ``'lags'`` key, and the
whole of the DDP hook state's ``state_dict()``): its format version (``FORMAT``), this rank's
residuals and the update rule's memories, k, the buckets and whether they were planned, the
iteration and lr record, the region boundaries, the worker count and rank the residuals
belong to, and the update rule they were made under. ``migrated`` reads every earlier format.

"Save on one rank, load everywhere" (DDP's and Lightning's habit): ``gathered_state_dict()``,
a collective, gives the saving rank every rank's LAGS state in one object (``'ranks'``: global
rank -> its state; under a rule that keeps each rank's residual in its parameters, with that
rank's parameters), and every rank's ``load_state_dict`` of it takes its own part.
"""

from __future__ import annotations

import warnings

import torch

from .collectives import broadcast_object, broadcast_tensors

__all__ = ["CheckpointMixin"]

_STATE_KEY = "lags"
FORMAT = 3
"""The LAGS state's format: 2 added this version to the optimizers' format 1 (unversioned) and
serves the DDP hook too, whose own unversioned format ``migrated`` converts; 3 adds the
gathered form (``'ranks'``)."""


def _check_readable(version) -> None:
    if not isinstance(version, int) or version > FORMAT:
        raise ValueError(f"the LAGS state has format {version!r}; this lags_hvd reads formats 1 to {FORMAT}")


def own_part(saved, rank) -> dict:
    """This rank's state in a LAGS state: ``saved`` itself, or, in the gathered form, the part of
    global rank ``rank`` (of a rank the state does not hold: the lowest rank's, whose residuals
    the load then resets as another rank's)."""
    if not isinstance(saved, dict) or "ranks" not in saved:
        return saved
    _check_readable(saved.get("format"))
    ranks = saved["ranks"]
    if not isinstance(ranks, dict) or not ranks or not all(isinstance(part, dict) for part in ranks.values()):
        raise ValueError("a gathered LAGS state's 'ranks' must map each rank to its state")
    return ranks.get(rank, ranks[min(ranks)])


def migrated(saved, expected_residuals: set[str]) -> dict:
    """A LAGS state of any format in this one (``FORMAT``); ``expected_residuals``: the
    parameters whose residuals this optimizer keeps. The optimizers' format 1 is this format
    without the version. The DDP hook's former state (``iteration``, ``world_size``, ``rank``,
    ``density``, ``momentum`` and per parameter ``residuals`` and, under its momentum
    correction, ``velocities``, in the parameters' shapes) becomes this format's residuals
    (flat) and the velocities of momentum correction (the hook's was the same rule); a residual
    of a parameter sent whole here has nowhere to go, and a non-zero one is named in a warning."""
    if not isinstance(saved, dict):
        raise ValueError(f"a LAGS state must be a dict, got {type(saved).__name__}")
    version = saved.get("format", 1)
    if version == FORMAT or "density" not in saved or "k" in saved:
        _check_readable(version)
        return {**saved, "format": FORMAT}
    residuals = saved.get("residuals")
    if not isinstance(residuals, dict) or not all(isinstance(t, torch.Tensor) for t in residuals.values()):
        raise ValueError("the DDP hook state has no usable 'residuals' (a {parameter name: tensor} mapping)")
    dropped = sorted(n for n, t in residuals.items() if n not in expected_residuals and bool(t.any()))
    if dropped:
        warnings.warn(
            f"lags_hvd: the DDP hook state's residuals of {dropped[:5]} are dropped: these parameters are sent "
            "whole under the options in force (dense_params='none' keeps them sparse)",
            RuntimeWarning,
            stacklevel=3,
        )
    state = {
        "format": FORMAT,
        "residuals": {n: t.reshape(-1) for n, t in residuals.items() if n in expected_residuals},
        "iteration": saved.get("iteration", 0),
        "updates": saved.get("iteration", 0),
        "world_size": saved.get("world_size"),
        "rank": saved.get("rank"),
    }
    if saved.get("momentum"):
        state["velocities"] = {n: t.reshape(-1) for n, t in saved.get("velocities", {}).items()}
        state["update"] = {"rule": "momentum_correction"}
    return state


class CheckpointMixin:
    """The checkpoint methods of ``optimizer._LAGSOptimizer`` (one concern, one module)."""

    def state_dict(self):
        """The wrapped optimizer's state plus this rank's LAGS state under ``'lags'``
        (``lags_state_dict``)."""
        return {**super().state_dict(), _STATE_KEY: self.lags_state_dict()}

    def lags_state_dict(self) -> dict:
        """This rank's LAGS state (module docstring): residuals, k, iteration, and the worker
        count and rank they belong to."""
        return {
            "format": FORMAT,
            **self.lags_state.state_dict(),
            **self._loops.saved_state(),
            "world_size": self._context.config.world,
            "rank": self._context.config.collectives.global_rank(),
            "update": self.update_rule,
        }

    def gathered_state_dict(self, root_rank: int = 0) -> dict | None:
        """Collective over every rank: on global rank ``root_rank``, ``state_dict()`` with every
        rank's LAGS state under ``'lags'`` (``gathered_lags_state_dict``); None on the others.
        Save it on that rank; every rank's ``load_state_dict`` of it resumes its own part."""
        lags = self.gathered_lags_state_dict(root_rank)
        if lags is None:
            return None
        return {**super().state_dict(), _STATE_KEY: lags}

    def gathered_lags_state_dict(self, root_rank: int = 0) -> dict | None:
        """Collective over every rank: ``{"format": FORMAT, "ranks": {global rank: its
        lags_state_dict()}}`` on ``root_rank``, None on the others. Under a rule that keeps each
        rank's residual in its parameters (``local_residual``), each part holds its rank's
        parameters too, which that rank's load writes back. The states travel one rank at a
        time (one broadcast each): a rank other than the root holds one other state at most."""
        config = self._context.config
        mine = self.lags_state_dict()
        if self._context.rule.local_models:
            mine["parameters"] = {name: param.detach().clone() for name, param in self._exchanged_params().items()}
        ranks, root = {}, config.collectives.global_rank() == root_rank
        for rank in config.collectives.global_ranks:
            part = broadcast_object(
                config.collectives,
                mine if rank == config.collectives.global_rank() else None,
                rank,
                f"{config.namespace}.gathered_state.{rank}",
                timeout=self._options.exchange_timeout,
            )
            if root:
                ranks[rank] = part
        return {"format": FORMAT, "ranks": ranks} if root else None

    @property
    def update_rule(self) -> dict:
        """The options that shape the update and the saved state (the rule's memories; which
        units keep residuals), as resolved for this optimizer: recipe, the update rule
        (``lags_hvd.updates``), dense_params."""
        rule = self._context.rule.name
        return {
            "recipe": self._options.recipe,
            "rule": rule,
            "momentum_correction": rule == "momentum_correction",
            "dense_params": self._options.dense_params,
        }

    def load_state_dict(self, state_dict) -> None:
        """Restore the wrapped optimizer's state and this rank's LAGS state, all or nothing.

        A state without ``'lags'`` (e.g. from a plain optimizer) leaves the LAGS state as
        it is. Residuals are one worker's unsent gradient: a state saved by another rank
        or with a different number of workers keeps its k and iteration but resets the
        residuals to zero, with a warning, so no gradient is sent twice or lost silently.
        Everything is checked before anything changes: a state that does not fit raises
        ``ValueError`` and leaves the optimizer exactly as it was.
        """
        state_dict = dict(state_dict)
        saved = state_dict.pop(_STATE_KEY, None)
        self._load(saved, lambda: super(CheckpointMixin, self).load_state_dict(state_dict))

    def load_lags_state_dict(self, saved) -> None:
        """Restore ``lags_state_dict()``'s state (of any format: ``migrated``) alone, all or
        nothing, as ``load_state_dict`` restores it (the DDP hook state's load)."""
        self._load(saved, lambda: None)

    def _load(self, saved, load_wrapped) -> None:
        """``load_state_dict`` of the LAGS state ``saved`` (None: none) and, through
        ``load_wrapped``, of the wrapped optimizer's: everything checked before anything changes."""
        if self._engine.in_flight:
            raise RuntimeError(
                "load_state_dict() while exchanges are in flight; call it before backward or after step()"
            )
        load_lags, reason = None, None
        if saved is not None:
            if not isinstance(saved, dict):
                raise ValueError("the optimizer state's 'lags' entry is not a dict")
            saved = own_part(saved, self._context.config.collectives.global_rank())
            saved = migrated(saved, set(self.lags_state.residuals.expected_state()))
            reason = _residuals_foreign(saved, self._context.config)
            _check_update_rule(saved.get("update"), self.update_rule)
        own_parameters = self._own_parameters(saved) if saved is not None and reason is None else []
        undo_buckets = self._adopt_plan(saved) if saved is not None else lambda: None
        try:
            if saved is not None:
                load_lags = self.lags_state.prepare_load(
                    saved,
                    adopt_k=self._options.adaptive,
                    reset_residuals=reason is not None,
                    world=self._context.config.world,
                )
            load_wrapped()  # torch checks the groups before it changes anything
        except BaseException as error:
            if isinstance(error, ValueError) and saved is not None and "update" not in saved:
                error.add_note(
                    "lags_hvd: this checkpoint predates the recipe option, whose default "
                    "('dgc') turns on momentum correction and sends 1-D parameters dense; a "
                    "checkpoint saved with the defaults of then resumes with recipe='paper' "
                    "(and buckets='auto' if it was planned)"
                )
            undo_buckets()  # the optimizer exactly as it was
            raise
        if load_lags is not None:
            load_lags()
            with torch.no_grad():
                for param, value in own_parameters:
                    param.copy_(value)
            if reason:
                warnings.warn(_residuals_reset(reason, self._context.rule.local_models), stacklevel=2)
            self._loops.resume(self.lags_state.iteration)
        self._phase.restart()  # the loaded state's plan stands
        self._engine.reset_pass_counters()

    def _exchanged_params(self) -> dict[str, torch.Tensor]:
        """The parameters the LAGS state exchanges, by name."""
        return {name: p for unit in self.lags_state.units for name, p in zip(unit.param_names, unit.params)}

    def _own_parameters(self, saved: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A gathered part's parameters (``local_residual``: this rank's, which hold its
        residual) as ``(parameter, saved value)`` pairs, checked against the model; [] where
        the state holds none."""
        saved = saved.get("parameters")
        if saved is None:
            return []
        params = self._exchanged_params()
        if not isinstance(saved, dict) or sorted(saved) != sorted(params):
            raise ValueError(
                "the gathered state's parameters are not this model's: the checkpoint is from another model"
            )
        for name, value in saved.items():
            if not isinstance(value, torch.Tensor) or value.shape != params[name].shape:
                raise ValueError(f"the gathered state's parameter {name!r} does not fit this model's")
        return [(params[name], saved[name]) for name in sorted(saved)]

    def adopt_shared_state(self, root_rank: int) -> None:
        """Collective over every rank: take ``root_rank``'s k, iteration and learning-rate
        record, and the rule's replicated memories (Adam's moments of the units sent whole):
        what all ranks must hold alike; residuals stay each rank's own, except under
        ``local_residual``: the parameters just broadcast are the root's, which hold its own
        residual, so ``average_models()`` puts every rank on them with no residual (the root's
        unsent steps stay applied in full, the others' are dropped). Called by
        ``lags_hvd.broadcast_optimizer_state`` after Horovod's broadcast."""
        shared = broadcast_object(
            self._context.config.collectives,
            {**self.lags_state.shared_state(), **self._loops.saved_state()},
            root_rank,
            "lags.shared_state",
            timeout=self._options.exchange_timeout,
        )
        self._adopt_plan(shared)
        self._phase.plan_adopted()  # the root's plan stands
        self.lags_state.adopt(shared, self._context.config.world)
        config = self._context.config
        replicated = [(f"{config.namespace}.{name}", t) for name, t in self.lags_state.replicated_memories()]
        broadcast_tensors(config.collectives, replicated, root_rank, self._options.exchange_timeout)
        if self.lags_state.iteration:
            self._loops.resume(self.lags_state.iteration)
        self.average_models()  # under local_residual: the ranks' models, each with its own residual, agree again


def _check_update_rule(saved: dict | None, mine: dict) -> None:
    """ValueError, naming the options, if a checkpoint's update rule is not this optimizer's
    (its rule's memories or residuals would not fit, or would mean something else)."""
    if saved is None:  # saved before the rule was recorded: the state's own checks decide
        return
    saved = {"rule": "momentum_correction" if saved.get("momentum_correction") else "error_feedback", **saved}
    differ = {
        name: (saved[name], mine[name])
        for name in ("rule", "dense_params")
        if name in saved and saved[name] != mine[name]
    }
    if differ:
        shown = ", ".join(f"{name}={was!r} there, {now!r} here" for name, (was, now) in differ.items())
        rules = {saved.get("rule"), mine["rule"]}
        hint = (
            f" (local_residual={saved.get('rule') == 'adam_correction_local'}; a checkpoint of Adam correction "
            "saved before the local residual was the default needs local_residual=False)"
            if rules == {"adam_correction", "adam_correction_local"}
            else ""
        )
        raise ValueError(
            f"the checkpoint was saved with another update rule ({shown}; recipe "
            f"{saved.get('recipe')!r} there, {mine['recipe']!r} here): build the optimizer "
            f"with the options it was saved with to resume it{hint}"
        )


def _residuals_foreign(saved: dict, config) -> str | None:
    """Why the residuals in ``saved`` are not this rank's (another world size, another rank,
    or no rank recorded), or None: they are."""
    world, rank = config.world, config.collectives.global_rank()
    if saved.get("world_size", world) != world:
        return f"was saved with {saved['world_size']} workers, this run has {world}"
    if "rank" not in saved:
        return "does not say which rank's residuals it holds (saved by an older lags_hvd)"
    if saved["rank"] != rank:
        return f"holds rank {saved['rank']}'s residuals, this is rank {rank}"
    return None


def _residuals_reset(reason: str, local_models: bool) -> str:
    """The warning of a load whose residuals start from zero (``reason``: ``_residuals_foreign``)."""
    message = (
        f"lags_hvd: the checkpoint {reason}: LAGS residuals start from zero "
        "(a residual is one worker's unsent gradient)"
    )
    if local_models:
        message += (
            "; under local_residual the parameters loaded with it hold that rank's residual: "
            "call optimizer.average_models() on every rank (broadcast_optimizer_state does) "
            "so that the ranks' models agree again"
        )
    return message

"""What each worker feeds its residual, and how the merged result becomes the step: one
interface, one class per variant.

``UpdateRule`` (``base``): per bucket, in the hook, ``local`` (what the bucket accumulates into
its residual, from the worker's gradient and the rule's own memories); per step, ``step``
(for a rule that applies the merged result itself). The variants:

* ``error_feedback``       the gradient itself; the wrapped optimizer steps on the merged one
                           (the paper's update, any optimizer)
* ``momentum_correction``  DGC's: SGD's velocity accumulated, ``x -= lr * merged``
* ``adam_correction``      Adam's or AdamW's preconditioned step accumulated (local moments),
                           ``x -= merged``: error feedback that is linear in what is sent
* ``local_adam_correction`` the same, each worker's parameters holding its own residual
                           (CSER): its gradient is taken where its own steps have gone

``rule_for`` picks one from the options and the wrapped optimizer. A new rule is a new
module here and a line in ``rule_for``.
"""

from .adam_correction import AdamCorrection, adam_correction_refused
from .base import UpdateRule, unscale_for_fused_step
from .error_feedback import ErrorFeedback
from .local_adam_correction import LocalAdamCorrection
from .momentum_correction import MomentumCorrection, momentum_correction_refused

__all__ = [
    "UpdateRule",
    "ErrorFeedback",
    "MomentumCorrection",
    "AdamCorrection",
    "LocalAdamCorrection",
    "rule_for",
    "momentum_correction_refused",
    "adam_correction_refused",
    "unscale_for_fused_step",
]


def rule_for(options, wrapped_class: type, param_groups, units, sparse: bool) -> UpdateRule:
    """The update rule in force. The options have resolved what does not depend on the
    optimizer (the recipe's and ``local_residual=True``'s choices); what is left is decided
    here, once: a correction set True wins (on an optimizer it cannot apply to, ValueError);
    None takes the one that fits the wrapped optimizer where at least one unit is ``sparse``
    (momentum correction for SGD with momentum, Adam correction for Adam and AdamW), else
    plain error feedback. Adam correction keeps each rank's residual in its parameters
    (``LocalAdamCorrection``) unless ``local_residual`` is False."""
    rule = _chosen_rule(options, wrapped_class, param_groups, units, sparse)
    if isinstance(rule, AdamCorrection) and options.local_residual is not False:
        return LocalAdamCorrection()
    if options.local_residual:
        raise ValueError(
            "local_residual applies under adam_correction (its residual is a step); "
            f"the update rule in force is {rule.name}"
        )
    return rule


def _chosen_rule(options, wrapped_class, param_groups, units, sparse) -> UpdateRule:
    corrections = (
        (options.momentum_correction, MomentumCorrection, momentum_correction_refused),
        (options.adam_correction, AdamCorrection, adam_correction_refused),
    )
    for chosen, rule, refused in corrections:  # an explicit choice first
        if chosen:
            reason = refused(wrapped_class, param_groups, units)
            if reason:
                asked = " (local_residual=True asks for adam_correction)" if options.local_residual else ""
                raise ValueError(reason + asked)
            return rule()
    for chosen, rule, refused in corrections:
        if chosen is None and sparse and refused(wrapped_class, param_groups, units) is None:
            return rule()
    return ErrorFeedback()

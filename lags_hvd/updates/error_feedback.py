"""Plain error feedback: the worker's gradient is accumulated, the wrapped optimizer steps on the merge."""

from __future__ import annotations

from .base import UpdateRule

__all__ = ["ErrorFeedback"]


class ErrorFeedback(UpdateRule):
    """``acc = eps + g``; the wrapped optimizer (any) steps on ``(1/P) sum_p s_p`` as on a gradient.

    The paper's update. With SGD it conserves the gradient's mass exactly; with an optimizer
    whose step is not linear in the gradient (Adam) a sent entry that waited n iterations moves
    once, by about lr, where dense training moves it n times (``AdamCorrection`` fixes that)."""

    name = "error_feedback"

    def local(self, unit, group, scale, state, dense, out):
        return [p.grad for p in unit.params], 1.0 / scale

    def replayed(self, unit, group, scale, state):
        """``local`` launches nothing and stages nothing: the gradients are the graph's inputs."""
        return ()

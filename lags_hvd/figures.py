"""matplotlib without a display: the two helpers every figure of the project uses."""

from __future__ import annotations

from pathlib import Path

__all__ = ["pyplot", "save_figure"]


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, title: str | None = None) -> None:
    """Lay out, write ``path`` as PNG (creating its folder) and free the figure."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)

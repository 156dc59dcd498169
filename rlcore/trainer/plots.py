"""curves.png: train and validation reward, KL, entropy and response length over steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PANELS = (
    ("reward", ("train/reward_mean", "val/reward_mean", "val/pass@k")),
    ("KL", ("actor/ppo_kl", "actor/reward_kl_penalty", "actor/kl_loss")),
    ("entropy", ("actor/entropy",)),
    ("response length", ("response/length_mean",)),
)


def plot_curves(records: list[dict[str, Any]], out_path: Path, *, title: str = "") -> None:
    """Draw the panels that have data into `out_path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax, (name, keys) in zip(axes, PANELS, strict=True):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="o" if key.startswith("val/") else None, ms=3, label=key)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)

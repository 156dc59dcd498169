"""curves.png: train and validation reward, the KL to the reference, the off-policy gap, entropy and
response length over steps.

A panel shows the metrics the run logged, and is left out when it has none (the reference KL of a run
without a reference). The off-policy panel is logarithmic (the clipped share and the log-prob gap are
decades apart) and draws a series only where it is above 0 at some step: the clip fraction of an
on-policy run (ratio 1) is 0 at every step and is left out. `actor/ppo_kl` is not plotted: it is 0.0 by
construction on an on-policy step, and where an update does go off-policy the clip fraction shows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Panel:
    """One subplot: its title, the metrics it may draw, and whether its y axis is logarithmic."""

    title: str
    keys: tuple[str, ...]
    log: bool = False


PANELS = (
    Panel("reward", ("train/reward_mean", "val/reward_mean", "val/pass@k")),
    Panel("KL to the reference", ("actor/kl_loss", "actor/reward_kl_penalty")),
    Panel("off-policy gap", ("actor/pg_clipfrac", "rollout/logprob_diff_mean"), log=True),
    Panel("entropy", ("actor/entropy",)),
    Panel("response length", ("response/length_mean",)),
)
"""The panels of curves.png, left to right."""


def points(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of `key` wherever a record has it."""
    return [(r["step"], r[key]) for r in records if r.get(key) is not None]


def plotted(records: list[dict[str, Any]]) -> dict[Panel, list[str]]:
    """The panels drawn and their series: the metrics logged (on a log axis: above 0 at some step)."""
    shown = {}
    for panel in PANELS:
        keys = [k for k in panel.keys if any(v > 0 or not panel.log for _, v in points(records, k))]
        if keys:
            shown[panel] = keys
    return shown


def plot_curves(records: list[dict[str, Any]], out_path: Path, *, title: str = "") -> None:
    """Draw the panels that have data into `out_path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    shown = plotted(records) or {PANELS[0]: []}  # no metrics at all: one empty panel
    fig, axes = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 3.4), squeeze=False)
    for ax, (panel, keys) in zip(axes[0], shown.items(), strict=True):
        for key in keys:
            steps, values = zip(*points(records, key), strict=True)
            ax.plot(steps, values, marker="o" if key.startswith("val/") else None, ms=3, label=key)
        if panel.log:
            ax.set_yscale("log")  # a step at exactly 0 leaves a gap
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))  # whole steps
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)

"""curves.png's panels (rlcore.trainer.plots, issue 56): what moves is drawn, a flat 0 is not."""

from __future__ import annotations

from rlcore.trainer.plots import plot_curves, plotted


def _records(**series: list[float]) -> list[dict]:
    """Steps 1.. with these metrics (one list per metric, a value per step)."""
    steps = len(next(iter(series.values())))
    return [{"step": i + 1, **{k.replace("__", "/"): v[i] for k, v in series.items()}} for i in range(steps)]


def _titles(shown) -> dict[str, list[str]]:
    return {panel.title: keys for panel, keys in shown.items()}


def test_an_on_policy_run_plots_the_log_prob_gap_not_a_flat_kl():
    """The default run: ppo_kl and the clip fraction are 0 at every step (ratio 1), the gap moves."""
    records = _records(train__reward_mean=[0.4, 0.6, 0.8], actor__ppo_kl=[0.0] * 3, actor__pg_clipfrac=[0.0] * 3,
                       rollout__logprob_diff_mean=[7e-8, 9e-8, 6e-8], actor__entropy=[0.12, 0.11, 0.09],
                       response__length_mean=[5.2, 5.6, 5.3])  # fmt: skip
    assert _titles(plotted(records)) == {
        "reward": ["train/reward_mean"],
        "off-policy gap": ["rollout/logprob_diff_mean"],
        "entropy": ["actor/entropy"],
        "response length": ["response/length_mean"],
    }


def test_a_run_with_a_reference_and_several_updates_plots_the_kl_and_the_clip_fraction():
    records = _records(train__reward_mean=[0.4, 0.6], actor__kl_loss=[0.0, 0.03], actor__ppo_kl=[1e-3, 2e-3],
                       actor__pg_clipfrac=[0.07, 0.05], rollout__logprob_diff_mean=[1e-7, 1e-7])  # fmt: skip
    records[0]["val/reward_mean"] = 0.2
    assert _titles(plotted(records)) == {
        "reward": ["train/reward_mean", "val/reward_mean"],
        "KL to the reference": ["actor/kl_loss"],
        "off-policy gap": ["actor/pg_clipfrac", "rollout/logprob_diff_mean"],
    }
    assert all("actor/ppo_kl" not in keys for keys in plotted(records).values())


def test_the_png_is_written_with_any_records(tmp_path):
    records = _records(
        train__reward_mean=[0.0, 0.0], actor__kl_loss=[0.0, -0.01], actor__pg_clipfrac=[0.0, 0.1]
    )
    assert _titles(plotted(records)) == {  # a reward of 0 and a KL at or below 0 are still drawn
        "reward": ["train/reward_mean"],
        "KL to the reference": ["actor/kl_loss"],
        "off-policy gap": ["actor/pg_clipfrac"],
    }
    for name, rows in (("some", records), ("none", [])):
        plot_curves(rows, tmp_path / f"{name}.png", title=name)
        assert (tmp_path / f"{name}.png").stat().st_size > 1000

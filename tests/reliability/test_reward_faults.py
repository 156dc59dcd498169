"""Reward faults at scale: a reward function that raises on 10% of its calls and hangs on 5% (with a child
process of its own) does not stop the run, and the run's per-step counters match what really happened.

Each call takes a ticket (its index among all calls, from the offset of a fixed-width line it appends
to a file with O_APPEND, atomic across the reward workers): tickets 3 and 13 of every 20 raise, ticket
7 hangs. It then logs "ticket decision child-pid". A step scores exactly batch_size x n = 16 samples,
once each, and steps never overlap, so ticket t belongs to step t // 16 + 1.
"""

from __future__ import annotations

from pathlib import Path

from rlcore.trainer.logger import read_metrics
from tests.reliability.helpers import RUN, STEPS, ok

PER_STEP = 4 * 4  # --data.batch-size 4 x --rollout.n 4 (SMALL)

REWARD = """
import os, subprocess, time

def _append(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, text.encode())
        return os.lseek(fd, 0, os.SEEK_CUR)
    finally:
        os.close(fd)

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    ticket = _append({tickets!r}, "call\\n") // 5 - 1
    decision = "raise" if ticket % 20 in (3, 13) else "hang" if ticket % 20 == 7 else "ok"
    child = subprocess.Popen(["sleep", "600"]) if decision == "hang" else None
    _append({log!r}, f"{{ticket}} {{decision}} {{child.pid if child else 0}}\\n")
    if decision == "raise":
        raise ValueError("injected reward failure")
    if decision == "hang":
        time.sleep(600)
    return float(solution_str.strip() == str(ground_truth))
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_raising_and_hanging_rewards_are_counted_and_leave_no_process(launch, tmp_path):
    log, reward = tmp_path / "calls.log", tmp_path / "flaky.py"
    reward.write_text(REWARD.format(tickets=str(tmp_path / "tickets"), log=str(log)))
    flags = ["--reward.custom", f"{reward}:compute_score", "--reward.num-workers", "2",
             "--reward.timeout-s", "2"]  # fmt: skip
    ok(launch.run([*RUN, *flags], out=tmp_path / "run"))
    calls = sorted((int(t), d, int(pid)) for t, d, pid in map(str.split, log.read_text().splitlines()))
    assert [t for t, _, _ in calls] == list(range(STEPS * PER_STEP))  # every sample scored once
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        decisions = [d for t, d, _ in calls if t // PER_STEP + 1 == r["step"]]
        counted = (r["reward/errors"], r["reward/timeouts"])
        assert counted == (decisions.count("raise"), decisions.count("hang")), r["step"]
    decisions = [d for _, d, _ in calls]
    assert (decisions.count("raise"), decisions.count("hang")) == (7, 3)  # 10% and 5% of 64 calls
    children = [pid for _, d, pid in calls if d == "hang"]
    assert not [pid for pid in children if _alive(pid)], "a hung reward's child process outlived the run"

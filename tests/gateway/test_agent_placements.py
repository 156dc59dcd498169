"""`--rollout.agent` under the pipeline's placements and staleness: the gateway lives with the rollout
engine (colocated: on every rank, each on its own port; split: on the rollout rank), and every batch is
stamped with the policy version that generated it (`pipeline/staleness_*`: lag mode's step t trains on
version max(0, t - 1 - K)). Each run must use the agent: `agent/turns_mean` is 2.0 only when every
episode's two calls went through its own gateway and were recorded (a session without a call is one
empty row: turns 1 on average, or less)."""

from __future__ import annotations

import json

import pytest

from rlcore.trainer.logger import read_metrics
from tests.gateway.test_agent_train import RUN, agent
from tests.smoke.test_torchrun import torchrun
from tests.smoke.test_train import ok, train

STEPS = ["--trainer.steps", "3"]  # after RUN's 2: the last wins, so K = 1 is seen twice at its bound


def fresh_and_stale(records: list[dict]) -> None:
    """Every step trained the agent's episodes; a fresh batch's log-probs are the trainer's, a stale
    batch's (sampled by the policy one update back) are not: its stamp tells the truth."""
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["agent/turns_mean"] == 2.0 and r["agent/failures"] == 0.0 for r in records), records
    for r in records:
        if r["pipeline/staleness_max"] == 0.0:
            assert r["rollout/logprob_diff_max"] < 1e-4, r
        else:  # the policy moved since these tokens were sampled (default lr: a gap of ~0.5-1)
            assert r["rollout/logprob_diff_max"] > 1e-3, r


def test_lag_mode_colocated_stamps_each_batch_with_the_version_that_sampled_it(tmp_path):
    """K = 1 in one process: step 1 trains version 0's batch (fresh), steps 2 and 3 version t - 2's."""
    proc = train(*RUN, *STEPS, *agent("two_turns"), "--pipeline.max-staleness", "1", out=tmp_path)
    ok(proc)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")[1:]
    assert [r["pipeline/staleness_max"] for r in records] == [0.0, 1.0, 1.0]
    assert [r["pipeline/staleness_mean"] for r in records] == [0.0, 1.0, 1.0]
    fresh_and_stale(records)


@pytest.mark.parametrize("mode", ["lag", "stream"])
def test_split_placement_serves_the_agent_on_the_rollout_rank(tmp_path, mode):
    """torchrun, 2 gloo ranks: rank 0 runs the engine, the gateway and the agent, rank 1 trains on what
    it sends. Lag mode: exactly the colocated schedule; stream: at most K = 1 behind."""
    proc = torchrun(*RUN, *STEPS, *agent("two_turns"), "--pipeline.placement", "split",
                    "--pipeline.rollout-ranks", "1", "--pipeline.max-staleness", "1", "--pipeline.mode", mode,
                    "--out-dir", str(tmp_path), timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3] and "val/reward_mean" in records[0]  # from rank 0
    records = records[1:]
    stale = [r["pipeline/staleness_max"] for r in records]
    if mode == "lag":
        assert stale == [0.0, 1.0, 1.0]
    else:  # which version a batch gets depends on timing, never more than K behind
        assert stale[0] == 0.0 and all(s in (0.0, 1.0) for s in stale), stale
    assert all(r["sync/bytes"] > 0 for r in records)  # the trainer rank pushed to the rollout rank's engine
    fresh_and_stale(records)


RECORDING_AGENT = '''
import os


async def run(client, row):
    """tests/gateway/agents.py's two_turns, writing down which process and which gateway served it."""
    first = await client.chat.completions.create(model="m", messages=row["prompt"], max_tokens=6)
    said = first.choices[0].message.content or ""
    again = [*row["prompt"], {"role": "assistant", "content": said}, {"role": "user", "content": "Just the answer."}]
    await client.chat.completions.create(model="m", messages=again, max_tokens=6)
    with open(LOG, "a") as f:
        f.write(f"{os.getpid()} {client.base_url.port}\\n")
    return None
'''


def test_two_colocated_ranks_each_serve_their_own_agents_on_their_own_port(tmp_path):
    """torchrun, 2 gloo ranks, colocated: each rank's gateway binds its own free port on 127.0.0.1, its
    episodes go to it alone, both ranks' samples are trained, and rank 0 alone writes the metrics."""
    log = tmp_path / "episodes.log"
    spec = tmp_path / "recording_agent.py"
    spec.write_text(f"LOG = {str(log)!r}\n{RECORDING_AGENT}")
    out = tmp_path / "run"
    proc = torchrun(*RUN, "--rollout.agent", f"{spec}:run", "--out-dir", str(out), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    served: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for line in log.read_text().splitlines():
        pid, port = line.split()
        served.setdefault(pid, set()).add(port)
        counts[pid] = counts.get(pid, 0) + 1
    assert len(served) == 2, served  # both ranks ran agents
    ports = [next(iter(p)) for p in served.values() if len(p) == 1]
    assert len(ports) == 2 and ports[0] != ports[1], served  # one gateway each, no two on one port
    # each rank: 2 of the 4 prompts x 4 episodes x 2 steps (and its validation episodes)
    assert all(c >= 16 for c in counts.values()), counts
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]  # written once, by rank 0
    for r in records[1:]:
        assert r["agent/turns_mean"] == 2.0 and r["agent/splits"] == 0.0, r  # the mean over both ranks
        assert r["rollout/logprob_diff_max"] < 1e-4, r  # the max over both ranks (a step whose rewards all tie has no gradient)
    assert (out / "final" / "model.safetensors").is_file()


SAME_QUESTION_AGENT = '''
import json
import os


async def run(client, row):
    """Every episode of every rank asks the same question once, and writes down its process and reply."""
    reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "reverse 83910462"}],
                                                 max_tokens=8)
    with open(LOG, "a") as f:
        f.write(json.dumps([os.getpid(), reply.choices[0].message.content]) + "\\n")
    return 0.0
'''


def test_two_ranks_draw_their_own_samples_for_the_same_question(tmp_path):
    """The gateway samples from the engine's own generator (the run's per-rank step seed is not used,
    `rlcore.gateway.batcher.forced`): each rank's engine must have its own stream, or both ranks draw
    the same noise (a same question: the same replies; different prompts: correlated samples)."""
    log = tmp_path / "episodes.log"
    spec = tmp_path / "same_question.py"
    spec.write_text(f"LOG = {str(log)!r}\n{SAME_QUESTION_AGENT}")
    proc = torchrun(*RUN, "--trainer.steps", "1", "--trainer.val-every", "0", "--rollout.agent", f"{spec}:run",
                    "--out-dir", str(tmp_path / "run"), timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    replies: dict[int, list[str]] = {}
    for line in log.read_text().splitlines():
        pid, text = json.loads(line)
        replies.setdefault(pid, []).append(text)
    assert len(replies) == 2 and all(len(r) == 8 for r in replies.values()), replies  # 2 prompts x 4 each
    first, second = (sorted(r) for r in replies.values())
    assert first != second, replies  # (the same stream: equal, whatever the batching)

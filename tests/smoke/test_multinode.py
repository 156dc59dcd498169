"""Past one machine: two torchrun launchers on one host stand in for two nodes of 2 ranks each.

Each "node" has its own launcher, its own cache (RLCORE_CACHE) and scratch directory (TMPDIR), as a node's
local disk; `--out-dir` is the one directory both share, as a cluster's network filesystem. The launch lines
are the documented ones (docs/cluster.md): a static rendezvous on node 0 (`--master-addr`, `--master-port`,
`--node-rank`), or torchrun's c10d rendezvous (`--rdzv-backend c10d --rdzv-endpoint --rdzv-id`), where the
launchers take their node ranks themselves.

The oracle is the `--standalone` run of the same world size: the same metrics (1e-6) and bit-identical
final weights, colocated and under split placement (the rollout ranks on node 0, the trainer ranks on
node 1), with no traceback from either launcher at a clean finish. Then one rank is SIGKILLed in the middle
of step 2 (RLCORE_TEST_KILL_AT, first attempt only): colocated a trainer rank on node 1 after its optimizer
step, split a rollout rank on node 0 with its batch generated and not sent. The other ranks' collectives
fail and each stops with one line; torchrun (`--max-restarts 1`) restarts the world, `--resume auto` (the
default) continues from step 1's checkpoint, recomputing step 2 only, and the run ends with the same
metrics and weights. Under c10d the launcher whose ranks were still alive restarts them without counting an
attempt, so the two nodes' attempt counters differ: the restarted world must still meet
(`rlcore.dist.rendezvous.meet`). Each case runs its runs in turn, so its reference is made once whichever
worker runs it.

A world that cannot form (a rank that never comes; a port held by a process that never answers) stops
each rank that came with one line and exit code 5 within `--trainer.rendezvous-timeout-s`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.trainer.logger import read_metrics
from tests.frames import our_frames
from tests.smoke.test_split import assert_same_metrics, assert_same_weights
from tests.smoke.test_train import ROOT, SMALL

ARGS = [*SMALL, "--trainer.steps", "3", "--trainer.save-every", "1", "--trainer.val-every", "0", "--optim.lr", "1e-2"]
PLACEMENTS = {"colocate": [], "split": ["--pipeline.placement", "split", "--pipeline.rollout-ranks", "2"]}
KILLS = {"colocate": "2:update:3", "split": "2:rollout:0"}
SHARDS = {"colocate": [f"dcp/__{r}_0.distcp" for r in range(4)],
          "split": ["dcp/__0_0.distcp", "dcp/__1_0.distcp", "tensors_rank0.pt", "tensors_rank1.pt"]}  # fmt: skip
"""Each rank's files in a checkpoint: colocated, the 4 ranks' DCP shards; split, the 2 trainer ranks' shards
and the 2 rollout ranks' batches generated ahead."""
ENV = {"OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Each launcher's (exit code, stderr)."""
    try:
        return [(p.wait(timeout=timeout), p.communicate()[1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the ranks too, not only the launcher


def _launch(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *cmd], cwd=ROOT, env=os.environ | ENV | env,
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)  # fmt: skip


def standalone(out: Path, placement: str) -> None:
    [(code, err)] = _wait([_launch(["--standalone", "--nproc-per-node", "4", str(ROOT / "train.py"), "grpo", *ARGS,
                                    *PLACEMENTS[placement], "--out-dir", str(out)], {})], timeout=300)  # fmt: skip
    assert code == 0, err[-3000:]


RENDEZVOUS = {
    "static": lambda node, port: ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)],
    "c10d": lambda node, port: ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job-1"],
}  # fmt: skip
"""Each rendezvous's launch flags for a node (c10d: the launchers take their node ranks themselves)."""
CASES = [("colocate", "static", True), ("split", "static", True), ("colocate", "c10d", True), ("split", "c10d", False)]
"""(placement, rendezvous, whether the uninterrupted two-node run is checked too): c10d split is checked on
its killed run alone, to keep the suite short."""


def two_nodes(out: Path, placement: str, scratch: Path, *, rendezvous: str = "static",
              kill: str = "") -> list[tuple[int, str]]:  # fmt: skip
    """Two launchers of 2 ranks each (a documented launch line); `kill`: RLCORE_TEST_KILL_AT, one restart."""
    port, procs = _free_port(), []
    for node in (0, 1):
        local = {"RLCORE_CACHE": scratch / f"node{node}-cache", "TMPDIR": scratch / f"node{node}-tmp"}
        for path in local.values():
            path.mkdir(exist_ok=True)
        env = {k: str(v) for k, v in local.items()} | ({"RLCORE_TEST_KILL_AT": kill} if kill else {})
        procs.append(_launch(["--nnodes", "2", "--nproc-per-node", "2", *RENDEZVOUS[rendezvous](node, port),
                              "--max-restarts", "1" if kill else "0", str(ROOT / "train.py"), "grpo", *ARGS,
                              *PLACEMENTS[placement], "--out-dir", str(out)], env))  # fmt: skip
    return _wait(procs, timeout=300)


def _check_clean(expected: Path, clean: Path, placement: str, results: list[tuple[int, str]]) -> None:
    for code, err in results:
        assert code == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]  # a clean finish prints none on either launcher
    assert_same_metrics(expected, clean)
    assert_same_weights(expected, clean)
    assert [r["step"] for r in read_metrics(clean / "metrics.jsonl")] == [1, 2, 3]  # rank 0 alone writes them
    newest = clean / "checkpoints" / "step_3"  # every rank's files in the shared directory
    assert sorted(str(p.relative_to(newest)) for p in newest.rglob("*_0.distcp")) + sorted(
        p.name for p in newest.glob("tensors_rank*.pt")) == SHARDS[placement]  # fmt: skip


@pytest.mark.parametrize(("placement", "rendezvous", "uninterrupted"), CASES)
def test_two_nodes_equal_one_world_and_survive_a_lost_rank(placement, rendezvous, uninterrupted, tmp_path):
    expected = tmp_path / "standalone"
    standalone(expected, placement)
    if uninterrupted:
        clean = tmp_path / "two-nodes"
        _check_clean(expected, clean, placement, two_nodes(clean, placement, tmp_path, rendezvous=rendezvous))

    killed = tmp_path / "killed"
    results = two_nodes(killed, placement, tmp_path, rendezvous=rendezvous, kill=KILLS[placement])
    for code, err in results:
        assert code == 0, err[-3000:]  # torchrun restarted the world once and it finished
        assert not our_frames(err), err[-3000:]  # the survivors stopped with one line each, no traceback
    lost = [line for _, err in results for line in err.splitlines() if "another rank was lost" in line]
    assert lost and all(line.startswith("error: ") for line in lost), lost
    assert_same_metrics(expected, killed)
    assert_same_weights(expected, killed)
    assert [r["step"] for r in read_metrics(killed / "metrics.jsonl")] == [1, 2, 3]  # step 2 recomputed, logged once


def _one_rank(rank: int, port: int, out: Path) -> tuple[int, str]:
    """One rank of a world of 2 started alone (no torchrun), the rendezvous timeout at 3 s."""
    env = os.environ | ENV | {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": str(port)}  # fmt: skip
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *SMALL, "--trainer.rendezvous-timeout-s", "3",
                           "--out-dir", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)  # fmt: skip
    return proc.returncode, proc.stderr


def test_a_world_that_cannot_form_stops_each_rank_with_one_line(tmp_path):
    """Rank 0 alone: its peer never comes. Rank 1 alone, its MASTER_PORT held by a process that accepts
    connections and never answers: the store never answers. Each exits 5 with one line naming its rank and
    the store, well before a hang would end."""
    code, err = _one_rank(0, _free_port(), tmp_path / "rank0")
    assert code == 5 and not our_frames(err), err[-3000:]
    [line] = [x for x in err.splitlines() if x.startswith("error: ")]
    assert "rank 0 of 2 (no torchrun: env:// rendezvous)" in line and "did not form within 3 s" in line
    assert "rank(s) 1 did not arrive" in line

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        code, err = _one_rank(1, port, tmp_path / "rank1")
    assert code == 5 and not our_frames(err), err[-3000:]
    [line] = [x for x in err.splitlines() if x.startswith("error: ")]
    assert "rank 1 of 2" in line and f"127.0.0.1:{port}" in line and "never answered" in line

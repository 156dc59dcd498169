"""Past one machine (issue 62): two torchrun launchers on one host stand in for two nodes of 2 ranks each.

Each "node" has its own launcher (`--node-rank`), its own cache (RLCORE_CACHE) and scratch directory
(TMPDIR), as a node's local disk; `--out-dir` is the one directory both share, as a cluster's network
filesystem. The launch line is the documented one (docs/cluster.md): a static rendezvous on node 0
(`--master-addr`, `--master-port`). (The c10d rendezvous trains alike, but the launcher that hosts its
store logs a `DistNetworkError` traceback at a clean exit when the other leaves last: torchrun's doing.)

The oracle is the `--standalone` run of the same world size: the same metrics (1e-6) and bit-identical
final weights, colocated and under split placement (the rollout ranks on node 0, the trainer ranks on
node 1). Then one rank is SIGKILLed in the middle of step 2 (RLCORE_TEST_KILL_AT, first attempt only):
colocated a trainer rank on node 1 after its optimizer step, split a rollout rank on node 0 with its batch
generated and not sent. The other ranks' collectives fail and each stops with one line; torchrun
(`--max-restarts 1`) restarts the world, `--resume auto` (the default) continues from step 1's checkpoint,
recomputing step 2 only, and the run ends with the same metrics and weights. One test per placement runs
its three runs in turn, so the reference is made once whichever worker runs it.
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


def two_nodes(out: Path, placement: str, scratch: Path, *, kill: str = "") -> list[tuple[int, str]]:
    """Two launchers of 2 ranks each (the documented launch line); `kill`: RLCORE_TEST_KILL_AT, one restart."""
    port, procs = _free_port(), []
    for node in (0, 1):
        local = {"RLCORE_CACHE": scratch / f"node{node}-cache", "TMPDIR": scratch / f"node{node}-tmp"}
        for path in local.values():
            path.mkdir(exist_ok=True)
        env = {k: str(v) for k, v in local.items()} | ({"RLCORE_TEST_KILL_AT": kill} if kill else {})
        procs.append(_launch(["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node), "--master-addr",
                              "127.0.0.1", "--master-port", str(port), "--max-restarts", "1" if kill else "0",
                              str(ROOT / "train.py"), "grpo", *ARGS, *PLACEMENTS[placement], "--out-dir", str(out)],
                             env))  # fmt: skip
    return _wait(procs, timeout=300)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_two_nodes_equal_one_world_and_survive_a_lost_rank(placement, tmp_path):
    expected = tmp_path / "standalone"
    standalone(expected, placement)

    clean = tmp_path / "two-nodes"
    for code, err in two_nodes(clean, placement, tmp_path):
        assert code == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]  # a clean finish prints none on either launcher
    assert_same_metrics(expected, clean)
    assert_same_weights(expected, clean)
    assert [r["step"] for r in read_metrics(clean / "metrics.jsonl")] == [1, 2, 3]  # rank 0 alone writes them
    newest = clean / "checkpoints" / "step_3"  # every rank's files in the shared directory
    assert sorted(str(p.relative_to(newest)) for p in newest.rglob("*_0.distcp")) + sorted(
        p.name for p in newest.glob("tensors_rank*.pt")) == SHARDS[placement]  # fmt: skip

    killed = tmp_path / "killed"
    results = two_nodes(killed, placement, tmp_path, kill=KILLS[placement])
    for code, err in results:
        assert code == 0, err[-3000:]  # torchrun restarted the world once and it finished
        assert not our_frames(err), err[-3000:]  # the survivors stopped with one line each, no traceback
    lost = [line for _, err in results for line in err.splitlines() if "another rank was lost" in line]
    assert lost and all(line.startswith("error: ") for line in lost), lost
    assert_same_metrics(expected, killed)
    assert_same_weights(expected, killed)
    assert [r["step"] for r in read_metrics(killed / "metrics.jsonl")] == [1, 2, 3]  # step 2 recomputed, logged once

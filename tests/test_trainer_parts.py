"""Pieces of the trainer shell tested without running it: divergence abort, seeds, group filtering."""

from __future__ import annotations

import pytest
import torch

from rlcore.batch import Batch
from rlcore.step.learn import TrainingDiverged, check_bad_updates
from rlcore.step.steps import filter_groups, group_ids
from rlcore.trainer.run import step_seed


def test_k_consecutive_bad_updates_abort_naming_the_step_and_the_last_finite_metrics():
    last = check_bad_updates(0, 4, {"actor/pg_loss": 0.5, "actor/grad_norm": float("nan")}, {}, limit=2)
    assert last == {"actor/pg_loss": 0.5}
    last = check_bad_updates(
        2, 5, {"actor/pg_loss": float("nan")}, last, limit=2
    )  # 2 in a row: still allowed
    assert last == {"actor/pg_loss": 0.5}
    with pytest.raises(
        TrainingDiverged, match=r"step 6: 3 consecutive .* last finite metrics: actor/pg_loss=0\.5"
    ):
        check_bad_updates(3, 6, {"actor/pg_loss": float("nan")}, last, limit=2)


def test_step_seeds_depend_on_seed_step_and_purpose_only():
    assert step_seed(0, 3, "train0") == step_seed(0, 3, "train0")
    assert len({step_seed(0, 3, "train0"), step_seed(1, 3, "train0"), step_seed(0, 4, "train0"),
                step_seed(0, 3, "val")}) == 4  # fmt: skip


def test_filter_groups_keeps_groups_with_a_signal():
    scores = torch.zeros(6, 2)
    scores[:, 1] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5])  # groups a (varied), b (all 1), c (all 0.5)
    batch = Batch.from_dict({"token_scores": scores, "uid": ["a", "a", "b", "b", "c", "c"]})
    kept, n_kept, n_seen = filter_groups(batch)
    assert (n_kept, n_seen) == (1, 3)
    assert kept["uid"] == ["a", "a"]
    assert group_ids(batch).tolist() == [0, 0, 1, 1, 2, 2]


def test_rollouts_of_different_widths_concatenate_with_prompts_left_and_responses_right_padded():
    """Dynamic sampling's rounds have their own widths; the log-probs of the joined batch are each round's."""
    from rlcore.models import load_policy
    from rlcore.models.forward import compute_logprobs
    from rlcore.step.steps import concat_rollouts
    from tests.dist.rollouts import fake_rollout

    a = fake_rollout(2, 2, max_prompt=5, max_response=3, seed=1)
    b = fake_rollout(1, 2, max_prompt=3, max_response=6, seed=2)
    ab = concat_rollouts([a, b], pad_token_id=0)
    p, t = 5, max(a["responses"].shape[1], b["responses"].shape[1])
    assert ab["input_ids"].shape == (6, p) and ab["responses"].shape == (6, t)
    pb, tb = b["input_ids"].shape[1], b["responses"].shape[1]
    assert torch.equal(ab["attention_mask"][4:, p - pb :], b["attention_mask"])  # left-padded
    assert ab["attention_mask"][4:, : p - pb].sum() == 0
    assert torch.equal(ab["response_mask"][4:, :tb], b["response_mask"])  # right-padded
    assert torch.equal(ab["advantages"][:4, : a["responses"].shape[1]], a["advantages"])
    assert ab["uid"] == a["uid"] + b["uid"]
    model, _ = load_policy("builtin:tiny")
    joined, _ = compute_logprobs(model, ab)
    for rows, part in ((slice(0, 4), a), (slice(4, 6), b)):
        alone, _ = compute_logprobs(model, part)
        w = part["responses"].shape[1]
        torch.testing.assert_close(joined[rows, :w] * part["response_mask"], alone * part["response_mask"])


def test_pending_batches_round_trip_through_checkpoint_tensors_and_refuse_non_json():
    from rlcore.state import Rollout, rollouts_from_tensors, rollouts_to_tensors

    batch = Batch.from_dict({"responses": torch.arange(6).view(2, 3), "mask": torch.ones(2, 3),
                             "uid": ["a", "b"], "ground_truth": [{"x": [1, 2]}, None]}, meta={"k": 1})  # fmt: skip
    pending = (Rollout(step=4, batch=batch, metrics={"train/reward_mean": 0.5}, version=2),
               Rollout(step=5, batch=batch[:1], metrics={}, version=3))  # fmt: skip
    back = rollouts_from_tensors(rollouts_to_tensors(pending))
    assert [(r.step, r.version, dict(r.metrics)) for r in back] == [
        (4, 2, {"train/reward_mean": 0.5}),
        (5, 3, {}),
    ]
    for got, sent in zip(back, pending, strict=True):
        assert got.batch.keys() == sent.batch.keys() and dict(got.batch.meta) == dict(sent.batch.meta)
        assert all(torch.equal(got.batch[k], sent.batch[k]) for k in sent.batch.tensors)
        assert dict(got.batch.non_tensors) == dict(sent.batch.non_tensors)
    bad = (Rollout(step=1, batch=batch.with_(blob=[b"x", b"y"]), metrics={}, version=0),)
    with pytest.raises(
        ValueError, match="the batch of step 1, generated ahead, holds a value JSON cannot carry"
    ):
        rollouts_to_tensors(bad)


def test_cpu_builds_with_torch_under_a_path_with_a_space_are_refused_with_one_line(monkeypatch):
    """torch's inductor cannot link CPU kernels when torch lives under a path with a space (measured on a
    checkout in `my runs/`): --rollout.compile and vLLM on CPU are refused before any model loads."""
    import dataclasses
    from pathlib import Path

    from configs import PRESETS, ConfigError
    from rlcore.config.model_checks import check_engine
    from rlcore.rollout import toolchain

    spaced = Path("/tmp/my runs/rlcore/.venv/lib/python3.11/site-packages/torch")
    assert toolchain.cpu_compile_problem(Path("/tmp/rlcore/.venv/lib/python3.11/site-packages/torch")) is None
    assert toolchain.cpu_compile_problem(spaced).startswith(
        f"torch is installed under '{spaced}', a path with"
    )
    cfg = PRESETS["grpo"][1]
    compiled = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, compile=True))
    on_cpu = type("Dist", (), {"device": torch.device("cpu")})()
    monkeypatch.setattr(toolchain, "TORCH_DIR", Path("/opt/venv/torch"))
    check_engine(compiled, on_cpu)  # no space: nothing to refuse
    monkeypatch.setattr(toolchain, "TORCH_DIR", spaced)
    with pytest.raises(ConfigError, match=r"^--rollout.compile: torch is installed under '/tmp/my runs/"):
        check_engine(compiled, on_cpu)
    check_engine(cfg, on_cpu)  # the eager native engine builds nothing


def test_version_tags_by_hand():
    """Partial rollouts: version 0 from the start, 1 from each row's token 2 / 3, 2 from token 4."""
    from rlcore.step.partial import version_tags

    changes = [(torch.tensor([2, 3]), 1), (torch.tensor([4, 4]), 2)]
    assert version_tags((2, 5), 0, changes).tolist() == [[0, 0, 1, 1, 2], [0, 0, 0, 1, 2]]
    assert version_tags((1, 3), 7, []).tolist() == [[7, 7, 7]]

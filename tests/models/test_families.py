"""Model families as records (issue 58): the compatibility table, and the two families added as one file each
(Gemma-3 text, gpt-oss) training through train.py on random-init models of a few hundred thousand parameters."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, GptOssConfig

from rlcore.models.families import FAMILIES, FEATURES, compatibility, covering, family_of
from rlcore.models.tokenizer import build_char_tokenizer
from tests.smoke.test_train import SMALL, ok, train

SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256)  # fmt: skip


def config_of(family: str):
    tok = build_char_tokenizer()
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)  # fmt: skip
    if family == "gemma3_text":  # every 2nd layer global, the others an 8-token sliding window
        return Gemma3TextConfig(**SIZES, **ids, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2)
    assert family == "gpt_oss"
    return GptOssConfig(**SIZES, **ids, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"] * 2)  # fmt: skip


@pytest.fixture(scope="module", params=["gemma3_text", "gpt_oss"])
def family_dir(request, tmp_path_factory) -> tuple[str, str]:
    """(model_type, a directory holding a random-init model of it and the built-in character tokenizer)."""
    directory = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of(request.param))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name:
                p.normal_(0.0, 0.5)  # routers that start apart: routes worth replaying
    model.save_pretrained(directory)
    build_char_tokenizer().save_pretrained(directory)
    return request.param, str(directory)


def test_every_feature_of_every_family_is_available_or_says_why():
    """The compatibility table has an answer for each (family, feature): None, or a phrase; and a family with
    no record gets nothing its record would have to vouch for."""
    table = compatibility()
    assert [name for name, _ in table] == [f.name for f in FAMILIES.values()]
    for _, row in table:
        assert set(row) == set(FEATURES)
        assert all(why is None or (why and "\n" not in why) for why in row.values())
    unknown = family_of(type("Config", (), {"model_type": "phi3"})())
    assert unknown.model_type == "phi3" and "phi3" in unknown.name
    assert all(unknown.refusal(f) is not None for f in ("lean", "tp", "ep", "router-replay", "exact", "selective"))
    assert covering("lean") == ["llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"]
    assert covering("tp") == ["llama", "mistral", "qwen2", "qwen3"]
    assert "gemma3_text" not in covering("exact") and "gpt_oss" in covering("router-replay")


def test_exact_mode_on_a_family_it_does_not_cover_is_one_line_before_any_weights_load(family_dir, tmp_path):
    """Gemma-3's rotary embedding takes a layer type (the table that crashed with a TypeError at fdce50b);
    gpt-oss's attention has sinks: both refused by their records, exit 2, before the model loads."""
    family, directory = family_dir
    proc = train("grpo", *SMALL, "--model.path", directory, "--rollout.exact", "--trainer.steps", "1", out=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: --rollout.exact with --model.path {directory}: {FAMILIES[family].name}: ")
    assert FAMILIES[family].refusal("exact") in line and "llama" in line  # what it covers instead
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_new_family_trains_with_the_engine_and_trainer_agreeing(family_dir, lora, tmp_path):
    """Two GRPO steps through train.py with the native engine (the Hugging Face decode step, as the record
    names), full fine-tuning and LoRA; gpt-oss also records and replays its routes (R3). The engine's and
    the trainer's log-probs of the sampled tokens agree to 1e-5 at both steps (the second after an update,
    which has a gradient: an entropy bonus)."""
    family, directory = family_dir
    extra = ["--model.lora-rank", "4", "--optim.lr", "1e-2"] if lora else ["--optim.lr", "1e-3"]
    extra += ["--algo.entropy-coef", "0.01"]  # a gradient even where a random model's rewards all tie
    if family == "gpt_oss":
        extra += ["--algo.router-replay", "replay"]
    proc = train("grpo", *SMALL, "--model.path", directory, "--trainer.steps", "2", "--trainer.val-every", "0",
                 *extra, out=tmp_path)  # fmt: skip
    ok(proc)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "actor/grad_norm" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert all(r["rollout/logprob_diff_max"] < 1e-5 for r in trained), [r["rollout/logprob_diff_max"] for r in trained]
    assert all(r["actor/grad_norm"] > 0 for r in trained)
    if family == "gpt_oss":  # routes recorded by the engine, compared with the trainer's own, replayed
        assert all(r["rollout/router_agreement"] > 0.95 for r in trained), trained

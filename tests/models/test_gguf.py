"""GGUF checkpoints as model paths (rlcore.models.gguf), on the real SmolLM2-135M-Instruct Q4_1 file: the
dequantized model equals transformers' own GGUF load, the tokenizer, chat template, stop and pad tokens
are the file's, the cache is reused; files rlcore cannot use are refused in one line."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlcore.models import gguf as rl_gguf
from rlcore.models.policy import load_model, load_tokenizer
from tests.real_model import smollm2_gguf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def real() -> Path:
    return smollm2_gguf()


def test_the_dequantized_model_equals_transformers_own_gguf_load(real):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours, tokenizer = load_model(str(real)), load_tokenizer(str(real))
    theirs = AutoModelForCausalLM.from_pretrained(
        real.parent, gguf_file=real.name, dtype=torch.float32
    ).eval()
    their_tokenizer = AutoTokenizer.from_pretrained(real.parent, gguf_file=real.name)
    messages = [{"role": "user", "content": "What is 17 + 25?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == their_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
    )  # the file's default
    assert text.endswith("<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n")
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    assert ids.tolist() == [their_tokenizer(text)["input_ids"]]
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
    # stop and pad as the file says: ChatML's end of turn, which is also the generation config's eos
    assert (
        tokenizer.eos_token == "<|im_end|>"
        and tokenizer.eos_token_id == 2 == ours.generation_config.eos_token_id
    )
    assert tokenizer.pad_token_id == 2 and ours.config.tie_word_embeddings
    assert (
        ours.config.num_hidden_layers,
        ours.config.num_attention_heads,
        ours.config.num_key_value_heads,
    ) == (30, 9, 3)


def test_the_cache_is_reused_and_keyed_by_content(real, monkeypatch, tmp_path):
    directory = rl_gguf.dequantized_directory(real)
    before = (directory / "model.safetensors").stat().st_mtime_ns

    def no_second_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(rl_gguf, "_convert", no_second_conversion)
    assert rl_gguf.dequantized_directory(real) == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == before
    assert (directory / "SOURCE").read_text().strip() == str(real.resolve())
    copy = tmp_path / real.name  # the same bytes in another file: the same entry
    shutil.copyfile(real, copy)
    assert rl_gguf.dequantized_directory(copy) == directory


def _write(path: Path, arch: str, quant: str | None = None) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    if quant is None:
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    else:
        kind = gguf.GGMLQuantizationType[quant]
        writer.add_tensor(
            "token_embd.weight", np.zeros(gguf.GGML_QUANT_SIZES[kind][1], np.uint8), raw_dtype=kind
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_files_rlcore_cannot_use_are_refused_in_one_line(tmp_path):
    pytest.importorskip("gguf")
    cases = {
        _write(tmp_path / "t5.gguf", "t5"): "GGUF architecture 't5' is not one rlcore trains",
        _write(
            tmp_path / "q8k.gguf", "llama", "Q8_K"
        ): "tensor token_embd.weight is quantized as Q8_K, which",
        tmp_path / "missing.gguf": "no such GGUF file",
    }
    for path, says in cases.items():
        with pytest.raises(ValueError, match=r"^model path ") as caught:
            rl_gguf.dequantized_directory(path)
        assert says in str(caught.value) and "\n" not in str(caught.value)
    # through train.py: exit 2, one line, before any model loads
    proc = subprocess.run([sys.executable, "train.py", "--model.path", str(tmp_path / "t5.gguf"),
                           "--out-dir", str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("error: ") and "GGUF architecture 't5' is not one rlcore trains" in lines[0]


def test_a_missing_gguf_package_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError, as when absent
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"^model path ") as caught:
        rl_gguf.check_file(path)
    assert "reading GGUF needs the gguf package; pip install gguf accelerate" in str(caught.value)

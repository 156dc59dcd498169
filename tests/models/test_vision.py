"""Vision-language policies (issue 37): images in rows, M-RoPE positions, the native engine with images, the
batch and checkpoint layout of the vision inputs, and bad images refused."""

from __future__ import annotations

import base64
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlcore.batch import Batch
from rlcore.data.dataset import PromptDataset
from rlcore.data.images import with_image_parts
from rlcore.data.prompts import make_prompt_batch
from rlcore.data.rows import DataError, read_rows, row_from_dict
from rlcore.data.vision import rope_positions
from rlcore.dist.transfer import rows_from_json, rows_to_json
from rlcore.models.forward import compute_logprobs
from rlcore.models.vision import placeholder_ids
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.native.engine import NativeEngine
from rlcore.state import Rollout, rollouts_from_tensors, rollouts_to_tensors
from rlcore.step.steps import concat_rollouts
from tests.models.vl_models import model, png, tokenizer, vision

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def rows():
    """Two images of different shapes in one prompt, a text-only prompt, one image after text."""
    return [
        row_from_dict({"data_source": "x", "prompt": [{"role": "user", "content": "<image>how many? <image>"}],
                       "images": [{"bytes": png("red")}, {"bytes": png("blue", (96, 48))}]}, "r0"),
        row_from_dict({"data_source": "x", "prompt": "plain text"}, "r1"),
        row_from_dict({"data_source": "x", "prompt": "look: <image>", "images": [{"bytes": png("green")}]}, "r2"),
    ]  # fmt: skip


def test_rope_positions_by_hand():
    # text, text, one image of grid (1, 4, 4) -> 2 x 2 merged tokens, text. Image tokens at start 2 +
    # (0, row, col); the text after starts at 2 + max(2, 2) = 4.
    ids = torch.tensor([5, 6, 9, 9, 9, 9, 7])
    got = rope_positions(ids, torch.tensor([[1, 4, 4]]), image_token_id=9, merge=2)
    expected = torch.tensor([[0, 1, 2, 2, 2, 2, 4], [0, 1, 2, 2, 3, 3, 4], [0, 1, 2, 3, 2, 3, 4]])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_positions_equal_each_family_get_rope_index(family):
    m, vp = model(family), vision(family)
    batch = make_prompt_batch(rows(), tokenizer(), vision=vp)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    grids = torch.cat([x["image_grid_thw"] for x in batch["multi_modal_inputs"] if x])
    theirs, _ = m.model.get_rope_index(ids, (ids == vp.image_token_id).int(), grids, attention_mask=mask)
    assert torch.equal(theirs.transpose(0, 1) * mask[:, None], batch["rope_positions"])


def hf_logprobs(m, out: Batch) -> torch.Tensor:
    """Log-probs of the responses by the Hugging Face forward over each whole row alone, its rotary
    positions computed by the model itself (`mm_token_type_ids`), placeholders suppressed as rlcore does."""
    result = torch.zeros_like(out["rollout_logprobs"])
    for i in range(len(out)):
        keep = out["attention_mask"][i].bool()
        t = int(out["response_mask"][i].sum())
        ids = torch.cat([out["input_ids"][i][keep], out["responses"][i][:t]])[None]
        image = out["multi_modal_inputs"][i]
        with torch.no_grad():
            logits = m(input_ids=ids, mm_token_type_ids=(ids == m.config.image_token_id).int(), **image).logits
        logits[..., placeholder_ids(m)] = -1e9
        logp = torch.log_softmax(logits[0, -t - 1 : -1].float(), dim=-1)
        result[i, :t] = logp.gather(-1, ids[0, -t:, None])[:, 0]
    return result


@pytest.mark.parametrize("family", FAMILIES)
def test_native_engine_with_images_equals_the_hf_forward(family):
    m, vp = model(family), vision(family)
    prompts = make_prompt_batch(rows(), tokenizer(), vision=vp)
    out = NativeEngine(m, tokenizer()).generate(prompts, SamplingParams(n=3, max_tokens=10, seed=0))
    mask = out["response_mask"]
    assert mask.sum() > 3 * 3 * 5  # prefill and many decode steps
    reference = hf_logprobs(m, out)
    assert ((reference - out["rollout_logprobs"]).abs() * mask).max() <= 1e-5  # prefill + decode
    ours, _ = compute_logprobs(m, out, max_tokens=64)  # the trainer's pass, token-budget micro-batches
    assert ((ours - reference).abs() * mask).max() <= 1e-5
    text = (out["attention_mask"].cumsum(-1) - 1).clamp(min=0)[:, None, :].expand(-1, 3, -1)  # (b, 3, p)
    plain, _ = compute_logprobs(m, out.with_(rope_positions=text, overwrite=True))
    assert ((plain - reference).abs() * mask).max() > 1e-3  # the M-RoPE positions matter
    no_rope = out.select(*(k for k in out.keys() if k != "rope_positions"))  # noqa: SIM118
    with pytest.raises(ValueError, match=r"Qwen.* batch has no rope_positions: build its prompts with"):
        compute_logprobs(m, no_rope)  # decided by the family's record, not by the fields a batch holds
    with pytest.raises(ValueError, match="has no multi_modal_inputs"):
        NativeEngine(m, tokenizer()).generate(prompts.select("input_ids", "attention_mask", "rope_positions"),
                                              SamplingParams(max_tokens=2))  # fmt: skip


def test_the_engine_never_samples_a_placeholder():
    m, tok = model("qwen2_vl"), tokenizer()
    with torch.no_grad():  # make the image token the likeliest next token everywhere
        m.lm_head.weight[m.config.image_token_id] = m.lm_head.weight.abs().max() * 50
    prompts = make_prompt_batch(rows(), tok, vision=vision("qwen2_vl"))
    out = NativeEngine(m, tok).generate(prompts, SamplingParams(n=4, max_tokens=6, seed=0))
    assert not (out["responses"] == m.config.image_token_id).any()
    lp, _ = compute_logprobs(m, out)
    assert ((lp - out["rollout_logprobs"]).abs() * out["response_mask"]).max() <= 1e-5


def test_rows_with_images_from_parquet_and_jsonl_equal_a_hand_built_processor_call(tmp_path):
    red, blue = png("red"), png("blue", (64, 32))
    (tmp_path / "b.png").write_bytes(blue)
    prompt = [{"role": "user", "content": "<image>count the <image>"}]
    pq.write_table(pa.Table.from_pylist([{"data_source": "x", "prompt": prompt,
                   "images": [{"bytes": red, "path": None}, {"bytes": blue, "path": None}]}]), tmp_path / "a.parquet")  # fmt: skip
    line = {"data_source": "x", "prompt": prompt,
            "images": [{"base64": base64.b64encode(red).decode()}, str(tmp_path / "b.png")]}  # fmt: skip
    (tmp_path / "a.jsonl").write_text(json.dumps(line) + "\n")
    tok, vp = tokenizer(), vision("qwen2_vl")
    ds = PromptDataset(read_rows([tmp_path / "a.parquet", tmp_path / "a.jsonl"]), tok, vision=vp, shuffle=False)
    batch = next(ds.iter_batches(2))
    # by hand: the image processor on the decoded images, each placeholder run as long as its merged grid
    from PIL import Image

    images = [Image.open(tmp_path / "b.png").convert("RGB")]
    import io

    images.insert(0, Image.open(io.BytesIO(red)).convert("RGB"))
    pixels = vp.image_processor(images=images, return_tensors="pt")
    counts = (pixels["image_grid_thw"].prod(-1) // 4).tolist()
    text = tok.apply_chat_template(with_image_parts(prompt), add_generation_prompt=True, tokenize=False)
    first, middle, last = text.split("<|image_pad|>")
    text = first + "<|image_pad|>" * counts[0] + middle + "<|image_pad|>" * counts[1] + last
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    for row in range(2):  # parquet, jsonl
        assert torch.equal(batch["input_ids"][row], ids)
        got = batch["multi_modal_inputs"][row]
        assert torch.equal(got["pixel_values"], pixels["pixel_values"].float())
        assert torch.equal(got["image_grid_thw"], pixels["image_grid_thw"])


def test_batch_operations_checkpoints_and_concat_keep_the_vision_inputs():
    m, tok, vp = model("qwen2_vl"), tokenizer(), vision("qwen2_vl")
    out = NativeEngine(m, tok).generate(make_prompt_batch(rows(), tok, vision=vp), SamplingParams(n=2, max_tokens=4))
    images = out["multi_modal_inputs"]
    assert images[0]["pixel_values"] is images[1]["pixel_values"]  # a prompt's samples share its tensors
    picked = out[[5, 0]]
    assert picked["multi_modal_inputs"][1] is images[0] and torch.equal(picked["rope_positions"][0], out["rope_positions"][5])
    joined = Batch.concat(out.chunk(3))
    assert all(a is b for a, b in zip(joined["multi_modal_inputs"], images, strict=True))
    # a checkpointed pending batch: every tensor once, equal bit for bit, shared again
    tensors = rollouts_to_tensors((Rollout(step=3, batch=out, metrics={}, version=2),))
    assert sum(k.startswith("pending/0/rows/") for k in tensors) == 2 * 2 + 0  # 2 prompts with images x 2 fields
    back = rollouts_from_tensors(tensors)[0].batch["multi_modal_inputs"]
    for got, sent in zip(back, images, strict=True):
        assert got.keys() == sent.keys() and all(torch.equal(got[k], sent[k]) for k in sent)
    assert back[0]["pixel_values"] is back[1]["pixel_values"]
    doc, shared = rows_to_json({"x": [images[0], images[0]]})
    assert len(shared) == 2 and rows_from_json(doc, shared)["x"][1]["image_grid_thw"] is shared[1]
    # rollouts of different prompt widths join with their rotary positions left-padded like the ids
    narrow = NativeEngine(m, tok).generate(make_prompt_batch(rows()[1:2], tok, vision=vp), SamplingParams(max_tokens=4))
    both = concat_rollouts([out, narrow], tok.pad_token_id)
    p = out["input_ids"].shape[1]
    assert both["rope_positions"].shape == (len(out) + 1, 3, p)
    assert torch.equal(both["rope_positions"][-1, :, p - narrow["input_ids"].shape[1] :], narrow["rope_positions"][0])
    lp, _ = compute_logprobs(m, both)
    assert ((lp - both["rollout_logprobs"]).abs() * both["response_mask"]).max() <= 1e-5


def test_bad_images_are_one_line_naming_the_row(tmp_path):
    tok, vp = tokenizer(), vision("qwen2_vl")
    bad = {"data_source": "x", "prompt": "<image>?", "images": [{"bytes": b"not an image"}]}
    with pytest.raises(DataError, match=r"^r7: field 'images\[0\]': cannot decode the image \(not an image format PIL reads\)$"):
        make_prompt_batch([row_from_dict(bad, "r7")], tok, vision=vp)
    missing = {**bad, "images": [{"path": str(tmp_path / "none.png")}]}
    with pytest.raises(DataError, match=r"^r1: field 'images\[0\]': image file .*none\.png not found$"):
        make_prompt_batch([row_from_dict(missing, "r1")], tok, vision=vp)
    with pytest.raises(DataError, match=r"^r2: field 'images' holds 2 images but the prompt has 1 <image> placeholders"):
        row_from_dict({**bad, "images": [{"bytes": png("red")}] * 2}, "r2")
    with pytest.raises(DataError, match=r"^r3: field 'images\[0\]' is not an image"):
        row_from_dict({**bad, "images": [42]}, "r3")
    with pytest.raises(DataError, match=r"^r4: field 'images': the model is not a vision-language model"):
        make_prompt_batch([row_from_dict({**bad, "images": [{"bytes": png("red")}]}, "r4")], tok)
    good = row_from_dict({**bad, "images": [{"bytes": png("red")}]}, "r5")
    with pytest.raises(DataError, match="r7: field 'images"):  # overlong="error" refuses the dataset
        PromptDataset([good, row_from_dict(bad, "r7")], tok, vision=vp, overlong="error")
    ds = PromptDataset([good, row_from_dict(bad, "r7")], tok, vision=vp, overlong="drop")
    assert len(ds) == 1 and len(ds.bad_images) == 1 and "1 dropped for their images (first: r7:" in ds.report()


def test_critic_lora_and_freezing_see_the_language_model_and_the_images():
    from rlcore.models.lora import adapter_params, apply_lora
    from rlcore.models.vision import vision_tower
    from rlcore.step.critic import build_critic, compute_values

    m, tok = model("qwen2_vl"), tokenizer()
    out = NativeEngine(m, tok).generate(make_prompt_batch(rows(), tok, vision=vision("qwen2_vl")),
                                        SamplingParams(n=2, max_tokens=4, seed=0))  # fmt: skip
    critic = build_critic("builtin:tiny-vl", seed=0)
    torch.nn.init.normal_(critic.value_head.weight)  # (the head starts at zero)
    values = compute_values(critic, out)
    text = (out["attention_mask"].cumsum(-1) - 1).clamp(min=0)[:, None, :].expand(-1, 3, -1)  # as text reads
    blind = compute_values(critic, out.with_(rope_positions=text, overwrite=True))
    image_rows = torch.tensor([bool(x) for x in out["multi_modal_inputs"]])
    assert (values - blind)[image_rows].abs().max() > 1e-3 and torch.equal(values[~image_rows], blind[~image_rows])
    names = [n for n, _ in adapter_params(apply_lora(model("qwen2_vl"), rank=2, alpha=4, dropout=0, targets=()))]
    assert names and all(".language_model." in n for n in names)  # never the vision tower
    assert len(names) == 2 * 2 * 7  # 2 layers x q k v o gate up down x (A, B)
    names = [n for n, _ in adapter_params(apply_lora(model("qwen2_5_vl"), rank=2, alpha=4, dropout=0,
                                                     targets=["up_proj"]))]  # fmt: skip
    assert len(names) == 2 * 2 and all(".language_model." in n for n in names)  # its vision MLP has up_proj too
    assert sum(p.numel() for p in vision_tower(m).parameters()) > 0 and vision_tower(model("qwen3_vl")) is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompts_samples_encode_its_images_once_with_the_same_result(family):
    """The trainer's forward encodes each distinct image once (a prompt's n samples share its tensors) and
    gives every row its features: log-probs and gradients equal those of rows holding their own copies."""
    from rlcore.models.forward import model_inputs, response_logprobs
    from rlcore.models.vision import vision_tower

    m, tok = model(family), tokenizer()
    out = NativeEngine(m, tok).generate(make_prompt_batch(rows(), tok, vision=vision(family)),
                                        SamplingParams(n=3, max_tokens=5, seed=0))  # fmt: skip
    copies = out.with_(multi_modal_inputs=[{k: v.clone() for k, v in x.items()} for x in out["multi_modal_inputs"]],
                       overwrite=True)  # fmt: skip
    fed: list[int] = []
    hook = vision_tower(m).register_forward_pre_hook(lambda _, args: fed.append(args[0].shape[0]))
    m.train()
    results = []
    for batch in (out, copies):
        logprob, _ = response_logprobs(m, model_inputs(m, batch))
        (logprob * batch["response_mask"][:, : logprob.shape[1]]).sum().backward()
        results.append((logprob.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
        m.zero_grad(set_to_none=True)
    hook.remove()
    patches = sum(x["pixel_values"].shape[0] for x in out["multi_modal_inputs"] if x)  # every row's copy
    assert fed == [patches // 3, patches]  # shared: each prompt's images once; copies: every row's
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=0)
    assert results[0][1].keys() == results[1][1].keys() and any("visual" in n for n in results[0][1])
    for name, grad in results[0][1].items():
        torch.testing.assert_close(grad, results[1][1][name], atol=1e-5, rtol=1e-5, msg=name)


def test_multi_turn_observations_with_images_are_scored_as_the_engine_sampled():
    """An environment's observation carries an image (a message with an image part): the next turn's
    context and the trainer's forward see it, at its M-RoPE positions inside the response."""
    from rlcore.models.policy import load_policy, load_vision
    from rlcore.rollout.agent.loop import EnvOptions, run_agent
    from tests.models.vl_env import SecondImage

    m, tok = load_policy("builtin:tiny-vl")
    vp = load_vision("builtin:tiny-vl")
    from rlcore.data.shapes import generate_rows

    prompt_rows = [row_from_dict(r, f"r{i}") for i, r in enumerate(generate_rows("val", 3, seed=0))]
    prompts = make_prompt_batch(prompt_rows, tok, vision=vp)
    out = run_agent(NativeEngine(m, tok), prompts, SamplingParams(n=2, max_tokens=64, seed=0), tok,
                    env=EnvOptions(cls=SecondImage), max_turns=3, vision=vp)  # fmt: skip
    image = vp.image_token_id
    observed = (out["responses"] == image).sum(dim=1)
    assert (observed == 9).all() and (out["num_turns"] == 2).all()  # one 48x48 image: 9 tokens, per sample
    assert all(x["image_grid_thw"].shape[0] == 2 for x in out["multi_modal_inputs"])  # the prompt's + the env's
    assert (out["retokenize_mismatch"] == 0).all()
    mask = out["response_mask"]
    assert ((out["responses"] == image) & (mask != 0)).sum() == 0  # observation tokens are not trained on
    ours, _ = compute_logprobs(m, out)
    assert ((ours - out["rollout_logprobs"]).abs() * mask).max() <= 1e-5
    # independently: the Hugging Face forward over each whole row, its positions computed by the model
    for i in range(len(out)):
        keep = out["attention_mask"][i].bool()
        r = int(out["response_attention"][i].sum())
        ids = torch.cat([out["input_ids"][i][keep], out["responses"][i][:r]])[None]
        with torch.no_grad():
            logits = m(input_ids=ids, mm_token_type_ids=(ids == image).int(), **out["multi_modal_inputs"][i]).logits
        logits[..., placeholder_ids(m)] = -1e9
        logp = torch.log_softmax(logits[0, -r - 1 : -1], dim=-1).gather(-1, ids[0, -r:, None])[:, 0]
        assert ((logp - out["rollout_logprobs"][i, :r]).abs() * mask[i, :r]).max() <= 1e-5
    text_only = out.select(*(k for k in out.keys() if k != "response_rope_positions"))  # noqa: SIM118
    wrong, _ = compute_logprobs(m, text_only)  # the response taken as text after the prompt
    assert ((wrong - out["rollout_logprobs"]).abs() * mask).max() > 1e-3

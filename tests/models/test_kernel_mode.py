"""The kernel mode as a value (`rlcore.models.exact.KernelMode`): recorded by `make_exact`, seen through the
wrappers a trainer puts around a model, never read from its config, and passed to the engine's lean step
and the forward layouts."""

from __future__ import annotations

import pytest
import torch

from rlcore.models import load_policy
from rlcore.models.exact import BLOCK, DEFAULT_MODE, EXACT_ATTENTION, EXACT_MODE, kernel_mode
from rlcore.models.forward import model_inputs
from rlcore.models.lora import apply_lora
from rlcore.rollout import NativeEngine, SamplingParams
from rlcore.rollout.native.lean import DEFAULT, EXACT, lean_decoder
from tests.models.test_exact import exact_or_refused
from tests.models.test_moe import prompts_of


def test_make_exact_records_the_mode_and_wrappers_show_it():
    model, _ = load_policy("builtin:tiny-reverse")
    assert kernel_mode(model) is DEFAULT_MODE
    model.config._attn_implementation = EXACT_ATTENTION  # the config alone does not make a mode
    assert kernel_mode(model) is DEFAULT_MODE
    model, _ = load_policy("builtin:tiny-reverse")
    exact_or_refused(model.eval())
    assert kernel_mode(model) is EXACT_MODE and EXACT_MODE.align == BLOCK and DEFAULT_MODE.align == 1
    assert kernel_mode(torch.compile(model)) is EXACT_MODE  # not compiled until called
    adapted = apply_lora(model, rank=2, alpha=4.0, dropout=0.0, targets=[], seed=0)  # in place
    assert kernel_mode(adapted) is EXACT_MODE


def test_the_mode_is_passed_to_the_lean_step_and_the_layouts():
    model, _ = load_policy("builtin:tiny-reverse")
    assert lean_decoder(model).shape.kernels is DEFAULT
    assert lean_decoder(model, mode=EXACT_MODE).shape.kernels is EXACT
    batch = prompts_of([[5, 6, 7], [8, 9]])
    batch = batch.with_(responses=torch.tensor([[3, 4], [5, 0]]), response_attention=torch.tensor([[1, 1], [1, 0]]),
                        response_mask=torch.tensor([[1, 1], [1, 0]]))  # fmt: skip
    plain = model_inputs(model, batch, share_prompts=False)
    aligned = model_inputs(model, batch, share_prompts=False, mode=EXACT_MODE)
    assert plain.input_ids.shape[1] == 3 + 2  # trimmed to the used columns
    assert aligned.input_ids.shape[1] == BLOCK + 2  # the prompt laid out in whole blocks


def test_an_engine_made_before_make_exact_refuses_to_sample():
    model, tokenizer = load_policy("builtin:tiny-reverse")
    engine = NativeEngine(model.eval(), tokenizer)
    assert engine.mode is DEFAULT_MODE
    exact_or_refused(model)
    with pytest.raises(ValueError, match="make the engine after make_exact"):
        engine.generate(prompts_of([[5, 6, 7]]), SamplingParams(n=1, max_tokens=2, seed=0))

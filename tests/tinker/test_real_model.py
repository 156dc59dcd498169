"""The real pretrained model through the Tinker API: SmolLM2-135M-Instruct from its GGUF file, LoRA. get_tokenizer
gives its own tokenizer and chat template (from the directory the server wrote), a cross_entropy step lowers the
loss of what it trained on, and the sampler's log-probs are the trainer's."""

from __future__ import annotations

import torch
from tinker import types

from tests.real_model import smollm2_gguf
from tests.tinker.server import client, running

WAIT = 300


def test_smollm2_trains_and_samples_through_the_tinker_api(tmp_path):
    path = str(smollm2_gguf())
    with running(tmp_path, "--model-roots", str(smollm2_gguf().parent), threads=2) as url:
        training = client(url).create_lora_training_client(base_model=path, rank=8).result(WAIT)
        tokenizer = training.get_tokenizer()
        assert "<|im_start|>" in tokenizer.chat_template and tokenizer.vocab_size == 49152
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                                  add_special_tokens=False)  # fmt: skip
        answer = tokenizer.encode("The capital of France is Paris.<|im_end|>", add_special_tokens=False)
        full = prompt + answer
        datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                            loss_fn_inputs={"target_tokens": full[1:],
                                            "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer)})  # fmt: skip
        losses = []
        for _ in range(3):
            losses.append(training.forward_backward([datum], "cross_entropy").result(WAIT).metrics["loss:sum"])
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result(WAIT)
        assert losses[2] < losses[0]
        sampler = training.save_weights_and_get_sampling_client().result(WAIT)
        greedy = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=8, temperature=0.0))
        assert tokenizer.decode(greedy.result(WAIT).sequences[0].tokens).startswith("The capital of France is")
        out = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=8, seed=3),
                             include_prompt_logprobs=True).result(WAIT)  # fmt: skip
        seq = prompt + out.sequences[0].tokens  # at temperature 1 the sampled log-probs are the model's
        probe = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                            loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)})  # fmt: skip
        forward = training.forward([probe], "cross_entropy").result(WAIT).loss_fn_outputs[0]["logprobs"].to_torch()
        torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), forward[: len(prompt) - 1], rtol=0, atol=2e-3)
        torch.testing.assert_close(torch.tensor(out.sequences[0].logprobs), forward[len(prompt) - 1 :], rtol=0, atol=2e-3)

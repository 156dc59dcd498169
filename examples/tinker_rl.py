"""A Tinker-cookbook-style RL loop (sample -> reward -> advantages -> forward_backward -> optim_step) on the
built-in reverse task, against a local rlcore:

    python -m rlcore.tinker --port 8000 &
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python examples/tinker_rl.py

It trains what `python train.py` trains (builtin:tiny-reverse, 32 prompts x 8 samples, 30 steps; here with
full fine-tuning, asked for with rank=0) and prints the greedy validation reward before and after.
"""

import sys

import tinker
from tinker import types

from rlcore.data.tasks import compute_score, generate_rows

STEPS, PROMPTS, GROUP, MAX_TOKENS = 30, 32, 8, 12
ADAM = types.AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)  # train.py's defaults


def prompt_of(tokenizer, row):
    text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def reward(tokenizer, row, tokens):
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return compute_score(row["data_source"], text, row["reward_model"]["ground_truth"])


def validate(sampler, tokenizer, rows):
    greedy = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    futures = [sampler.sample(types.ModelInput.from_ints(prompt_of(tokenizer, r)), 1, greedy) for r in rows]
    return sum(reward(tokenizer, r, f.result().sequences[0].tokens) for r, f in zip(rows, futures, strict=False)) / len(rows)


def main(steps=STEPS):
    training = tinker.ServiceClient().create_lora_training_client(base_model="builtin:tiny-reverse", rank=0).result()
    tokenizer = training.get_tokenizer()
    train, val = generate_rows("reverse", "train", steps * PROMPTS), generate_rows("reverse", "val", 128)
    params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0)
    before = validate(training.save_weights_and_get_sampling_client().result(), tokenizer, val)
    for step in range(steps):
        sampler = training.save_weights_and_get_sampling_client().result()
        rows = train[step * PROMPTS : (step + 1) * PROMPTS]
        prompts = [prompt_of(tokenizer, r) for r in rows]
        futures = [sampler.sample(types.ModelInput.from_ints(p), GROUP, params) for p in prompts]
        data, rewards = [], []
        for row, prompt, future in zip(rows, prompts, futures, strict=False):
            seqs = future.result().sequences
            scores = [reward(tokenizer, row, s.tokens) for s in seqs]
            mean = sum(scores) / len(scores)
            std = (sum((x - mean) ** 2 for x in scores) / (len(scores) - 1)) ** 0.5
            rewards += scores
            for s, score in zip(seqs, scores, strict=False):
                full, pad = prompt + s.tokens, [0.0] * (len(prompt) - 1)
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], "logprobs": pad + list(s.logprobs),
                                    "advantages": pad + [(score - mean) / (std + 1e-6)] * len(s.tokens)}))
        training.forward_backward(data, loss_fn="importance_sampling").result()
        training.optim_step(ADAM).result()
        print(f"step {step + 1}/{steps} | reward {sum(rewards) / len(rewards):.3f}", flush=True)
    after = validate(training.save_weights_and_get_sampling_client().result(), tokenizer, val)
    print(f"greedy validation {before:.3f} -> {after:.3f}")
    return after


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else STEPS)

"""A Tinker-cookbook-style RL loop (sample -> reward -> advantages -> forward_backward -> optim_step) on the
built-in reverse task, against a local rlcore:

    python -m rlcore.tinker --port 8000 &
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python examples/tinker_rl.py

It trains what `python train.py` trains (builtin:tiny-reverse, 32 prompts x 8 samples, 30 steps, GRPO's
group-normalised advantages; here with full fine-tuning, asked for with rank=0) and prints the greedy
validation reward before and after. experiments/bench_tinker.py times it against train.py.
"""

import sys
import time

import tinker
from tinker import types

from rlcore.data.tasks import compute_score, generate_rows


def prompt_of(tokenizer, row):
    text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def reward(tokenizer, row, tokens):
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return compute_score(row["data_source"], text, row["reward_model"]["ground_truth"])


def validate(sampler, tokenizer, rows, max_tokens):
    greedy = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    futures = [sampler.sample(types.ModelInput.from_ints(prompt_of(tokenizer, r)), 1, greedy) for r in rows]
    return sum(reward(tokenizer, r, f.result().sequences[0].tokens) for r, f in zip(rows, futures, strict=True)) / len(rows)


def datums(tokenizer, row, prompt, seqs):
    """The group's samples as importance_sampling datums, with GRPO's advantages (reward - mean) / std."""
    scores = [reward(tokenizer, row, s.tokens) for s in seqs]
    mean = sum(scores) / len(scores)
    std = (sum((x - mean) ** 2 for x in scores) / (len(scores) - 1)) ** 0.5
    out = []
    for s, score in zip(seqs, scores, strict=True):
        full, pad = prompt + s.tokens, [0.0] * (len(prompt) - 1)
        out.append(types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:], "logprobs": pad + list(s.logprobs),
                            "advantages": pad + [(score - mean) / (std + 1e-6)] * len(s.tokens)}))  # fmt: skip
    return out, scores


def main(steps=30, *, base_model="builtin:tiny-reverse", rank=0, prompts=32, group=8, max_tokens=12, lr=1e-3,
         val_rows=128):  # fmt: skip
    """Train; returns the greedy validation score before and after, and each step's seconds."""
    with tinker.ServiceClient() as service:  # closed at the end: its session finished, its heartbeats stopped
        return train(service, steps, base_model=base_model, rank=rank, prompts=prompts, group=group,
                     max_tokens=max_tokens, lr=lr, val_rows=val_rows)  # fmt: skip


def train(service, steps, *, base_model, rank, prompts, group, max_tokens, lr, val_rows):
    training = service.create_lora_training_client(base_model=base_model, rank=rank).result()
    tokenizer = training.get_tokenizer()
    train, val = generate_rows("reverse", "train", steps * prompts), generate_rows("reverse", "val", val_rows)
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    adam = types.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.999, eps=1e-8)  # train.py's AdamW
    before = validate(training.save_weights_and_get_sampling_client().result(), tokenizer, val, max_tokens)
    seconds = []
    for step in range(steps):
        start = time.perf_counter()
        sampler = training.save_weights_and_get_sampling_client().result()
        rows = train[step * prompts : (step + 1) * prompts]
        ids = [prompt_of(tokenizer, r) for r in rows]
        futures = [sampler.sample(types.ModelInput.from_ints(p), group, params) for p in ids]
        data, rewards = [], []
        for row, prompt, future in zip(rows, ids, futures, strict=True):
            more, scores = datums(tokenizer, row, prompt, future.result().sequences)
            data, rewards = data + more, rewards + scores
        training.forward_backward(data, loss_fn="importance_sampling").result()
        training.optim_step(adam).result()
        seconds.append(time.perf_counter() - start)
        print(f"step {step + 1}/{steps} | reward {sum(rewards) / len(rewards):.3f} | s/step {seconds[-1]:.3f}", flush=True)
    after = validate(training.save_weights_and_get_sampling_client().result(), tokenizer, val, max_tokens)
    print(f"greedy validation {before:.3f} -> {after:.3f}")
    return before, after, seconds


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)

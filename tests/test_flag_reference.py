"""docs/flags.md is the reference of every flag: what rlcore.config.flag_reference renders from configs.py, with
every flag that `python train.py grpo --help` lists, and the values the presets change."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from configs import PRESETS, Config
from rlcore.config.flag_reference import COMMAND, render
from rlcore.trainer.cli import parse

PAGE = Path(__file__).resolve().parents[1] / "docs" / "flags.md"
HELP_FLAG = re.compile(r"(?:^|│)[ ]{1,2}(--[a-z][\w.-]*(?:, --[a-z][\w.-]*)*)", re.MULTILINE)
"""A flag where --help defines it: at the start of a line (or of a box), not in a help text's indented lines."""


def page_rows(text: str) -> dict[str, str]:
    """Each table row of the page by each flag in its first cell."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `--"):
            for flag in re.findall(r"`(--[\w.-]+)`", line.split(" | ")[0]):
                rows[flag] = line
    return rows


def help_flags(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> set[str]:
    """The flags `python train.py grpo --help` lists (one column of help: 100 characters wide)."""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        parse(["grpo", "--help"])
    found = {flag for match in HELP_FLAG.findall(capsys.readouterr().out) for flag in match.split(", ")}
    assert "--rollout.n" in found, "no flags read from `python train.py grpo --help`: has its layout changed?"
    return found - {"--help"}


def test_the_page_is_current():
    current = PAGE.is_file() and PAGE.read_text() == render()
    assert current, f"docs/flags.md is not what configs.py renders: regenerate it with `{COMMAND}`"


def test_the_page_has_every_flag_the_help_lists(monkeypatch, capsys):
    listed, shown = help_flags(monkeypatch, capsys), set(page_rows(PAGE.read_text()))
    assert not listed - shown, f"flags missing from docs/flags.md: {sorted(listed - shown)}"
    assert not shown - listed, f"flags in docs/flags.md that --help does not list: {sorted(shown - listed)}"


def test_the_page_shows_a_preset_s_changed_value():
    dapo, default = PRESETS["dapo"][1].algo.clip_high, Config().algo.clip_high
    assert dapo != default
    row = page_rows(PAGE.read_text())["--algo.clip-high"]
    presets = row.strip("|").split(" | ")[-1].strip()
    assert f"`dapo={dapo}`" in presets and "grpo=" not in presets, row


def test_the_help_reader_finds_flags_not_mentions():
    text = "│ --a.b INT\n│       --a.c wraps here │\n  --d.e, --d.no-e\n        --d.f too\n│ x ││ --f.g STR │"
    found = {flag for match in HELP_FLAG.findall(text) for flag in match.split(", ")}
    assert found == {"--a.b", "--d.e", "--d.no-e", "--f.g"}

"""The compatibility table (`rlcore.config.compatibility`): every clash refuses in pre-flight with one line
naming both flags, neither of its features alone is refused for it, and the docs print the table."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from configs import PRESETS, Config, ConfigError
from rlcore.config.compatibility import CLASHES, FEATURES, clash_of, table
from rlcore.config.defaults import resolve
from rlcore.config.preflight import validate

BASE = PRESETS["grpo"][1]
ROOT = Path(__file__).resolve().parents[1]


def _part(cfg: Config, part: str, **values) -> Config:
    return dataclasses.replace(cfg, **{part: dataclasses.replace(getattr(cfg, part), **values)})


ASK = {
    "exact": lambda c: _part(c, "rollout", exact=True),
    "vllm": lambda c: _part(c, "rollout", engine="vllm"),
    "compile": lambda c: _part(c, "rollout", compile=True),
    "agent": lambda c: _part(c, "rollout", max_turns=3),
    "openai-agent": lambda c: _part(c, "rollout", agent="agent.py:run"),
    "model-parallel": lambda c: _part(c, "trainer", tp=2),
    "sp": lambda c: _part(c, "trainer", sp=2),
    "ep": lambda c: _part(c, "trainer", ep=2),
    "autocast": lambda c: _part(c, "model", compute_dtype="bfloat16"),
    "router-replay": lambda c: _part(c, "algo", router_replay="replay"),
    "split": lambda c: _part(c, "pipeline", placement="split"),
    "colocated": lambda c: _part(c, "pipeline", placement="colocate"),
    "stream": lambda c: _part(c, "pipeline", mode="stream"),
    "lag": lambda c: _part(c, "pipeline", mode="lag"),
    "partial": lambda c: _part(c, "pipeline", partial_rollout=True),
    "delta": lambda c: _part(c, "pipeline", push="delta"),
    "selective": lambda c: _part(c, "model", selective_checkpointing=True),
    "lora": lambda c: _part(c, "model", lora_rank=16),
}
"""A config change asking for each feature."""

OTHERWISE = {"colocated": ASK["split"], "lag": ASK["stream"]}
"""For the features a default config asks for, a change that does not."""


def test_every_feature_has_a_way_to_ask_for_it_here():
    assert set(ASK) == set(FEATURES)
    for name, ask in ASK.items():
        assert FEATURES[name].asked(ask(BASE)) is not None, name


@pytest.mark.parametrize("clash", CLASHES, ids=lambda c: f"{c.first}+{c.second}")
def test_each_clash_refuses_in_one_line_naming_both_flags(clash):
    cfg = ASK[clash.second](ASK[clash.first](BASE))
    first, second = FEATURES[clash.first].asked(cfg), FEATURES[clash.second].asked(cfg)
    with pytest.raises(ConfigError) as e:
        validate(resolve(cfg), world_size=4)
    assert str(e.value) == f"{first} with {second}: {clash.why}"
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("clash", CLASHES, ids=lambda c: f"{c.first}+{c.second}")
def test_one_feature_of_a_clash_alone_is_not_that_clash(clash):
    for name, other in ((clash.first, clash.second), (clash.second, clash.first)):
        cfg = ASK[name](BASE)
        if FEATURES[other].asked(cfg) is not None:  # asked by default (colocated, lag): ask otherwise
            cfg = OTHERWISE[other](cfg)
        assert FEATURES[name].asked(cfg) is not None and FEATURES[other].asked(cfg) is None
        line = clash_of(cfg)
        assert line is None or not line.endswith(clash.why), (name, line)


def test_the_docs_print_the_table():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    printed = text.split("<!-- compatibility-table -->\n", 1)[1].split("\n\n", 1)[0].strip()
    assert printed == table()
    assert len(printed.splitlines()) == len(CLASHES) + 2

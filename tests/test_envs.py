import pytest

from vllm_hybrid import envs
from vllm_hybrid.envs import SWITCH_VAR, overlay_enabled


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, True),
        ("", True),
        ("1", True),
        ("true", True),
        ("ON", True),
        ("0", False),
        ("false", False),
        ("off", False),
        (" 0 ", False),
    ],
)
def test_switch_values(value, expected):
    env = {} if value is None else {SWITCH_VAR: value}
    assert overlay_enabled(env) is expected


def test_bad_switch_value_names_the_variable_and_the_fix():
    with pytest.raises(ValueError) as err:
        overlay_enabled({SWITCH_VAR: "maybe"})
    message = str(err.value)
    assert SWITCH_VAR in message
    assert f"{SWITCH_VAR}=0" in message and f"{SWITCH_VAR}=1" in message


def test_overlay_variables_are_known_to_vllm(monkeypatch):
    """vLLM reports unknown ``VLLM_*`` variables; ours must not be among them."""
    import vllm.envs as vllm_envs

    from vllm_hybrid.envs import OVERLAY_ENV_VARS, declare_to_vllm

    for name in OVERLAY_ENV_VARS:
        monkeypatch.delitem(vllm_envs.environment_variables, name, raising=False)
    before = dict(vllm_envs.environment_variables)
    declare_to_vllm()
    added = set(vllm_envs.environment_variables) - set(before)
    assert added == set(OVERLAY_ENV_VARS)
    monkeypatch.setenv("VLLM_HYBRID_KV", "0")
    assert vllm_envs.environment_variables["VLLM_HYBRID_KV"]() == "0"
    # vLLM's own entries are untouched
    assert all(vllm_envs.environment_variables[k] is v for k, v in before.items())


def test_every_overlay_variable_reaches_ray_workers():
    """vLLM's Ray executor copies the variables of its known-variable table to
    every Ray actor; the overlay declares its own there, so a switch set on
    the driver (VLLM_HYBRID_KV=0 for an A/B run) holds on every node."""
    from vllm.ray.ray_env import get_env_vars_to_copy

    from vllm_hybrid import envs, plugin

    plugin.register()
    assert set(envs.OVERLAY_ENV_VARS) <= get_env_vars_to_copy()


def test_a_choice_is_an_enum_member_by_value_and_a_bad_one_names_the_values():
    from enum import Enum

    class Colour(Enum):
        RED = "red"
        BLUE = "blue"

    name = envs.DECODE_EDGES_VAR  # any declared variable
    assert envs.choice(name, Colour.RED, {}) is Colour.RED
    assert envs.choice(name, Colour.RED, {name: " Blue "}) is Colour.BLUE
    with pytest.raises(ValueError, match=rf"{name}='green'.*one of red, blue$"):
        envs.choice(name, Colour.RED, {name: "green"})
    with pytest.raises(KeyError, match="not declared"):
        envs.choice("VLLM_HYBRID_NOT_DECLARED", Colour.RED, {})

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


#: What each variable is for; none exists only to compare variants.
PURPOSE = {
    "VLLM_HYBRID_KV": "run-time switch: pure upstream vLLM in the same setup",
    "VLLM_HYBRID_TQ_NATIVE": "operator: fall back to the torch TurboQuant kernel",
    "VLLM_HYBRID_STATS_DIR": "operator: where per-pool usage snapshots go",
    "VLLM_HYBRID_SKIP_NATIVE": "build: install without compiling the kernel",
}


def test_at_most_six_variables_each_with_a_users_purpose():
    assert len(envs.OVERLAY_ENV_VARS) <= 6
    assert set(envs.OVERLAY_ENV_VARS) == set(PURPOSE)


def test_every_variable_the_code_names_is_declared():
    """A ``VLLM_HYBRID_*`` name in the package's source that envs.py does not
    declare would be a switch nobody lists (and vLLM would warn about it)."""
    import re
    from pathlib import Path

    package = Path(envs.__file__).parent
    named = set()
    for path in package.rglob("*.py"):
        named |= set(re.findall(r"VLLM_HYBRID_[A-Z_]+", path.read_text()))
    assert named <= set(envs.OVERLAY_ENV_VARS), named - set(envs.OVERLAY_ENV_VARS)

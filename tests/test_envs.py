import pytest

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

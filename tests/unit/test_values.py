"""rlix_plugins.values: the untyped-value checks every config and wire reader uses."""

from __future__ import annotations

import math

import pytest

from rlix_plugins.values import is_finite, is_int, is_number


@pytest.mark.parametrize("value", [0, -3, 2**70])
def test_ints_are_ints_numbers_and_finite(value: int) -> None:
    assert is_int(value) and is_number(value) and is_finite(value)


@pytest.mark.parametrize("value", [True, False])
def test_a_bool_is_refused_by_every_check(value: bool) -> None:
    assert not is_int(value) and not is_number(value) and not is_finite(value)


@pytest.mark.parametrize("value", [1.0, "1", None, [1], b"1"])
def test_non_ints_are_not_ints(value: object) -> None:
    assert not is_int(value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinities_are_numbers_but_not_finite(value: float) -> None:
    assert is_number(value) and not is_finite(value)


@pytest.mark.parametrize("value", ["1.5", None, 1j])
def test_strings_none_and_complex_are_not_numbers(value: object) -> None:
    assert not is_number(value) and not is_finite(value)


def test_enum_member_takes_members_and_values_and_names_the_valid_ones() -> None:
    import enum

    from rlix_plugins.errors import SettingsError
    from rlix_plugins.values import enum_member

    class Mode(enum.Enum):
        FAST = "fast"
        SAFE = "safe"

    assert enum_member(Mode, "safe", SettingsError, "mode") is Mode.SAFE
    assert enum_member(Mode, Mode.FAST, SettingsError, "mode") is Mode.FAST
    with pytest.raises(SettingsError, match=r"unknown mode 'quick'; valid values are \['fast', "):
        enum_member(Mode, "quick", SettingsError, "mode")


def test_as_index_takes_integer_scalars_and_nothing_else() -> None:
    import numpy as np
    import torch

    from rlix_plugins.values import as_index

    assert [as_index(v) for v in (3, np.int64(4), torch.tensor(5))] == [3, 4, 5]
    assert [as_index(v) for v in (True, 1.0, "1", None, np.float32(2))] == [None] * 5

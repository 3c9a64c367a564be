"""``coerce_priority``: what RLix's callers send is read, anything else is refused."""

from __future__ import annotations

import enum
import math

import pytest

from rlix_plugins.errors import ProtocolError
from rlix_plugins.protocol import Priority, coerce_priority

#: The valid set, as the refusal lists it.
VALID = "INITIALIZATION=0, ACTOR_TRAINING=1, CRITIC_TRAINING=2, OLD_LOG_PROBS=3"


def test_accepts_priorities_of_any_module_their_values_and_names() -> None:
    # RLix's Priority (module rlix.protocol.types) unpickles as an IntEnum of another class.
    rlix_priority = enum.IntEnum("Priority", [(p.name, p.value) for p in Priority])
    named = enum.Enum("Stage", [("GENERATION", "gen")])  # not an int: read by its name
    assert coerce_priority(Priority.OLD_LOG_PROBS) is Priority.OLD_LOG_PROBS
    assert coerce_priority(rlix_priority.GENERATION) is Priority.GENERATION
    assert coerce_priority(named.GENERATION) is Priority.GENERATION
    assert coerce_priority(3) is Priority.OLD_LOG_PROBS
    assert coerce_priority(1.0) is Priority.ACTOR_TRAINING
    assert coerce_priority("GENERATION") is Priority.GENERATION


@pytest.mark.parametrize(
    "value",
    [True, False, 1.9, 6.5, "3", math.inf, -math.inf],
    ids=["true", "false", "1.9", "6.5", "digit-str", "inf", "-inf"],
)
def test_refuses_bools_fractions_non_finite_and_numeric_strings(value: object) -> None:
    with pytest.raises(ProtocolError, match=VALID):
        coerce_priority(value)

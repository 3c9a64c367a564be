"""A record whose time no float can hold is an ObservationError naming its file and line.

``_seconds`` checked the time with ``is_finite``, which raises OverflowError for an int too
large for a float; ``parse_line`` turns only KeyError/TypeError/ValueError into an
ObservationError, so ``read_observations`` failed with a bare OverflowError naming no file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlix_plugins.adapters.observability import (
    BusyObserved,
    ObservationError,
    read_observations,
)


def test_a_time_too_large_for_a_float_names_file_and_line(tmp_path: Path) -> None:
    good = BusyObserved("p", "train", (0,), 1.0, 2.0).to_json()
    bad = {**good, "end": 10**400}
    (tmp_path / "p.jsonl").write_text(f"{json.dumps(good)}\n{json.dumps(bad)}\n")
    with pytest.raises(ObservationError, match=r"p\.jsonl:2: end=1000.* expected a finite "
                                               r"number"):
        read_observations(tmp_path)

"""Numbers in a progress report that no float can hold are refused with ProtocolError.

``fifo_timestamp`` is read as a float: an int too large for one (``10**400``) made
``coerce_progress_report`` raise a bare OverflowError, so the scheduler's ``report_progress``
failed with an error that names neither the field nor what is valid.
"""

from __future__ import annotations

import pytest

from rlix_plugins.errors import ProtocolError
from rlix_plugins.protocol.types import coerce_progress_report


@pytest.mark.parametrize("fifo", [10**400, -(10**400)], ids=["1e400", "-1e400"])
def test_a_fifo_timestamp_too_large_for_a_float_is_a_protocol_error(fifo: int) -> None:
    report = {"pipeline_id": "ft_0123456789ab", "step_target_trajectories": 8,
              "fifo_timestamp": fifo, "metrics": {"collected": 1}}
    with pytest.raises(ProtocolError, match="fifo_timestamp must be a finite number or None"):
        coerce_progress_report(report)


def test_a_large_int_fifo_timestamp_a_float_holds_is_read() -> None:
    report = {"pipeline_id": "ft_0123456789ab", "step_target_trajectories": 8,
              "fifo_timestamp": 1_764_400_000, "metrics": {"collected": 1}}
    assert coerce_progress_report(report).fifo_timestamp == 1_764_400_000.0

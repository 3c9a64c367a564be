"""A generation busy record survives a wall clock stepped back during the stretch.

``BusyRecordingEngine`` stamps a stretch with ``time.time()``; when the clock stepped back
(NTP) between its first request's start and its last one's end, ``BusyObserved`` refused
``end < start`` and the record was dropped with a logged error, so the gate's "no GPU used by
two stages at once" check never saw that stretch. The train records clamp the end to the
start for the same reason (``CoordinatorHooks.after_training``); the generation ones now do too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from rlix_plugins.adapters.observability import BusyObserved, BusyRecordingEngine


class FakeInnerEngine:
    """FAKE shard engine: ``generate`` answers at once (only the wrapper's timing matters)."""

    async def generate(self, request: object) -> str:
        return "done"


def test_a_clock_stepped_back_mid_stretch_still_records_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stamps: Iterator[float] = iter([1_000.0, 400.0])  # start, then end after a step back
    monkeypatch.setattr(time, "time", lambda: next(stamps))
    records: list[BusyObserved] = []
    engine = BusyRecordingEngine(FakeInnerEngine(), pipeline_id="ft_0123456789ab", shard=1,
                                 gpus=(2, 3), record=records.append)

    assert asyncio.run(engine.generate("req")) == "done"

    assert len(records) == 1
    rec = records[0]
    assert (rec.stage, rec.shard, rec.gpus) == ("generation", 1, (2, 3))
    assert rec.start == 1_000.0 and rec.end == 1_000.0

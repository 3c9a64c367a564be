"""The scheduler service's waiting callers (:mod:`.waiters`), its save-before-answer rule
(:mod:`.durability`) and its saved record's format (:mod:`.saved_record`), on their own (the
service's own tests drive them through the actor)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.coordinator.service.durability import Durability
from rlix_plugins.coordinator.service.persistence import FileStateStore
from rlix_plugins.coordinator.service.waiters import Waiters
from rlix_plugins.errors import CoordinatorUnavailableError, PipelineFailedError

A_INFER, A_TRAIN = "a_actor_infer", "a_actor_train"
#: pipeline "a_b": its clusters start with "a_" too, and must not be taken for "a"'s
AB_INFER = "a_b_actor_infer"


def test_failing_a_pipeline_fails_its_waiters_only() -> None:
    async def go() -> None:
        w = Waiters()
        mine, theirs = w.open(A_INFER, 1.0), w.open(AB_INFER, 1.0)
        release = w.open_release(A_TRAIN)
        w.fail_pipeline("a", PipelineFailedError("a failed"))
        with pytest.raises(PipelineFailedError):
            mine.result()
        with pytest.raises(PipelineFailedError):
            release.result()
        assert not theirs.done() and AB_INFER in w and A_INFER not in w

    asyncio.run(go())


def test_a_withdrawn_waiter_does_not_take_a_later_requests_answer() -> None:
    async def go() -> None:
        w = Waiters()
        first = w.open(A_INFER, 1.0)
        assert w.withdraw(A_INFER, first)
        second = w.open(A_INFER, 5.0)
        assert not w.withdraw(A_INFER, first), "an old future withdrew the new request"
        assert w.resolve(A_INFER, (0, 1)) == 5.0  # queued at: the wait metric's start
        assert second.result() == [0, 1] and not first.done()
        assert w.resolve(A_INFER, (0,)) is None  # nobody waits any more

    asyncio.run(go())


def test_release_waiters_are_answered_when_their_release_is_done() -> None:
    async def go() -> None:
        w = Waiters()
        gone, kept = w.open_release(A_INFER), w.open_release(A_INFER)
        w.drop_release(A_INFER, gone)  # its caller timed out
        w.settle_releases(lambda cid: True)
        assert not kept.done()
        w.settle_releases(lambda cid: False)
        assert kept.result() is None and not gone.done()

    asyncio.run(go())


def test_fail_all_answers_every_waiter() -> None:
    async def go() -> None:
        w = Waiters()
        futs: list[asyncio.Future[Any]] = [w.open(A_INFER, 0.0), w.open_release(A_TRAIN)]
        w.fail_all(CoordinatorUnavailableError("stopping"))
        assert all(isinstance(f.exception(), CoordinatorUnavailableError) for f in futs)
        assert A_INFER not in w

    asyncio.run(go())


class _Outage:
    """Makes a real :class:`FileStateStore` fail its saves while ``down`` (as a full disk or a
    lost KV would): the store's own ``save`` runs otherwise."""

    def __init__(self, store: FileStateStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.down = False
        real = store.save

        def save(record: dict[str, Any]) -> None:
            if self.down:
                raise OSError("store down")
            real(record)

        monkeypatch.setattr(store, "save", save)


@pytest.fixture
def store(tmp_path: Path) -> FileStateStore:
    return FileStateStore(tmp_path / "state.json")


def test_answers_wait_for_a_save_and_keep_commit_order(
    store: FileStateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    outage = _Outage(store, monkeypatch)
    revision = [0]
    durable = Durability(store, lambda: {"rev": revision[0]}, namespace="t", timeout_s=1.0)
    answered: list[int] = []
    outage.down = True
    revision[0] = 1
    durable.hold(lambda: answered.append(1), durable=durable.save())
    assert not durable.saved and answered == [] and store.load() is None
    outage.down = False
    revision[0] = 2
    # saved, but an earlier answer is still held: this one must not overtake it
    durable.hold(lambda: answered.append(2), durable=durable.save())
    assert answered == []
    assert durable.retry()
    assert answered == [1, 2] and durable.held == [] and store.load() == {"rev": 2}


def test_until_saved_retries_then_raises_a_typed_error(
    store: FileStateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    outage = _Outage(store, monkeypatch)
    durable = Durability(store, lambda: {"rev": 7}, namespace="t", timeout_s=0.2)
    outage.down = True
    assert not durable.save()
    with pytest.raises(CoordinatorUnavailableError, match=r"could not save its state for 0\.2s"):
        asyncio.run(durable.until_saved("notify_release_gpus(x)"))
    outage.down = False
    asyncio.run(durable.until_saved("notify_release_gpus(x)"))
    assert durable.saved and store.load() == {"rev": 7}


def test_a_refused_record_propagates(store: FileStateStore) -> None:
    """The service's record builder refuses once the service stopped: no save, an error."""

    def stopped() -> dict[str, Any]:
        raise CoordinatorUnavailableError("stopped")

    with pytest.raises(CoordinatorUnavailableError):
        Durability(store, stopped, namespace="t", timeout_s=1.0).save()
    assert store.load() is None


def test_the_saved_record_reads_back_what_was_written() -> None:
    """write_record and SavedRecord.read are one format: every field survives JSON."""
    import json

    from rlix_plugins.coordinator.core.status import DeadPipeline
    from rlix_plugins.coordinator.service.saved_record import (
        InflightIntent,
        SavedRecord,
        write_record,
    )

    record = write_record(
        state={"revision": 3},
        inflight=InflightIntent(confirmed_shrinks=((A_INFER, 1),), expands=((AB_INFER, 0),)),
        dead=[DeadPipeline("gone", "its coordinator actor died", 12.5)],
        seen={"b", "a"},
        leased={"a"},
        fencing={"b": "lease expired"},
    )
    back = SavedRecord.read(json.loads(json.dumps(record)))
    assert back.state == {"revision": 3}
    assert back.inflight is not None
    assert back.inflight.confirmed_shrinks == [[A_INFER, 1]]  # raw: settle_inflight checks
    assert back.inflight.expands == [[AB_INFER, 0]]
    assert back.dead == (DeadPipeline("gone", "its coordinator actor died", 12.5),)
    assert (back.seen, back.leased, back.fencing) == (("a", "b"), ("a",), {"b": "lease expired"})
    assert SavedRecord.read(
        write_record(state={}, inflight=None, dead=(), seen=(), leased=(), fencing={})
    ).inflight is None

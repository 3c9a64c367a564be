"""Weight sync to a multi-worker (tensor-parallel) engine: one receiver per worker.

The sync, the transports and the worker extension are real; the engine is a FAKE of vLLM's
``collective_rpc`` that calls every worker at once with the same arguments (vLLM's contract),
each worker a real :class:`RlixWeightReceiverExtension` over a FAKE model runner. A real tp=2
vLLM engine runs in tests/integration/test_training_vllm_receiver.py.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlix_plugins.errors import ChecksumMismatchError, WeightSyncError
from rlix_plugins.training.bucket_cache import BucketCache
from rlix_plugins.training.sync import SyncOptions, sync_version
from rlix_plugins.training.vllm_receiver import (
    EngineWorkers,
    VllmEngineReceiver,
    common_version,
    engine_shard_id,
    engines_synced,
)
from rlix_plugins.training.wire import SyncOffer, TransportKind
from tests.unit.test_training_receiver_partial import WEIGHTS, FakeModelRunner, Worker


def _load_all(it: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in it}


def _fail_loading(it: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    next(it)
    raise RuntimeError("this worker's loader broke")


class RankedWorker(Worker):
    def __init__(self, runner: FakeModelRunner, rank: int, world: int) -> None:
        super().__init__(runner)
        self.rank = rank
        self.parallel_config = SimpleNamespace(world_size=world)


class FakeTpEngine:
    """FAKE multi-worker ``vllm.LLM``: ``collective_rpc`` runs the method on every worker
    concurrently with the same arguments and returns the replies in rank order."""

    def __init__(self, *loaders: Any) -> None:
        self.runners = [FakeModelRunner(load) for load in loaders]
        self.workers = [RankedWorker(r, rank, len(loaders)) for rank, r in enumerate(self.runners)]
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls.append((method, args))
        with concurrent.futures.ThreadPoolExecutor(len(self.workers)) as pool:
            return list(pool.map(lambda w: getattr(w, method)(*args), self.workers))


@pytest.mark.parametrize("kind", [TransportKind.ZMQ, TransportKind.GLOO])
def test_every_worker_takes_its_own_offer_from_one_engine_call(
    weights_cache: BucketCache, kind: TransportKind
) -> None:
    engine = FakeTpEngine(_load_all, _load_all)
    receiver = VllmEngineReceiver("s0", engine)
    try:
        workers = receiver.receivers()
        assert receiver.num_workers == 2 and [w.shard_id for w in workers] == ["s0@w0", "s0@w1"]
        report = sync_version(weights_cache, 7, workers, options=SyncOptions(
            ack_timeout_s=20, transports={w.shard_id: kind for w in workers}))
        assert report.succeeded == ("s0@w0", "s0@w1")
        assert engines_synced(report.succeeded, report.failed) == ("s0",)
        (call,) = [c for c in engine.calls if c[0] == "rlix_receive_weights"]
        offers = call[1][0]
        assert [o["shard_id"] for o in offers] == ["s0@w0", "s0@w1"]  # rank order
        assert [o.result.shard_id for o in report.outcomes if o.result] == ["s0@w0", "s0@w1"]
        for runner in engine.runners:  # every worker loaded the whole version
            assert {n: t.tolist() for n, t in runner.loaded.items()} == {
                n: t.tolist() for n, t in WEIGHTS.items()}
        assert receiver.weight_version() == 7
        with pytest.raises(WeightSyncError, match=r"2 workers; pass receiver.receivers\(\)"):
            receiver.begin_receive(SyncOffer.from_dict(offers[0]))
    finally:
        receiver.close()


def test_one_workers_failure_fails_its_engine_and_the_engine_call_still_returns(
    weights_cache: BucketCache,
) -> None:
    engine = FakeTpEngine(_load_all, _fail_loading)
    receiver = VllmEngineReceiver("s0", engine)
    try:
        report = sync_version(weights_cache, 7, receiver.receivers(),
                              options=SyncOptions(ack_timeout_s=20, raise_on_error=False))
        assert report.succeeded == ("s0@w0",) and report.failed == ("s0@w1",)
        assert engines_synced(report.succeeded, report.failed) == ()
        (failed,) = [o for o in report.outcomes if not o.ok]
        assert failed.error is not None and "loader broke" in failed.error
        # the failure came back as a value: vLLM's executor never saw a raising worker
        assert receiver.weight_version() is None  # worker 1 holds none: no common version
        assert engine.collective_rpc("rlix_weight_version") == [7, None]
        with pytest.raises(WeightSyncError, match=r"s0@w1"):
            sync_version(weights_cache, 7, receiver.receivers(),
                         options=SyncOptions(ack_timeout_s=20))
    finally:
        receiver.close()


def _offer(sync_id: str, shard_id: str) -> SyncOffer:
    return SyncOffer(pipeline_id="tp", sync_id=sync_id, shard_id=shard_id, version=1,
                     transport=TransportKind.ZMQ, control_address="ipc:///nowhere",
                     num_buckets=0, total_bytes=0, max_bucket_bytes=0,
                     checksum=cache_checksum(), timeout_s=1.0)


def cache_checksum() -> Any:
    from rlix_plugins.training.checksum import ChecksumKind

    return ChecksumKind.FLETCHER64


def _result(shard_id: str) -> dict[str, Any]:
    return {"shard_id": shard_id, "version": 1, "buckets": 0, "bytes": 0, "seconds": 0.0,
            "max_bucket_bytes": 0}


def test_offers_are_gathered_per_sync_and_replies_handed_out_in_rank_order() -> None:
    calls: list[list[dict[str, Any]]] = []
    answer: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def call(offers: list[dict[str, Any]]) -> concurrent.futures.Future[Any]:
        calls.append(offers)
        return answer

    fan = EngineWorkers("e", 2, call)
    w0, w1 = fan.receivers
    stale = w1.begin_receive(_offer("sync-a", "e@w1"))  # that sync gave up on worker 0
    f0 = w0.begin_receive(_offer("sync-b", "e@w0"))
    with pytest.raises(WeightSyncError, match="superseded by sync sync-b"):
        stale.result(timeout=1)
    with pytest.raises(WeightSyncError, match="worker 0 offered twice"):
        w0.begin_receive(_offer("sync-b", "e@w0"))
    assert calls == []  # not before every worker has its offer
    f1 = w1.begin_receive(_offer("sync-b", "e@w1"))
    assert [[o["shard_id"] for o in offers] for offers in calls] == [["e@w0", "e@w1"]]
    answer.set_result([_result("e@w0"), {"failed": True, "error": "bucket 0 mismatch",
                                         "error_type": "ChecksumMismatchError"}])
    assert f0.result(timeout=1).shard_id == "e@w0"
    with pytest.raises(ChecksumMismatchError, match="bucket 0 mismatch"):
        f1.result(timeout=1)


def test_an_answer_for_the_wrong_number_of_workers_fails_every_worker() -> None:
    answer: concurrent.futures.Future[Any] = concurrent.futures.Future()
    fan = EngineWorkers("e", 2, lambda offers: answer)
    futures = [w.begin_receive(_offer("s", w.shard_id)) for w in fan.receivers]
    answer.set_result([_result("e@w0")])
    for f in futures:
        with pytest.raises(WeightSyncError, match=r"answered .* for 2 workers"):
            f.result(timeout=1)
    with pytest.raises(WeightSyncError, match="num_workers=0 must be an int >= 1"):
        EngineWorkers("e", 0, lambda offers: answer)


def test_a_worker_refuses_offers_for_another_engine_size_and_keeps_its_version() -> None:
    worker = RankedWorker(FakeModelRunner(_load_all), rank=1, world=2)
    worker._rlix_weight_version = 5
    reply = worker.rlix_receive_weights([_offer("s", "e@w0").to_dict()])
    assert reply["failed"] and reply["error_type"] == "WeightSyncError"
    assert "1 offers for an engine of 2 workers" in reply["error"]
    assert worker.rlix_weight_version() == 5


def test_a_single_offer_to_a_multi_worker_engine_is_answered_at_once_as_failed() -> None:
    # every worker would dial the one control channel the offer names
    engine = FakeTpEngine(_load_all, _load_all)
    replies = engine.collective_rpc("rlix_receive_weights", (_offer("s", "e").to_dict(),))
    assert [r["failed"] for r in replies] == [True, True]
    assert "one offer for an engine of 2 workers" in replies[0]["error"]
    assert engine.collective_rpc("rlix_weight_version") == [None, None]


def test_engine_names_fold_back_and_versions_must_agree() -> None:
    assert engine_shard_id("shard3@w12") == "shard3" and engine_shard_id("a@b") == "a@b"
    assert engines_synced(["a@w0", "a@w1", "b", "c@w0"], failed=["c@w1"]) == ("a", "b")
    assert common_version([3, 3]) == 3
    assert common_version([3, None]) is None and common_version([3, 4]) is None


class FailingSleepEngine(FakeTpEngine):
    """FAKE engine whose level-2 sleep discards the weights and then raises."""

    def sleep(self, level: int = 1) -> None:
        raise RuntimeError("sleep failed after discarding the weights")


def test_a_level_2_sleep_clears_the_version_before_the_engine_sleeps(
    weights_cache: BucketCache,
) -> None:
    # The version was cleared after engine.sleep returned: a sleep that failed part-way (or
    # any moment in between) still reported version 7 for weights the engine had dropped.
    engine = FailingSleepEngine(_load_all)
    receiver = VllmEngineReceiver("s0", engine)
    try:
        sync_version(weights_cache, 7, receiver.receivers(), options=SyncOptions(ack_timeout_s=20))
        assert receiver.weight_version() == 7
        with pytest.raises(RuntimeError, match="sleep failed"):
            receiver.sleep(level=2)
        assert receiver.weight_version() is None
    finally:
        receiver.close()

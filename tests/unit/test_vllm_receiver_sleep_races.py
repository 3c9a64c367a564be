"""A receive that runs after the engine was put to sleep must not load or record weights.

``VllmEngineReceiver`` runs each receive on its own one-thread pool, so a receive can wait
there (behind an earlier one) and start after the engine's owner slept the engine. A level-2
sleep frees the weights: a receive running then wrote into freed memory and recorded its
version, so the engine woke with no weights while it reported the version and the next sync
was skipped.

The sync, the cache, the control channel, the handle and the worker extension are real; vLLM
is replaced (it cannot run in a unit test): the worker and its model runner are the FAKES of
test_training_receiver_partial, the engine a FAKE with sleep levels (below).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rlix_plugins.training.bucket_cache import BucketCache
from rlix_plugins.training.sync import SyncOptions, SyncReport, sync_version
from rlix_plugins.training.vllm_receiver import VllmEngineReceiver
from rlix_plugins.training.wire import ReceiveResult, SyncOffer
from tests.unit.test_training_receiver_partial import (
    FakeEngine,
    FakeModelRunner,
    Worker,
)


class SleepingEngine(FakeEngine):
    """FAKE ``vllm.LLM`` with sleep levels: notes every weight receive that reaches its worker
    while it sleeps (a real level-2 sleep freed the memory those writes go to). With
    ``can_tell`` it answers ``llm_engine.is_sleeping()`` as ``vllm.LLM`` does."""

    def __init__(self, worker: Worker, *, can_tell: bool) -> None:
        super().__init__(worker)
        self.level = 0
        self.receives_while_asleep: list[int] = []
        if can_tell:
            self.llm_engine = self

    def is_sleeping(self) -> bool:
        return self.level > 0

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        if method == "rlix_receive_weights" and self.level:
            self.receives_while_asleep.append(self.level)
        return super().collective_rpc(method, args)

    def sleep(self, level: int = 1) -> None:
        self.level = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.level = 0


class BlockingLoader:
    """Loads every tensor; the first receive waits in the model until ``release`` is set."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, it: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not self.started.is_set():
            self.started.set()
            assert self.release.wait(20), "the test never released the first receive"
        return {name: t.clone() for name, t in it}


class OfferSeen(VllmEngineReceiver):
    """The real handle, telling the test when a sync has handed it an offer (queued)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.offers = 0
        self.offered = threading.Condition()

    def begin_receive(self, offer: SyncOffer) -> concurrent.futures.Future[ReceiveResult]:
        fut = super().begin_receive(offer)
        with self.offered:
            self.offers += 1
            self.offered.notify_all()
        return fut

    def wait_offers(self, n: int) -> None:
        with self.offered:
            assert self.offered.wait_for(lambda: self.offers >= n, 20)


def _sync(weights_cache: BucketCache, receiver: VllmEngineReceiver) -> SyncReport:
    return sync_version(weights_cache, 7, [receiver], options=SyncOptions(
        ack_timeout_s=20, raise_on_error=False))


@pytest.mark.parametrize("can_tell", [True, False], ids=["engine-tells", "handle-tracks"])
def test_a_receive_queued_behind_a_busy_handle_does_not_land_after_a_level_2_sleep(
    weights_cache: BucketCache, can_tell: bool
) -> None:
    loader = BlockingLoader()
    engine = SleepingEngine(Worker(FakeModelRunner(loader)), can_tell=can_tell)
    receiver = OfferSeen("s0", engine)
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(_sync, weights_cache, receiver)
            assert loader.started.wait(20)
            queued = pool.submit(_sync, weights_cache, receiver)  # waits behind the first receive
            receiver.wait_offers(2)
            slept = pool.submit(receiver.sleep, 2)
            loader.release.set()
            slept.result(20)
            reports = [first.result(30), queued.result(30)]
        # the version is not recorded, and nothing reached the model while it slept
        assert receiver.weight_version() is None
        assert engine.receives_while_asleep == []
        assert reports[0].succeeded == ("s0",), reports[0].outcomes
        # the queued one ran before the sleep, or was refused naming the sleep
        if not reports[1].succeeded:
            (outcome,) = reports[1].outcomes
            assert outcome.error is not None and "the engine is asleep" in outcome.error
        # woken, the engine is synced again
        receiver.wake_up()
        assert _sync(weights_cache, receiver).succeeded == ("s0",)
        assert receiver.weight_version() == 7
    finally:
        loader.release.set()
        receiver.close()


def test_a_receive_under_way_does_not_record_its_version_after_a_level_2_sleep(
    weights_cache: BucketCache,
) -> None:
    # The sleep cleared the version while the receive was still loading; the receive then
    # recorded version 7 for weights the sleep discarded.
    loader = BlockingLoader()
    engine = SleepingEngine(Worker(FakeModelRunner(loader)), can_tell=True)
    receiver = VllmEngineReceiver("s0", engine)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            synced = pool.submit(_sync, weights_cache, receiver)
            assert loader.started.wait(20)
            slept = pool.submit(receiver.sleep, 2)
            concurrent.futures.wait([slept], timeout=0.3)
            slept_under_the_receive = slept.done()
            loader.release.set()
            assert synced.result(30).succeeded == ("s0",)
            slept.result(20)
        assert receiver.weight_version() is None
        assert not slept_under_the_receive  # the sleep waited for the receive under way
    finally:
        loader.release.set()
        receiver.close()


def test_an_engine_woken_directly_takes_receives_again(weights_cache: BucketCache) -> None:
    # vllm.LLM tells whether it sleeps: an owner waking it with llm.wake_up() is not refused
    engine = SleepingEngine(Worker(FakeModelRunner(lambda it: dict(it))), can_tell=True)
    receiver = VllmEngineReceiver("s0", engine)
    try:
        receiver.sleep(level=2)
        refused = _sync(weights_cache, receiver)
        assert refused.succeeded == () and receiver.weight_version() is None
        engine.wake_up()
        assert _sync(weights_cache, receiver).succeeded == ("s0",)
        assert receiver.weight_version() == 7 and engine.receives_while_asleep == []
    finally:
        receiver.close()

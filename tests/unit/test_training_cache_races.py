"""The cache's claims on version numbers and its pins hold under concurrency: a refused second
build of a number leaves the first build's claim, a build that outlives ``close()`` leaves
nothing behind, and a receiver still applying when its sync gave up keeps its version's pages
from being recycled under it."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from rlix_plugins.errors import ReceiverGoneError, WeightCacheError, WeightSyncError
from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig, StorageKind
from rlix_plugins.training.receiver import ThreadReceiver
from rlix_plugins.training.sync import SyncOptions, sync_version


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory in /dev/shm: other tests' cache files never show up here."""
    d = Path(tempfile.mkdtemp(prefix="rlix-test-races-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _cache(name: str, shm_dir: Path) -> BucketCache:
    return BucketCache(name, CacheConfig(bucket_bytes=8192, storage=StorageKind.SHARED,
                                         shm_dir=shm_dir, ram_reserve_bytes=0))


def _held_until(gate: threading.Event) -> Iterator[tuple[str, torch.Tensor]]:
    """The gather of a build that stalls after its first tensor until ``gate`` is set."""
    yield "a", torch.ones(100)
    gate.wait(10)
    yield "b", torch.ones(100)


def test_a_refused_second_build_keeps_the_first_builds_claim(shm_dir: Path) -> None:
    cache = _cache("claims", shm_dir)
    gate = threading.Event()
    first = threading.Thread(target=lambda: cache.build(1, _held_until(gate)))
    first.start()
    time.sleep(0.2)
    try:
        for _ in range(2):  # the refusal used to drop the first build's claim: a third passed
            with pytest.raises(WeightCacheError, match="already cached or being built"):
                cache.build(1, [("x", torch.ones(4))])
    finally:
        gate.set()
        first.join()
    assert [n for n, _ in cache.named_tensors(1)] == ["a", "b"]
    cache.close()
    assert list(shm_dir.iterdir()) == []


def _held_build(cache: BucketCache, version: int, gate: threading.Event,
                errors: list[BaseException]) -> threading.Thread:
    """A started thread building ``version`` from a gather held until ``gate``; its error
    (if any) lands in ``errors``."""

    def build() -> None:
        try:
            cache.build(version, _held_until(gate))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=build)
    thread.start()
    return thread


def test_a_build_that_ends_after_close_leaves_nothing(shm_dir: Path) -> None:
    cache = _cache("closing", shm_dir)
    gate = threading.Event()
    errors: list[BaseException] = []

    late = _held_build(cache, 2, gate, errors)
    time.sleep(0.2)
    cache.close()
    gate.set()
    late.join()
    assert len(errors) == 1 and "closed while weight version 2" in str(errors[0])
    assert cache.versions() == () and cache.latest_version is None
    assert list(shm_dir.iterdir()) == []


@pytest.mark.parametrize("version", ["7", 1.5, True, -1])
def test_a_bad_version_number_is_refused_before_the_gather(shm_dir: Path, version: object) -> None:
    cache = _cache("numbers", shm_dir)
    consumed: list[str] = []

    def gather() -> Iterator[tuple[str, torch.Tensor]]:
        consumed.append("a")
        yield "a", torch.ones(4)

    with pytest.raises(WeightCacheError, match="must be an int >= 0"):
        cache.build(version, gather())  # type: ignore[arg-type]
    assert consumed == [] and cache.versions() == ()
    cache.close()


@pytest.mark.parametrize("timeout", [-1.0, 0.0, float("nan"), float("inf")])
def test_sync_options_refuse_a_bad_ack_timeout(timeout: float) -> None:
    with pytest.raises(WeightSyncError, match="ack_timeout_s must be finite seconds > 0"):
        SyncOptions(ack_timeout_s=timeout)


def test_a_receiver_the_sync_gave_up_on_still_gets_its_versions_bytes(shm_dir: Path) -> None:
    """shm announces every bucket and "end" ahead, so a receiver slower than the ack timeout
    still finishes and records the version after the sync failed; its pages used to be
    unpinned then, recycled by the next builds and applied with another version's bytes."""
    cache = _cache("late", shm_dir)
    cache.build(1, [("w", torch.full((1000,), 1.0))])
    cache.activate(1)
    got: dict[str, torch.Tensor] = {}

    def slow_load(weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        time.sleep(2.0)  # e.g. an engine's post-processing
        for name, t in weights:
            got[name] = t.clone()

    receiver = ThreadReceiver("r0", slow_load)
    try:
        with pytest.raises(ReceiverGoneError):
            sync_version(cache, 1, [receiver], options=SyncOptions(ack_timeout_s=0.5))
        # the trainer moves on while the receiver still applies version 1
        cache.build(2, [("w", torch.full((1000,), 2.0))])
        cache.activate(2)
        cache.build(3, [("w", torch.full((1000,), 3.0))])
        deadline = time.monotonic() + 10
        while "w" not in got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert receiver.versions == [1]
        assert torch.equal(got["w"], torch.full((1000,), 1.0))
        time.sleep(0.2)  # the receiver's done-callback releases version 1
        assert 1 not in cache.versions()
    finally:
        receiver.close()
        cache.close()


def test_an_older_build_finishing_after_a_newer_one_never_frees_the_newer(
    shm_dir: Path,
) -> None:
    # build(5) finished after build(6) and became latest: version 6, whose build had already
    # returned its info, was retired and freed.
    cache = _cache("races_order", shm_dir)
    gate = threading.Event()
    errors: list[BaseException] = []

    thread = _held_build(cache, 5, gate, errors)
    time.sleep(0.05)  # build 5 holds its claim, packing
    assert cache.build(6, iter([("a", torch.zeros(100))])) is not None
    gate.set()
    thread.join(10)
    assert cache.latest_version == 6 and cache.versions() == (6,)
    (error,) = errors
    assert isinstance(error, WeightCacheError)
    assert "version 5 finished after the newer version 6" in str(error)
    cache.close()

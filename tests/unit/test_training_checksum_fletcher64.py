"""fletcher64 must catch every change to a single 64-bit word, as its docstring promises.

It combined its two sums as ``s1 ^ rotl(s2, 32)``: a word changed by ``delta`` in a segment's
first block moves both sums by ``delta``, and whenever ``(s1 + delta) ^ s1`` has the form
``a << 32 | a`` the rotation cancels the XOR. In a zero-filled block (zero-initialised biases,
padding) that is any ``delta`` made of two equal 32-bit halves, e.g. a pair of float32 1.0s:
the corrupted segment verified and was applied.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlix_plugins.errors import ChecksumMismatchError
from rlix_plugins.training.bucket_cache import BucketCache, CacheConfig, StorageKind
from rlix_plugins.training.checksum import (
    ChecksumKind,
    fletcher64_numpy,
    fletcher64_torch,
    segment_checksums,
    tensor_fingerprint,
)
from rlix_plugins.training.receiver import StateDictTarget, ThreadReceiver
from rlix_plugins.training.sync import SyncOptions, sync_version
from rlix_plugins.training.wire import TransportKind

SEG = 2 << 20
#: two float32 1.0 in one little-endian word: equal 32-bit halves
TWO_ONES = 0x3F8000003F800000


def _changed(data: np.ndarray, word: int, delta: int) -> np.ndarray:
    out = data.copy()
    w = out.view("<u8")
    w[word] = (int(w[word]) + delta) & ((1 << 64) - 1)
    return out


@pytest.mark.parametrize("delta", [0x0000000100000001, TWO_ONES, 0xFFFFFFFFFFFFFFFF])
def test_a_single_word_change_in_a_zero_segment_is_detected(delta: int) -> None:
    zeros = np.zeros(SEG, dtype=np.uint8)
    bad = _changed(zeros, 3, delta)
    assert fletcher64_numpy(bad) != fletcher64_numpy(zeros)
    assert fletcher64_torch(torch.from_numpy(bad)) != fletcher64_torch(torch.from_numpy(zeros))
    _, good_segs = segment_checksums(zeros, SEG, ChecksumKind.FLETCHER64)
    _, bad_segs = segment_checksums(bad, SEG, ChecksumKind.FLETCHER64)
    assert bad_segs != good_segs


def test_a_single_word_change_is_detected_whatever_the_data() -> None:
    # nonzero data only in the first block: both sums equal S, and a change delta with
    # (S + delta) ^ S == a << 32 | a cancelled under the rotation
    rng = np.random.default_rng(7)
    for _ in range(200):
        data = np.zeros(64 << 10, dtype=np.uint8)
        data[: 32 << 10] = rng.integers(0, 256, 32 << 10, dtype=np.uint8)
        s = int(data.view("<u8")[: 4096].sum(dtype=np.uint64))
        a = int(rng.integers(1, 1 << 32))
        delta = ((s ^ (a << 32 | a)) - s) & ((1 << 64) - 1)
        bad = _changed(data, int(rng.integers(0, 4096)), delta)
        assert fletcher64_numpy(bad) != fletcher64_numpy(data)
    # and in every block of a segment (block weights 1..64), for a change of each bit
    zeros = np.zeros(SEG, dtype=np.uint8)
    base = fletcher64_numpy(zeros)
    for block in range(SEG // (32 << 10)):
        for bit in (0, 31, 32, 63):
            assert fletcher64_numpy(_changed(zeros, block * 4096, 1 << bit)) != base


def test_a_corrupted_word_in_the_cache_fails_the_sync_and_is_not_applied() -> None:
    weights = {"bias": torch.zeros(1 << 18), "weight": torch.full((4096,), 0.5)}
    cache = BucketCache(
        "review4-checksum",
        CacheConfig(bucket_bytes=4 << 20, storage=StorageKind.PAGEABLE, ram_reserve_bytes=0),
    )
    cache.build(1, weights.items())
    with cache.pinned(1) as cv:
        # a fault after the bucket was sealed: one word of the zero bias becomes two 1.0s
        words = cv.buckets[0].data.numpy().view("<u8")
        words[5] = TWO_ONES
    target = StateDictTarget({k: torch.full_like(v, -1.0) for k, v in weights.items()})
    receiver = ThreadReceiver("s0", target.load_weights, destination=target.destination)
    try:
        with pytest.raises(ChecksumMismatchError):
            sync_version(
                cache, 1, [receiver],
                options=SyncOptions(ack_timeout_s=30, transports={"s0": TransportKind.ZMQ}),
            )
    finally:
        receiver.close()
        cache.close()
    assert receiver.versions == []
    # nothing from the bad segment reached the target (the bias starts in it)
    assert bool((target.tensors["bias"][:16] == -1.0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gpu_path_catches_the_same_single_word_changes_as_the_host() -> None:
    """The device path sums blocks on the GPU and combines them on the host: on the cases the
    old combination missed it must equal the host's checksum and differ from the clean one,
    whole and per segment (the receiver verifies CUDA IPC / NCCL buckets this way)."""
    from rlix_plugins.training.checksum import segment_checksums_torch

    zeros = np.zeros(SEG + 4104, dtype=np.uint8)  # a short last segment, a partial block
    clean_gpu = torch.from_numpy(zeros).cuda()
    clean = segment_checksums_torch(clean_gpu, SEG)
    assert clean == segment_checksums(zeros, SEG, ChecksumKind.FLETCHER64)
    for delta in (0x0000000100000001, TWO_ONES, 0xFFFFFFFFFFFFFFFF):
        for word in (3, SEG // 8 + 5):  # first segment, and the short last one
            bad = _changed(zeros, word, delta)
            on_gpu = torch.from_numpy(bad).cuda()
            assert fletcher64_torch(on_gpu) == fletcher64_numpy(bad)
            assert fletcher64_torch(on_gpu) != fletcher64_torch(clean_gpu)
            got = segment_checksums_torch(on_gpu, SEG)
            assert got == segment_checksums(bad, SEG, ChecksumKind.FLETCHER64)
            assert got[1] != clean[1]


def test_a_tensor_fingerprint_is_the_checksum_of_its_bytes_in_16_hex_digits() -> None:
    g = torch.Generator().manual_seed(3)
    t = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    raw = t.reshape(-1).view(torch.uint8).numpy()
    fp = tensor_fingerprint(t)
    assert fp == f"{fletcher64_numpy(raw):016x}" and len(fp) == 16
    # a view with other strides: the bytes of its values in order, not of its storage
    assert tensor_fingerprint(t.t()) == tensor_fingerprint(t.t().contiguous())
    assert tensor_fingerprint(t.t()) != fp
    # any dtype; a one-bit change shows
    flipped = t.clone()
    flipped.view(torch.int16)[5, 7] ^= 1
    assert tensor_fingerprint(flipped) != fp
    assert tensor_fingerprint(t.float()) != fp

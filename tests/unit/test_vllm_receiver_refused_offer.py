"""An offer the worker refuses before touching the model leaves its recorded version as it was.

The receiver extension and its control channel are real; the vLLM worker and its model runner
are FAKES from test_training_receiver_partial (vLLM cannot run in a unit test).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from rlix_plugins.errors import WeightSyncError
from rlix_plugins.training.checksum import ChecksumKind
from rlix_plugins.training.wire import SyncOffer, TransportKind
from tests.unit.test_training_receiver_partial import FakeModelRunner, Worker


def _never_called(it: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    raise AssertionError("the model was loaded from an offer that was refused")


def test_an_unreachable_sender_is_refused_and_the_version_is_kept() -> None:
    # The version was cleared before connecting: a worker holding version 5 intact reported
    # None after an offer with a malformed control address was refused (nothing applied).
    worker = Worker(FakeModelRunner(_never_called))
    worker._rlix_weight_version = 5
    offer = SyncOffer(pipeline_id="p", sync_id="s1", shard_id="s0", version=6,
                      transport=TransportKind.ZMQ, control_address="not-an-endpoint",
                      num_buckets=1, total_bytes=8, max_bucket_bytes=8,
                      checksum=ChecksumKind.FLETCHER64, timeout_s=1.0)
    with pytest.raises(WeightSyncError, match="cannot connect to the sender's control address"):
        worker.rlix_receive_weights(offer.to_dict())
    assert worker.rlix_weight_version() == 5

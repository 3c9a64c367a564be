"""``set_shard_controller`` refuses what is not a shard controller before sending anything.

The coordinator's constructor takes a controller or a factory (a class or a function that
builds one), so a host handing a factory to ``set_shard_controller`` too is a natural mistake.
It was installed as is: the next ``resize_infer`` failed with "AttributeError: 'function'
object has no attribute 'shrink'" and the scheduler fenced (killed) the pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from rlix_plugins.adapters.pipeline_coordinator import set_shard_controller
from rlix_plugins.errors import ProtocolError


class _Controller:
    def shrink(self, dp_ranks: Sequence[int]) -> None:
        pass

    def expand(self, dp_ranks: Sequence[int]) -> None:
        pass


@pytest.mark.parametrize(
    "bad", [None, lambda pid: _Controller(), _Controller, object()],
    ids=["none", "factory-function", "controller-class", "object"],
)
def test_what_is_not_a_shard_controller_is_refused_before_the_call(bad: Any) -> None:
    # no coordinator actor behind this handle: nothing may be sent to it
    handle = object()
    with pytest.raises(ProtocolError, match=r"shrink.*expand"):
        set_shard_controller(handle, bad)

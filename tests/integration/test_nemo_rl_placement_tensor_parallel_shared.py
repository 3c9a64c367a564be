"""A vLLM tp*pp > 1 NeMo RL pipeline under the coordinator, against NeMo RL's real source on a
real local Ray (2 logical GPUs) with the real coordinator actors.

The coordinator's shared per-node groups (``rlix:roll_resource_manager``) hold every GPU of
every node; NeMo RL's tensor-parallel vLLM path needs per-GPU bundles they do not have. A
placement group of the pipeline's own (``{CPU: 2, GPU: 1}`` per GPU) next to them either can
never be placed (groups first: the job hangs in setup) or, made first, stops the groups being
created for every other pipeline. So the bind refuses such a pipeline with a
:class:`PlacementError` before it reserves or registers anything.

The scenarios run in one child process (``tests/support/nemo_rl_tp_shared_run.py``) with its
own ``ray.init(num_gpus=2, num_cpus=8)``, as ``test_nemo_rl_placement.py``'s do. Skipped with a
loud reason without NEMO_RL_SRC (the shared ``nemo_rl_src`` fixture).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.scenario_results import ok, read_results

pytestmark = [pytest.mark.nemo_rl, pytest.mark.integration]



@pytest.fixture(scope="module")
def scenarios(nemo_rl_src: Path) -> dict[str, Any]:
    """Run both scenarios once; {name: {"ok": result} | {"failed": reason}}."""
    return read_results("tests.support.nemo_rl_tp_shared_run", nemo_rl_src)


def _assert_refused_leaving_nothing(r: dict[str, Any]) -> None:
    bind = r["bind"]
    # Refused at once (not pending on a group that can never be placed), typed, and saying
    # why and what is valid.
    assert bind["outcome"] == "PlacementError", bind
    msg = bind["error"]
    assert "tp*pp=2" in msg
    assert "rlix:roll_resource_manager" in msg
    assert "tensor_parallel_size * pipeline_parallel_size == 1" in msg
    assert "RLIX_CONTROL_PLANE" in msg
    # Nothing reserved, nothing registered or claimed, PIPELINE_ID as before.
    assert r["own_pgs"] == []
    assert r["pipelines"] == {"registered": [], "owners": [], "claimed": False,
                              "pipeline_id_env": None}


def test_tp2_pipeline_is_refused_when_the_coordinators_groups_hold_every_gpu(
    scenarios: dict[str, Any],
) -> None:
    """Before the fix: the bind sat PENDING on a group of its own (NeMo RL waits 180 s per
    try, with retries), the job hanging in setup with no error naming the cause."""
    r = ok(scenarios, "groups_first")
    _assert_refused_leaving_nothing(r)
    assert r["views_bound"] == [False, False]
    # The coordinator's groups are untouched: both GPUs still free for shared pipelines.
    assert r["shared_after"] == {"free": pytest.approx(2.0), "total": pytest.approx(2.0)}


def test_tp2_pipeline_binding_first_does_not_block_the_coordinators_groups(
    scenarios: dict[str, Any],
) -> None:
    """Before the fix: the bind made a group of its own over both GPUs and registered the
    pipeline; the manager's get_state (every other pipeline's first call) then never
    returned."""
    r = ok(scenarios, "pipeline_first")
    _assert_refused_leaving_nothing(r)
    assert r["others_get_state"] == "ok"
    assert r["shared_after"] == {"free": pytest.approx(2.0), "total": pytest.approx(2.0)}

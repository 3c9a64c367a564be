"""Under the coordinator with its manager running, a vLLM tp*pp > 1 NeMo RL pipeline is refused
at its first bind, before any placement group is made or the pipeline claims its GPUs.

Needs NeMo RL's source (``nemo_rl_src``: its real ``RayVirtualCluster``); no Ray is started:
the manager lookup and both placement constructors are FAKES that record being called. The
same refusal on real Ray with the real coordinator:
``tests/integration/test_nemo_rl_placement_tensor_parallel_shared.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.nemo_rl


@pytest.fixture
def placement(nemo_rl_src: Path) -> Iterator[Any]:
    from rlix_plugins.adapters import nemo_rl_placement

    yield nemo_rl_placement


def _generation_cfg(tp: int, pp: int) -> dict[str, Any]:
    return {"vllm_cfg": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp},
            "rlix": {"infer_gpus": [0, 1], "train_gpus": [0]}}


@pytest.fixture
def calls(placement: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """FAKE manager lookup (the manager runs) and FAKE placement constructors / setup claim,
    each recording its name when called."""
    made: list[str] = []

    def fake(name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            made.append(name)
            raise AssertionError(f"{name} must not be reached")
        return record

    monkeypatch.setattr(placement, "find_manager", lambda: (object(), "rlix"))
    monkeypatch.setattr(placement.SharedPlacement, "create", classmethod(
        lambda cls, *a, **k: fake("SharedPlacement.create")()))
    monkeypatch.setattr(placement.CoordinatorPlacement, "create", classmethod(
        lambda cls, *a, **k: fake("CoordinatorPlacement.create")()))
    monkeypatch.setattr(placement, "_claim_setup", fake("claim_setup"))
    return made


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_bind_refuses_model_parallel_vllm_on_the_coordinators_groups(
    placement: Any, calls: list[str], tp: int, pp: int,
) -> None:
    cluster = placement.RLixPlacementCluster
    train = cluster([1], num_gpus_per_node=2, name="grpo_train_cluster")
    infer = cluster([2], num_gpus_per_node=2, name="grpo_inference_cluster")
    cfg = _generation_cfg(tp, pp)
    if tp * pp > 2:
        cfg["rlix"]["infer_gpus"] = [0, 1, 2, 3]
    with pytest.raises(placement.PlacementError) as info:
        infer.rlix_bind(cfg)
    msg = str(info.value)
    assert f"tp*pp={tp * pp}" in msg and "rlix:roll_resource_manager" in msg
    assert "tensor_parallel_size * pipeline_parallel_size == 1" in msg
    assert "RLIX_CONTROL_PLANE" in msg
    # Nothing reserved, nothing claimed; the views stay unbound (refusing to place).
    assert calls == []
    pair = infer._rlix_pair
    assert pair.placement is None and pair.layout is None and pair.released == set()
    assert train.rlix_plan is None and infer.rlix_plan is None
    # Refused again the same way (no half-made state to trip over).
    with pytest.raises(placement.PlacementError):
        train.rlix_bind(cfg)
    assert calls == []


def test_without_the_manager_a_tensor_parallel_pipeline_keeps_a_group_of_its_own(
    placement: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Gate off / no manager: nothing to share, NeMo RL's per-GPU bundles of its own.
    monkeypatch.setattr(placement, "find_manager", lambda: None)
    assert placement.coordinator_groups(2) is None
    assert placement.coordinator_groups(1) is None


def test_with_the_manager_tp1_takes_the_coordinators_groups(
    placement: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = (object(), "rlix")
    monkeypatch.setattr(placement, "find_manager", lambda: found)
    assert placement.coordinator_groups(1) is found
    with pytest.raises(placement.PlacementError, match="tp\\*pp=4"):
        placement.coordinator_groups(4)

from __future__ import annotations

import pytest

from rlix_plugins.coordinator.core import Topology, check_state, validate_registration
from rlix_plugins.errors import RegistrationError
from tests.core_builders import new_state, register

TOPO = Topology(num_nodes=2, gpus_per_node=4)


def reg(maps: dict[str, list[int]], tps: dict[str, int] | None = None, pid: str = "ft_0") -> None:
    validate_registration(
        TOPO,
        pipeline_id=pid,
        ray_namespace="ns",
        cluster_tp_configs=tps if tps is not None else dict.fromkeys(maps, 1),
        cluster_device_mappings=maps,
    )


@pytest.mark.parametrize(
    ("maps", "tps", "needle"),
    [
        ({"actor_infer": [1, 0]}, None, "sorted"),
        ({"actor_infer": [0, 0]}, None, "twice"),
        ({"actor_infer": [0, 8]}, None, "outside 0..7"),
        ({"actor_infer": []}, None, "non-empty"),
        ({"actor_infer": [0, 1, 2]}, {"actor_infer": 2}, "multiple of tp=2"),
        ({"actor_infer": [0, 2]}, {"actor_infer": 2}, "not contiguous"),
        ({"actor_infer": [2, 3, 4, 5]}, {"actor_infer": 4}, "crosses a node"),
        ({"actor_infer": [0, 1, 2]}, {"actor_infer": 3}, "tp=3 is not valid"),
        ({"actor_infer": list(range(2, 8))}, {"actor_infer": 8}, "multiple of tp=8"),
        ({"policy": [0]}, None, "unknown cluster names"),
        ({}, {}, "no GPU cluster"),
        ({"actor_infer": [0]}, {}, "no tp config"),
        ({"actor_infer": [0, True]}, None, "must hold ints"),
    ],
)
def test_bad_registrations_name_the_problem(
    maps: dict[str, list[int]], tps: dict[str, int] | None, needle: str
) -> None:
    with pytest.raises(RegistrationError, match=needle):
        reg(maps, tps)


def test_node_aligned_tp_across_nodes_is_valid() -> None:
    reg({"actor_infer": list(range(8))}, {"actor_infer": 8})
    with pytest.raises(RegistrationError, match="node boundary"):
        validate_registration(
            Topology(3, 4),
            pipeline_id="ft_1",
            ray_namespace="ns",
            cluster_tp_configs={"actor_infer": 8},
            cluster_device_mappings={"actor_infer": list(range(2, 10))},
        )


def test_bad_pipeline_id_and_reward_is_ignored() -> None:
    with pytest.raises(RegistrationError, match="never ':'"):
        reg({"actor_infer": [0]}, pid="ft:bad")
    spec = validate_registration(
        TOPO,
        pipeline_id="ft_2",
        ray_namespace="ns",
        cluster_tp_configs={"actor_infer": 1, "reward": 1},
        cluster_device_mappings={"actor_infer": [0, 1], "reward": []},
    )
    assert [c.name for c in spec.clusters] == ["actor_infer"]
    assert spec.generation is not None and spec.generation.dp_size == 2


def test_duplicate_registration_leaves_state_unchanged() -> None:
    state = new_state()
    register(state, "ft_a", train=[0, 1], infer=[0, 1, 2, 3])
    before = (dict(state.pipelines), list(state.owner), state.revision)
    with pytest.raises(RegistrationError, match="already registered"):
        register(state, "ft_a", infer=[4])
    assert (dict(state.pipelines), list(state.owner), state.revision) == before
    check_state(state)

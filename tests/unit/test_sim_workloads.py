"""The RollMux trace builder: job sizes, cluster fit and its refusal of bad input."""

from __future__ import annotations

import pytest

from rlix_plugins.sim.workloads import rollmux_trace


def test_rollmux_sizes_restrict_the_draw() -> None:
    wl = rollmux_trace("mixed", num_jobs=12, nodes=1, steps=2, seed=3, sizes=("S",))
    assert {(j.train_gpus, j.infer_gpus, j.infer_tp) for j in wl.jobs} == {(4, 4, 1)}
    assert wl.exclusive_nodes == wl.shared_nodes == 1


def test_rollmux_default_sizes_draw_every_size() -> None:
    wl = rollmux_trace("mixed", num_jobs=40, nodes=8, steps=2, seed=3)
    assert {j.train_gpus for j in wl.jobs} == {4, 8, 16}
    # The seed's stream is pinned: committed results (run.py, scale.py) depend on these draws.
    head = [(j.train_gpus, round(j.arrival_s, 1)) for j in wl.jobs[:6]]
    assert head == [(4, 0.0), (4, 225.8), (16, 644.3), (8, 1646.7), (4, 1937.5), (8, 2052.1)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sizes": ("XL",)}, "need one or more of S, M, L"),
        ({"sizes": ()}, "need one or more of S, M, L"),
        ({"nodes": 2}, "need 32 GPUs per job.*the cluster has 16"),
        ({"profile": "heavy"}, "valid: balanced, rollout_heavy, training_heavy, mixed"),
    ],
)
def test_rollmux_bad_input_is_refused_by_name(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rollmux_trace(**kwargs)  # type: ignore[arg-type]

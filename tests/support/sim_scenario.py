"""A small scenario file's contents for the simulator's scenario loader tests."""

from __future__ import annotations

from typing import Any


def one_node_scenario(**pipeline: Any) -> dict[str, Any]:
    """A one-node (4 GPUs) scenario whose single pipeline takes ``pipeline``'s fields over a
    valid base (training on GPU 0, inference on GPUs 0-1, two short steps)."""
    base: dict[str, Any] = {
        "train": [0],
        "infer": [0, 1],
        "steps": 2,
        "batch": 4,
        "lengths": {"kind": "uniform", "a": 1.0, "b": 3.0, "cap_s": 3.0},
        "phases": {
            "old_log_probs_s": 0.5,
            "ref_log_probs_s": 0.5,
            "update_actor_s": 2.0,
            "sync_weight_s": 0.3,
        },
    }
    return {"gpus_per_node": 4, "nodes": 1, "pipelines": [base | pipeline]}

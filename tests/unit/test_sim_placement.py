"""SpanPlacer: a new job's training block goes where the fewest training clusters already are."""

from __future__ import annotations

from dataclasses import replace

from rlix_plugins.sim.placement import SpanPlacer
from rlix_plugins.sim.workloads import JobSpec, long_tail_agentic


def _job(train_gpus: int) -> JobSpec:
    template = long_tail_agentic(num_jobs=1, steps=1).jobs[0]
    return replace(template, train_gpus=train_gpus, infer_gpus=4, infer_tp=4)


def test_training_blocks_spread_before_they_stack() -> None:
    placer = SpanPlacer(num_gpus=16, gpus_per_node=8, span_factor=1.0)
    first = placer.place(0, _job(8))
    second = placer.place(1, _job(8))
    assert first.train == tuple(range(0, 8)) and second.train == tuple(range(8, 16))


def test_ties_on_the_busiest_gpu_go_to_the_block_with_less_training_overall() -> None:
    """Three 4-GPU jobs cover GPUs 0..11 once each, so every aligned 8-GPU block has one
    cluster on its busiest GPU; 8..15 has four covered GPUs, 0..7 and 4..11 eight: 8..15
    wins (the previous rule took the lowest index, 0..7)."""
    placer = SpanPlacer(num_gpus=16, gpus_per_node=8, span_factor=1.0)
    placer.place(0, _job(4))  # 0..3
    placer.place(1, _job(4))  # 4..7
    placer.place(2, _job(4))  # 8..11
    placed = placer.place(3, _job(8))
    assert placed.train == tuple(range(8, 16))
    assert max(placer.train_use) == 2 and placer.train_use[:8] == [1] * 8


def test_release_frees_the_block_for_the_next_job() -> None:
    placer = SpanPlacer(num_gpus=16, gpus_per_node=8, span_factor=1.0)
    placer.place(0, _job(8))
    placer.place(1, _job(8))
    placer.release(0)
    assert placer.place(2, _job(8)).train == tuple(range(0, 8))

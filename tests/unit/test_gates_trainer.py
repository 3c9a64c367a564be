"""The rehearsal trainer: the engines' tiny Llama with HF names, real optimizer steps, and the
Megatron groups destroyed after each step and re-created before the next (gloo, one rank).

Runs in a child process: it initialises torch.distributed's default group, which must not
leak into other tests.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any


def _train(model_dir: str, queue: Any) -> None:
    from rlix_plugins.gates.trainer import TinyLlamaTrainer, plain_param

    t = TinyLlamaTrainer(Path(model_dir), seed=3)
    names = [n for n, _ in t.hf_weights()]
    before = t.plain_checksums()
    samples = [((5, 6, 7), (10, 600, 20, 30)), ((8, 9), (700, 800, 3))] * 4
    s0 = t.train_step(samples, 0)
    after = t.plain_checksums()
    groups_gone = not t.lifecycle.initialized
    s1 = t.train_step(samples, 1)  # re-initialises the destroyed groups first
    queue.put({
        "names": names, "plain": sorted(before), "changed": sorted(k for k in before
                                                                   if before[k] != after[k]),
        "losses": [s0.loss, s1.loss], "destroyed": [s0.groups_destroyed, s1.groups_destroyed],
        "groups_gone": groups_gone, "cycles": t.cycles,
        "plain_ok": all(plain_param(n) for n in before),
    })
    t.close()


def test_trainer_steps_change_weights_and_cycle_megatron_groups(tmp_path: Path) -> None:
    from rlix_plugins.generation.tiny_engine import write_tiny_llama

    model_dir = write_tiny_llama(tmp_path / "m")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_train, args=(str(model_dir), queue))
    proc.start()
    out = queue.get(timeout=240)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    # the names vLLM's Llama loader expects (HF checkpoint names)
    assert "model.embed_tokens.weight" in out["names"] and "lm_head.weight" in out["names"]
    assert "model.layers.1.self_attn.q_proj.weight" in out["names"]
    assert "model.layers.0.mlp.gate_proj.weight" in out["names"]
    assert out["plain_ok"] and "model.norm.weight" in out["plain"]
    # a real step moves the bf16 weights the engines would compare
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(out["changed"])
    assert all(abs(x) < 1e3 for x in out["losses"])
    assert out["groups_gone"] and out["cycles"] == 2
    assert min(out["destroyed"]) > 0

"""What the validation-demand and end-of-run fixes assume of NeMo RL, checked in its real
source (commit 7ea279abf, ``NEMO_RL_SRC``); ``grpo`` cannot be imported here (Python 3.12), so
its function bodies are read with ``ast``. NeMo RL's real ``CheckpointManager`` (importable)
runs under our subclass against the real coordinator.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.integration.test_nemo_rl_resume_last_step_and_async_save import _function

pytestmark = [pytest.mark.nemo_rl, pytest.mark.integration]


def _grpo(src: Path) -> Path:
    return src / "nemo_rl" / "algorithms" / "grpo.py"


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)
            and ast.unparse(n.func) == name]


def test_validate_is_called_by_its_global_name_with_loader_step_and_config(
        nemo_rl_src: Path) -> None:
    """Replacing ``grpo.validate`` reaches both validations of the async loop (the initial
    one and the periodic / final one), and the wrapper finds the loader, step and config."""
    node, _ = _function(_grpo(nemo_rl_src), "async_grpo_train")
    calls = _calls(node, "validate")
    assert len(calls) == 2
    for call in calls:
        assert ast.unparse(call.args[1]) == "val_dataloader"
        assert {k.arg for k in call.keywords} >= {"step", "master_config"}
    validate, _ = _function(_grpo(nemo_rl_src), "validate")
    assert isinstance(validate, ast.FunctionDef)
    assert [a.arg for a in validate.args.args][:6] == [
        "policy_generation", "val_dataloader", "tokenizer", "val_task_to_env", "step",
        "master_config"]


def test_validate_only_iterates_the_loader_in_config_sized_batches(nemo_rl_src: Path) -> None:
    """What :func:`validation_size` and the counting loader rely on: ``validate`` only
    iterates ``val_dataloader`` (``enumerate``), stops at ``max_val_samples //
    val_batch_size`` batches and repeats each prompt ``val_num_generations_per_prompt``
    times; a missing loader returns before generating."""
    validate, text = _function(_grpo(nemo_rl_src), "validate")
    uses = [n for n in ast.walk(validate) if isinstance(n, ast.Name)
            and n.id == "val_dataloader"]
    loops = [n for n in ast.walk(validate) if isinstance(n, ast.For)
             and ast.unparse(n.iter) == "enumerate(val_dataloader)"]
    assert len(loops) == 1
    # besides the loop: the None check and the assert's condition only
    assert len(uses) == 3, [ast.unparse(u) for u in uses]
    assert "if val_dataloader is None:" in text
    assert ("master_config.grpo.max_val_samples // master_config.grpo.val_batch_size"
            in text.replace("\n", " ").replace("(", " ").replace(")", " ").replace("  ", " ")
            or "max_val_samples // master_config.grpo.val_batch_size" in text)
    assert "if batch_idx >= max_batches:" in text
    assert "val_batch.repeat_interleave(val_num_generations_per_prompt)" in text


def test_every_way_out_of_the_async_loop_shuts_the_checkpointer_down_first(
        nemo_rl_src: Path) -> None:
    """``checkpointer.shutdown()`` is where our subclass ends the run: NeMo RL calls it before
    each ``return`` of its loop and first in its ``finally`` (before it kills the collector
    and shuts the generation down, which unregisters the pipeline), and on the early stop
    after the initial validation, which returns before that ``finally``."""
    node, text = _function(_grpo(nemo_rl_src), "async_grpo_train")
    loop = text.index("while step < master_config.grpo.max_num_steps:")
    final = text.index("finally:", text.index("except Exception as e:", loop))
    # Before the collector starts nothing reports demand (those returns, a failed
    # prepare_for_generation, are covered by training_run around the whole call).
    started = next(c.lineno for c in _calls(node, "trajectory_collector.start_collection.remote"))
    bodies = [b for n in ast.walk(node) for b in (getattr(n, "body", None),
                                                   getattr(n, "orelse", None))
              if isinstance(b, list)]
    exits = [(body, i) for body in bodies for i, stmt in enumerate(body)
             if isinstance(stmt, ast.Return) and stmt.lineno > started]
    assert len(exits) == 4  # initial early stop; early stop, timeout, last step
    for body, i in exits:  # the block that returns shut the checkpointer down before
        assert any(_calls(stmt, "checkpointer.shutdown") for stmt in body[:i]), body[i].lineno
    assert text.index("checkpointer.shutdown()", final) < text.index(
        "ray.kill(trajectory_collector)", final) < text.index(
        "policy_generation.shutdown()", final)
    _, setup_text = _function(_grpo(nemo_rl_src), "setup")
    assert "checkpointer = CheckpointManager(checkpointing_config)" in setup_text
    source = _grpo(nemo_rl_src).read_text()
    assert "from nemo_rl.utils.checkpoint import CheckpointingConfig, CheckpointManager" in (
        source)


@pytest.fixture
def real_checkpointer(nemo_rl_src: Path, tmp_path: Path) -> Iterator[Any]:
    """NeMo RL's real ``CheckpointManager`` (checkpointing disabled) under our subclass."""
    from nemo_rl.utils.checkpoint import CheckpointManager

    from rlix_plugins.adapters import nemo_rl

    cls = nemo_rl.make_checkpoint_manager_class(CheckpointManager)
    yield cls({"enabled": False, "checkpoint_dir": str(tmp_path), "metric_name": None,
               "higher_is_better": True, "keep_top_k": None, "save_period": 1,
               "save_optimizer": False})


def test_the_real_checkpointer_shutdown_clears_the_demand(
        coordinator: Any, real_checkpointer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from rlix_plugins.adapters import nemo_rl
    from rlix_plugins.adapters.nemo_rl import NemoRlLayout, NemoRlPipeline
    from rlix_plugins.hooks import make_hooks
    from rlix_plugins.protocol.names import pipeline_namespace
    from rlix_plugins.settings import load_settings

    pid = "ft_0000000000c5"
    settings = load_settings({"RLIX_CONTROL_PLANE": "rlix",
                              "RLIX_NAMESPACE": coordinator.namespace})
    layout = NemoRlLayout((0, 1), (0,))
    ray.get(coordinator.orchestrator.register_pipeline.remote(
        pipeline_id=pid, ray_namespace=pipeline_namespace(pid),
        cluster_tp_configs=layout.tp_configs(), cluster_device_mappings=layout.device_mappings()))
    pipeline = NemoRlPipeline(settings, SimpleNamespace(), layout,
                              make_hooks(settings, pipeline_id=pid, heartbeat=False), pid)
    pipeline._registered = True
    monkeypatch.setattr(nemo_rl, "_pipeline", pipeline)

    def demand() -> int | None:
        status = coordinator.status()
        return next(p.demand for p in status.pipelines if p.pipeline_id == pid)  # type: ignore[no-any-return]

    try:
        pipeline.hooks.report_progress(step_target_trajectories=4, collected=1,
                                       current_train_step=3, new_batch=True)
        assert demand() == 3
        real_checkpointer.shutdown()  # NeMo RL's, after ours
        assert demand() == 0  # run over (was 3 until policy_generation.shutdown() unregistered)
        real_checkpointer.shutdown()  # NeMo RL calls it again in its finally: still fine
    finally:
        pipeline.shutdown()

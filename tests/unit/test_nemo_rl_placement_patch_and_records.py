"""Robustness of the NeMo RL placement plan, host patch, observation records and doctor.

NeMo RL's source is not here: the host modules these tests import are FAKE stand-ins written
to ``tmp_path`` (or module objects put into ``sys.modules``), with only the names the patch's
plug points name.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.adapters.nemo_rl_placement_plan import (
    BundleGpu,
    PlacementError,
    layout_gpus,
    plan_pinned,
    plan_placement,
)
from rlix_plugins.adapters.observability import (
    ObservationError,
    ObservationWriter,
    RouterCountersObserved,
    read_observations,
)
from rlix_plugins.errors import RlixPluginsError
from rlix_plugins.patches import nemo_rl as nemo_rl_patch
from rlix_plugins.patches.base import PlugKind, PlugPoint
from rlix_plugins.patches.doctor import Outcome, check_point, check_static
from rlix_plugins.patches.nemo_rl import NemoRlPatch

REGISTRY = "nemo_rl.distributed.ray_actor_environment_registry"
STOCK_VLLM = "nemo_rl.models.generation.vllm.vllm_worker_async.VllmAsyncGenerationWorker"

# ------------------------------------------------------------------ placement plan (pure)


def _bundles(*gpus: int) -> list[BundleGpu]:
    return [BundleGpu(i, "n0", g) for i, g in enumerate(gpus)]


def test_plan_refuses_a_training_gpu_named_twice() -> None:
    # Two training ranks on one bundle = two Megatron workers on GPU 0 (plan_pinned refuses
    # the same layout).
    with pytest.raises(PlacementError, match=r"training GPUs \[0, 0\] name a GPU twice"):
        plan_placement([0, 1], [0, 0], _bundles(0, 1), {"n0": 0}, 2)
    with pytest.raises(PlacementError, match="name a GPU twice"):
        plan_pinned([0, 1], [0, 0], ["n0"], 2)


@pytest.mark.parametrize("rlix, what", [
    ({"infer_gpus": "01"}, "infer_gpus"),            # a string read as GPUs 0 and 1
    ({"infer_gpus": [0.7, 1]}, "infer_gpus"),        # 0.7 read as GPU 0
    ({"infer_gpus": [True, 0]}, "infer_gpus"),       # True read as GPU 1
    ({"infer_gpus": [0, 1], "train_gpus": 0}, "train_gpus"),  # TypeError: not iterable
    ({"infer_gpus": [-1, 0], "train_gpus": [0]}, "infer_gpus"),
    ({"infer_gpus": [0, 1], "train_gpu_count": "1"}, "train_gpu_count"),
    ({"infer_gpus": [0, 1], "train_gpu_count": 1.5}, "train_gpu_count"),
])
def test_layout_refuses_malformed_gpu_lists_naming_the_key(rlix: dict[str, Any],
                                                           what: str) -> None:
    with pytest.raises(PlacementError, match=rf"policy\.generation\.rlix\.{what}") as err:
        layout_gpus({"rlix": rlix}, 2, 1)
    assert "valid" in str(err.value)


def test_layout_refuses_a_rlix_section_that_is_not_a_mapping() -> None:
    with pytest.raises(PlacementError, match=r"policy\.generation\.rlix must be a mapping"):
        layout_gpus({"rlix": [0, 1]}, 2, 1)


# ------------------------------------------------------------------ NeMo RL patch parts

FAKE_REGISTRY_SRC = f"""
# FAKE NeMo RL actor-environment registry (only what the patch's plug points name).
ACTOR_ENVIRONMENT_REGISTRY = {{{STOCK_VLLM!r}: "vllm-venv"}}


def get_actor_python_env(actor_class_fqn):
    return ACTOR_ENVIRONMENT_REGISTRY[actor_class_fqn]
"""


@pytest.fixture
def fake_nemo_rl(tmp_path: Path) -> Iterator[Path]:
    """A FAKE ``nemo_rl`` package holding only the actor-environment registry module."""
    root = tmp_path / "site"
    pkg = root / "nemo_rl" / "distributed"
    pkg.mkdir(parents=True)
    (root / "nemo_rl" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "ray_actor_environment_registry.py").write_text(textwrap.dedent(FAKE_REGISTRY_SRC))
    assert not any(m == "nemo_rl" or m.startswith("nemo_rl.") for m in sys.modules)
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == "nemo_rl" or m.startswith("nemo_rl.")]:
            del sys.modules[name]


def _replace_registry_part(monkeypatch: pytest.MonkeyPatch, apply: Any) -> None:
    """Make the registry module's patch part run ``apply`` (patch, module) instead."""
    parts = tuple(nemo_rl_patch._Part(p.module, apply) if p.module == REGISTRY else p
                  for p in nemo_rl_patch._PARTS)
    monkeypatch.setattr(nemo_rl_patch, "_PARTS", parts)


def test_apply_part_that_imports_its_module_applies_it_once(
    fake_nemo_rl: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = nemo_rl_patch._apply_registry

    def counting(patch: NemoRlPatch, module: Any) -> None:
        calls.append(module.__name__)
        real(patch, module)

    _replace_registry_part(monkeypatch, counting)
    patch = NemoRlPatch()
    patch.apply()
    try:
        assert REGISTRY not in sys.modules
        # The import inside apply_part fires the post-import hook, which applies the part;
        # apply_part must not apply it a second time.
        patch.apply_part(REGISTRY)
        assert calls == [REGISTRY]
        assert patch.parts_applied == {REGISTRY}
    finally:
        patch.revert()
    registry = sys.modules[REGISTRY].ACTOR_ENVIRONMENT_REGISTRY
    assert registry == {STOCK_VLLM: "vllm-venv"}


def test_a_part_that_fails_halfway_leaves_the_host_unchanged(
    fake_nemo_rl: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half(patch: NemoRlPatch, module: Any) -> None:
        patch.set_item(module.ACTOR_ENVIRONMENT_REGISTRY, "rlix.Half", "vllm-venv")
        raise RuntimeError("second step of the part failed")

    _replace_registry_part(monkeypatch, half)
    patch = NemoRlPatch()
    patch.apply()
    try:
        # Load the FAKE module without the import system, so no hook fires.
        source = fake_nemo_rl / "nemo_rl" / "distributed" / "ray_actor_environment_registry.py"
        spec = importlib.util.spec_from_file_location(REGISTRY, source)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for parent in ("nemo_rl", "nemo_rl.distributed"):
            sys.modules.setdefault(parent, types.ModuleType(parent))
        sys.modules[REGISTRY] = module
        with pytest.raises(RuntimeError, match="second step"):
            patch.apply_part(REGISTRY, module)
        assert module.ACTOR_ENVIRONMENT_REGISTRY == {STOCK_VLLM: "vllm-venv"}
        assert patch.parts_applied == frozenset()
    finally:
        patch.revert()


def test_apply_part_of_an_unknown_module_is_a_typed_error() -> None:
    patch = NemoRlPatch()
    patch._enabled = True  # as after apply(), without registering any import hook
    with pytest.raises(RlixPluginsError, match="valid parts") as err:
        patch.apply_part("json")
    assert REGISTRY in str(err.value) and isinstance(err.value, ValueError)
    # A module whose plug points are only checked has no part (was StopIteration).
    with pytest.raises(RlixPluginsError, match="valid parts"):
        patch.apply_part("nemo_rl.weight_sync.interfaces")
    assert patch.parts_applied == frozenset()


# ------------------------------------------------------------------ observation records


def _counters(**kw: object) -> dict[str, object]:
    rec: dict[str, object] = {
        "kind": "router_counters", "pipeline_id": "p", "copy_id": "c", "submitted": 2,
        "completed": 2, "redispatched": 0, "lost": 0, "duplicated": 0, "cancelled": 0,
        "in_flight": 0, "migrated": 0, "time": 1.0,
    }
    rec.update(kw)
    return rec


def _versions(**kw: object) -> dict[str, object]:
    rec: dict[str, object] = {
        "kind": "shard_versions", "pipeline_id": "p", "event": "expand",
        "trainer_version": 1, "synced": [0], "shard_versions": {"0": 1}, "step": 1,
        "time": 1.0,
    }
    rec.update(kw)
    return rec


def _busy(**kw: object) -> dict[str, object]:
    rec: dict[str, object] = {"kind": "busy", "pipeline_id": "p", "stage": "train",
                              "gpus": [0], "start": 1.0, "end": 2.0, "shard": None}
    rec.update(kw)
    return rec


@pytest.mark.parametrize("line, field", [
    # misread: a fraction or a bool is not a count, a string is not a rank list
    (json.dumps(_counters(completed=1, lost=0.9, in_flight=1)), "lost"),
    (json.dumps(_counters(completed=1, duplicated=True, lost=True)), "lost"),
    (json.dumps(_versions(synced="12")), "synced"),
    (json.dumps(_versions(shard_versions={"0": 1.9})), "shard_versions"),
    (json.dumps(_busy(gpus="01")), "gpus"),
    (json.dumps(_versions(trainer_version="3")), "trainer_version"),
    # untyped crash: int(inf) raises OverflowError
    ('{"kind": "shard_versions", "pipeline_id": "p", "event": "expand", '
     '"trainer_version": Infinity, "synced": [], "shard_versions": {}, "time": 1}',
     "trainer_version"),
    ('{"kind": "busy", "pipeline_id": "p", "stage": "generation", "gpus": [0], '
     '"start": 1, "end": 2, "shard": Infinity}', "shard"),
])
def test_reader_refuses_values_it_would_misread_or_crash_on(tmp_path: Path, line: str,
                                                           field: str) -> None:
    (tmp_path / "p.jsonl").write_text(line + "\n")
    with pytest.raises(ObservationError, match=r"p\.jsonl:1: ") as err:
        read_observations(tmp_path)
    assert field in str(err.value)


def test_negative_counters_cannot_cancel_a_loss_in_the_sum() -> None:
    # copy A lost one request; a copy reporting lost=-1 would make the pipeline's sum 0.
    with pytest.raises(ObservationError, match="lost=-1"):
        RouterCountersObserved("p", "b", submitted=1, completed=2, redispatched=0, lost=-1,
                               duplicated=0, cancelled=0, in_flight=0)
    with pytest.raises(ObservationError, match="duplicated=-1"):
        RouterCountersObserved("p", "b", submitted=1, completed=1, redispatched=0, lost=0,
                               duplicated=-1, cancelled=0, in_flight=0)


def test_reader_names_the_line_of_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    good = json.dumps(_busy()).encode()
    (tmp_path / "p.jsonl").write_bytes(good + b"\n" + b'{"kind": "\xff"}\n')
    with pytest.raises(ObservationError, match=r"p\.jsonl:2: .*UTF-8"):
        read_observations(tmp_path)


def test_writer_refuses_a_pipeline_id_with_a_nul_byte(tmp_path: Path) -> None:
    # os.open raises ValueError (not OSError) on it: write() would raise an untyped error.
    with pytest.raises(ObservationError, match="cannot name a record file"):
        ObservationWriter(tmp_path, "ft_\x00x")


# ------------------------------------------------------------------ doctor


def test_static_check_reports_unparseable_source_instead_of_crashing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # FAKE host module in syntax this Python cannot parse (e.g. a 3.12-only construct).
    name = f"rlix_fake_host_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text("def f(:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    point = PlugPoint("fake", f"{name}:f", PlugKind.READ, ("x",))
    outcome, detail = check_static(point)
    assert outcome is Outcome.UNAVAILABLE and "cannot be parsed" in detail
    result = check_point("fake", point)
    assert result.outcome is Outcome.UNAVAILABLE and result.how == "static"
    sys.modules.pop(name, None)

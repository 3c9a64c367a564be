"""Megatron NCCL destroy/re-init inside veRL's training worker rebinds the engine's groups.

Gloo world of 2 with real megatron-core ``parallel_state`` (initialised by the host, as veRL's
``MegatronEngine._init_device_mesh`` does) and RLix's real worker subclass
(:func:`rlix_worker_class`) driving the real lifecycle through
``rlix_release_parallel_state`` / ``rlix_restore_parallel_state``. veRL's ``MegatronEngine``
itself needs CUDA (megatron's DDP buffers and distributed optimizer call
``torch.cuda.current_device()``), so the worker's engines are holders shaped like it, named
as fakes: ``FakeMegatronEngine`` with the attributes veRL 0.9.1 sets (``module`` = list of
DDP-shaped chunks, ``optimizer``, ``lr_scheduler``, ``checkpoint_mananager``), whose DDP /
optimizer-shaped objects come from the training module's rebind test. A contract test checks
those attribute names against veRL's real ``MegatronEngine`` / worker source.
"""

from __future__ import annotations

import ast
import functools
import inspect
import types
from typing import Any

import pytest

from tests.fixtures.distributed import run_world
from tests.fixtures.verl_env import VerlEnv

pytestmark = [pytest.mark.verl, pytest.mark.integration]

CYCLES = 3


def _assigned_self_attrs(cls: type) -> set[str]:
    """``self.<name> = ...`` targets anywhere in ``cls``'s own source."""
    tree = ast.parse(inspect.getsource(cls).lstrip())
    out: set[str] = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                    and t.value.id == "self":
                out.add(t.attr)
    return out


def test_rebind_roots_match_verl_megatron_engine(verl_env: VerlEnv) -> None:
    """The attributes the rebind walks are the ones veRL 0.9.1's real classes set."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    from rlix_plugins.patches.verl_workers import ENGINE_REBIND_ATTRS, WORKER_ENGINE_HOLDERS

    engine_attrs = _assigned_self_attrs(MegatronEngine)
    # everything but the bridge-side objects must be set by the engine itself
    assert {"module", "optimizer", "lr_scheduler", "checkpoint_mananager"} <= engine_attrs
    assert set(ENGINE_REBIND_ATTRS) <= engine_attrs, set(ENGINE_REBIND_ATTRS) - engine_attrs
    assert "engine" in _assigned_self_attrs(TrainingWorker)
    assert set(WORKER_ENGINE_HOLDERS) <= _assigned_self_attrs(ActorRolloutRefWorker)


# ------------------------------------------------------------------ fakes (named as such)
class FakeMegatronEngine:
    """Shaped like veRL's MegatronEngine after ``initialize()`` (CUDA-free holders)."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.module = [model]
        self.optimizer = optimizer
        self.lr_scheduler = types.SimpleNamespace(optimizer=optimizer)
        self.checkpoint_mananager = types.SimpleNamespace(model=self.module, optimizer=optimizer)
        self.tf_config = types.SimpleNamespace(num_layers=2)


class FakeVerlTrainingWorkerBase:
    """Shaped like veRL's ActorRolloutRefWorker after ``init_model`` (its role's engines)."""

    def __init__(self, role: str, actor: FakeMegatronEngine | None,
                 ref: FakeMegatronEngine | None) -> None:
        self.role = role
        self.actor = types.SimpleNamespace(engine=actor) if actor is not None else None
        self.ref = types.SimpleNamespace(engine=ref) if ref is not None else None


def _rank(rank: int, world_size: int, cycles: int) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d

    from rlix_plugins.patches.verl_workers import rlix_worker_class
    from rlix_plugins.training.nccl_lifecycle import StaleProcessGroupError
    from tests.integration.test_training_pg_rebind import _build_holders, _check_held, _current

    # the host (veRL's engine) initialises the parallel state; RLix adopts it
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    actor_roots, accessors = _build_holders(ps)
    ref_roots, ref_accessors = _build_holders(ps)
    actor = FakeMegatronEngine(actor_roots["model"], actor_roots["optimizer"])
    ref = FakeMegatronEngine(ref_roots["model"], ref_roots["optimizer"])
    ref.optimizer = ref.lr_scheduler = ref.checkpoint_mananager = None  # forward_only ref
    cls = rlix_worker_class(FakeVerlTrainingWorkerBase)
    # like veRL's WorkerDict with a separate ref role: two workers, one process, one state
    worker = cls("actor_rollout", actor, None)
    ref_worker = cls("ref", None, ref)
    # what the engines reach: the actor's model and optimizer, the (forward-only) ref's model
    reached = ("model", "buffer", "bucket", "pg_collection", "record", "hook")
    held = {k: v for k, v in accessors.items() if k.startswith((*reached, "optimizer"))}
    held.update({f"ref {k}": v for k, v in ref_accessors.items() if k.startswith(reached)})
    out: dict[str, Any] = {"roots": sorted(worker.rlix_rebind_roots()),
                           "ref_roots": sorted(ref_worker.rlix_rebind_roots())}
    restored = []
    for _ in range(cycles):
        destroyed = worker.rlix_release_parallel_state()
        assert destroyed["destroyed"] > 0, destroyed
        stale = [k for k, (get, _) in held.items() if get() in distributed_c10d._world.pg_map]
        assert not stale, f"still alive after the destroy: {stale}"
        restored.append(worker.rlix_restore_parallel_state())
        _check_held(ps, rank, held)  # every held reference is the live group and reduces
    out["restored"] = restored
    out["held"] = len(held)
    out["noop"] = worker.rlix_restore_parallel_state()  # alive: nothing to do

    # a group the walk cannot write back (functools.partial positional args) stays stale:
    # the re-init refuses to hand the step a destroyed group
    actor.optimizer.positional = functools.partial(dist.barrier, _current(ps)["tp"])
    worker.rlix_release_parallel_state()
    with pytest.raises(StaleProcessGroupError,
                       match=r"actor_rollout_actor_optimizer\.positional\.args\[0\]"):
        worker.rlix_restore_parallel_state()
    out["stale_raised"] = True
    # That re-init's groups exist (initialised) with its rebind pending: a retry is the rebind
    # again, never "nothing to do" (the guard in restore_parallel_state), and raises again
    # while the destroyed group is still held ...
    with pytest.raises(StaleProcessGroupError, match=r"optimizer\.positional"):
        worker.rlix_restore_parallel_state()
    # ... until the holder keeps the group where the walk can write it (a keyword, what the
    # error advises): the retry rebinds it.
    destroyed_tp = actor.optimizer.positional.args[0]
    actor.optimizer.positional = functools.partial(dist.barrier, group=destroyed_tp)
    out["retried"] = worker.rlix_restore_parallel_state()
    out["keyword_rebound"] = (
        actor.optimizer.positional.keywords["group"] is _current(ps)["tp"] is not destroyed_tp)
    _check_held(ps, rank, held)
    out["noop_after_retry"] = worker.rlix_restore_parallel_state()
    return out


def test_worker_reinit_rebinds_engine_groups_and_refuses_stale(verl_env: VerlEnv) -> None:
    results = run_world(_rank, 2, CYCLES)
    actor_roots = sorted(f"actor_{a}" for a in ("module", "optimizer", "lr_scheduler",
                                                "checkpoint_mananager"))
    for r in results:
        assert r["roots"] == actor_roots and r["ref_roots"] == ["ref_module"], r
        assert [x["restored"] for x in r["restored"]] == [True] * CYCLES
        # the re-init walked both workers of the process
        assert r["restored"][0]["roots"] == sorted(
            [f"actor_rollout_{n}" for n in actor_roots] + ["ref_ref_module"])
        rebound = [x["rebound"] for x in r["restored"]]
        # every probed reference (and the rest of ProcessGroupCollection's fields) is
        # replaced, the same number on every cycle
        assert rebound[0] >= r["held"] and rebound == [rebound[0]] * CYCLES, rebound
        assert r["noop"] == {"restored": False}
        assert r["stale_raised"]
        assert r["retried"]["restored"] is True and r["retried"]["rebound"] >= 1, r["retried"]
        assert r["retried"]["roots"] == r["restored"][0]["roots"]
        assert r["keyword_rebound"] and r["noop_after_retry"] == {"restored": False}

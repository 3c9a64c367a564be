"""What resume, the last step and async saves rely on in NeMo RL, checked in its real source (commit
7ea279abf, ``NEMO_RL_SRC``). ``grpo`` and the Megatron worker cannot be imported here (Python
3.12, megatron-bridge), so their function bodies are read with ``ast``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nemo_rl, pytest.mark.integration]


def _function(path: Path, qualname: str) -> tuple[ast.AST, str]:
    """The definition of ``qualname`` (``f`` or ``Class.f``) in ``path`` and its source."""
    source = path.read_text()
    body: list[ast.stmt] = ast.parse(source).body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next(n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                    and n.name == part)
        body = node.body
    assert node is not None
    text = ast.get_source_segment(source, node)
    assert text is not None
    return node, text


def _body_calls(node: ast.AST) -> list[str]:
    """Dotted names of the calls that are whole statements of ``node``'s body, in order."""
    assert isinstance(node, ast.FunctionDef)
    return [ast.unparse(s.value.func) for s in node.body
            if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)]


def test_async_grpo_train_is_imported_at_call_time_and_resumes_its_version(
        nemo_rl_src: Path) -> None:
    """Our ``grpo.async_grpo_train`` replacement reaches NeMo RL's script (it imports the
    name inside ``main``), and a resumed run's weight version starts at
    ``grpo_save_state.current_step`` (what ``start_run`` hands the pipeline)."""
    script = ast.parse((nemo_rl_src / "examples" / "run_grpo.py").read_text())
    top = [n for n in script.body if isinstance(n, ast.ImportFrom)
           and any(a.name == "async_grpo_train" for a in n.names)]
    nested = [n for n in ast.walk(script) if isinstance(n, ast.ImportFrom)
              and any(a.name == "async_grpo_train" for a in n.names)]
    assert top == [] and len(nested) == 1
    _, loop = _function(nemo_rl_src / "nemo_rl" / "algorithms" / "grpo.py", "async_grpo_train")
    assert "step = grpo_save_state.current_step" in loop
    assert "weight_version = step" in loop


def test_the_run_sets_a_version_it_never_trains_and_the_collector_is_unbounded(
        nemo_rl_src: Path) -> None:
    """After the final step's refit NeMo RL sets weight version ``max_num_steps`` on the
    collector and its loop ends; the collector itself knows no last step (it generates for
    later versions until it is killed), so our tracker must end the demand there."""
    _, loop = _function(nemo_rl_src / "nemo_rl" / "algorithms" / "grpo.py", "async_grpo_train")
    assert "while step < master_config.grpo.max_num_steps:" in loop
    refit = loop.index("refit_policy_generation(", loop.index("while step <"))
    bump = loop.index("weight_version += 1", refit)
    assert loop.index("trajectory_collector.set_weight_version.remote", bump) > bump
    assert "if step >= master_config.grpo.max_num_steps:" in loop
    collector = (nemo_rl_src / "nemo_rl" / "algorithms" / "async_utils"
                 / "trajectory_collector.py").read_text()
    assert "max_num_steps" not in collector


def test_an_async_save_returns_unfinalised_and_the_megatron_offload_finalises_first(
        nemo_rl_src: Path) -> None:
    """Megatron's async save returns before its write is finalised, NeMo RL finalises it
    only later (``begin_finalization(wait_fn=policy.finalize_async_save)``, run at the next
    save or at exit), and ``Policy.finalize_async_save`` (what our release calls under the
    hold) reaches every worker."""
    worker = (nemo_rl_src / "nemo_rl" / "models" / "policy" / "workers"
              / "megatron_policy_worker.py")
    _, save_text = _function(worker, "MegatronPolicyWorkerImpl.save_checkpoint")
    assert "if not is_async:" in save_text  # the async path skips the finalisation
    offload, _ = _function(worker, "MegatronPolicyWorkerImpl.offload_after_refit")
    assert _body_calls(offload)[0] == "self.finalize_async_save"  # before moving to CPU
    _, policy_finalize = _function(nemo_rl_src / "nemo_rl" / "models" / "policy"
                                   / "lm_policy.py", "Policy.finalize_async_save")
    assert 'run_all_workers_single_data("finalize_async_save")' in policy_finalize
    _, loop = _function(nemo_rl_src / "nemo_rl" / "algorithms" / "grpo.py", "async_grpo_train")
    saved = loop.index("policy.save_checkpoint(")
    assert loop.index("wait_fn=policy.finalize_async_save", saved) > saved

"""NeMo RL's real configs through its real ``grpo.setup`` under the gate (Python >= 3.12).

Run by ``tests/integration/test_nemo_rl_pipeline.py`` with the interpreter named by
``NEMO_RL_PY312`` (NeMo RL's ``grpo`` needs Python >= 3.12). With ``RLIX_CONTROL_PLANE=rlix``
activated, it imports ``setup`` the way ``examples/run_grpo.py`` does (a module-level
``from nemo_rl.algorithms.grpo import setup``), builds master configs the way run_grpo.py does
(NeMo RL's ``load_config`` + ``parse_hydra_overrides`` + ``MasterConfig``) from NeMo RL's own
example configs and from the gate configs' NeMo RL jobs (``gpu_mode.load_jobs``: the exact
command lines the GPU gates launch), calls ``setup`` with NeMo RL's default recipe and reports
what was refused, and whether Ray was started (``setup`` must refuse before it touches Ray).

Prints one JSON line (the last line of stdout).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def main() -> dict[str, Any]:
    os.environ["RLIX_CONTROL_PLANE"] = "rlix"
    from rlix_plugins import activation

    activated = activation.activate()

    import ray

    # As examples/run_grpo.py imports it: at module level, after `import nemo_rl` fired the hook.
    from nemo_rl.algorithms.grpo import MasterConfig, setup
    from nemo_rl.utils.config import (
        load_config,
        parse_hydra_overrides,
        register_omegaconf_resolvers,
    )
    from omegaconf import OmegaConf

    from rlix_plugins.adapters.nemo_rl_support import unsupported_settings
    from rlix_plugins.errors import UnsupportedJobError
    from rlix_plugins.gates.gpu_mode import GpuGateOptions, load_jobs

    src = Path(os.environ["NEMO_RL_SRC"])
    register_omegaconf_resolvers()

    def master(base: str, overrides: list[str]) -> Any:
        cfg = load_config(str(src / base))
        if overrides:
            cfg = parse_hydra_overrides(cfg, overrides)
        return MasterConfig(**OmegaConf.to_container(cfg, resolve=True))

    refused: list[str] | None = None
    message = ""
    try:
        setup(master("examples/configs/grpo_math_1B.yaml", []), None, None, None)
    except UnsupportedJobError as error:
        refused = [p.key for p in error.problems]
        message = str(error)

    gate_jobs: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as out:
        for gate in (1, 2, 3):
            for job in load_jobs(GpuGateOptions(gate=gate, out_dir=Path(out)), exclusive=False):
                cmd = list(job.command)
                if "examples/run_grpo.py" not in cmd:
                    continue  # gate 3's ROLL job
                at = cmd.index("--config")
                config = master(cmd[at + 1], cmd[at + 2:])
                gate_jobs[f"gate{gate}:{job.name}"] = [p.key for p in unsupported_settings(config)]
    megatron = master("examples/configs/grpo_math_1B_megatron.yaml", [])
    return {
        "python": ".".join(map(str, sys.version_info[:3])),
        "activated": activated,
        "setup_is_wrapped": getattr(setup, "__wrapped__", None) is not None,
        "default_refused": refused,
        "default_message": message,
        "megatron_example": [p.key for p in unsupported_settings(megatron)],
        "gate_jobs": gate_jobs,
        "ray_initialized": ray.is_initialized(),
    }


if __name__ == "__main__":
    print(json.dumps(main()))

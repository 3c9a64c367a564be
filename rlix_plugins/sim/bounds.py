"""A lower bound on a workload's makespan that no schedule can beat (a relaxation).

Two relaxations, each valid for every deployment (exclusive, RLix, ours, any other):

* **work**: every GPU-second of compute the jobs need, spread perfectly over the shared
  cluster: generation at full rank saturation (a rank of ``tp`` GPUs finishes at most
  ``n_sat`` solo-seconds of trajectory work per second) plus the training compute (old/ref
  log-probs and update on the job's training GPUs). No switch cost, re-prefill, weight sync,
  queueing or idle GPU is charged.
* **critical path**: one job's chain of dependencies with unlimited GPUs: step ``s``'s
  trajectories start at the job's arrival or once the weights of step ``s - max_age - 1`` are
  trained (the staleness bound), the step ends when its longest trajectory ends (running alone
  at full speed), and training is one step after another.

The trajectory lengths are the ones the simulator draws (``job_rng``: the same stream, the same
order), so the bound is for the exact run a seed produces. The gap between a deployment's
makespan and the bound is what scheduling, switch costs and the long tail cost together: it is
a yardstick, not a target (the tail of the last steps cannot be packed by any scheduler that
does not know trajectory lengths in advance).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlix_plugins.sim.workloads import JobSpec, Workload, job_rng


@dataclass(frozen=True, slots=True)
class MakespanBound:
    """Both relaxations of one workload on one seed (seconds of virtual time)."""

    work_s: float
    critical_path_s: float
    #: the job whose critical path is the longest
    critical_job: str

    @property
    def makespan_s(self) -> float:
        """The bound: no schedule finishes every job sooner."""
        return max(self.work_s, self.critical_path_s)


def _job_bounds(job: JobSpec, seed: int) -> tuple[float, float]:
    """(GPU-seconds of compute, end of the job's critical path) for one job."""
    rng = job_rng(seed, job.name)
    p = job.phases
    train_s = p.old_log_probs_s + p.ref_log_probs_s + p.update_actor_s
    gpu_s = 0.0
    trained: list[float] = []  # end of training of each step
    for step in range(job.steps):
        lengths = job.lengths.sample(rng, job.batch)
        gpu_s += sum(lengths) * job.infer_tp / job.n_sat + job.train_gpus * train_s
        gate = step - job.max_age - 1
        start = job.arrival_s if gate < 0 else trained[gate]
        generated = start + max(lengths)
        trained.append(max(trained[-1] if trained else 0.0, generated) + train_s)
    return gpu_s, trained[-1]


def makespan_lower_bound(workload: Workload, seed: int) -> MakespanBound:
    """The makespan no deployment of ``workload`` on its shared cluster can beat at ``seed``."""
    gpus = workload.shared_nodes * workload.gpus_per_node
    work = 0.0
    paths: dict[str, float] = {}
    for job in workload.jobs:
        gpu_s, end = _job_bounds(job, seed)
        work += gpu_s
        paths[job.name] = end
    critical = max(paths, key=lambda name: paths[name])
    return MakespanBound(work_s=work / gpus, critical_path_s=paths[critical], critical_job=critical)

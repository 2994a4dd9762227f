"""`megatron-rl slurm submit`: a recipe's RL run as a Slurm job (slurm/train.sbatch).

The job is rendered from the recipe: `#SBATCH` lines for the nodes asked for, the CPUs and
GPUs per node the recipe's Ray bundles need (trainer ranks, engines, aux pools, spread over the
nodes), the time limit, partition, account and a pyxis container image; then the recipe and
its overrides as the script's arguments, and train.sbatch's body (Ray head and workers, the
driver, the shutdown). `--dry-run` prints the script; otherwise it is written next to the run's
output and submitted, and the `sbatch` command line is printed first.
"""

from __future__ import annotations

import math
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.config.schema import Config

SLURM_DIR = Path(__file__).resolve().parents[1] / "slurm"


@dataclass
class JobSpec:
    """What one `megatron-rl slurm submit` asks Slurm for."""

    recipe: str
    overrides: list[str]
    nodes: int
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    container: str | None = None
    container_mounts: str | None = None
    cpus_per_node: int | None = None   # None: what the recipe's bundles need per node
    gpus_per_node: int | None = None   # None: likewise
    job_name: str | None = None
    python: str = sys.executable
    workdir: str | None = None
    object_store_mb: int | None = None


def bundle_needs(cfg: Config) -> tuple[float, int]:
    """(CPUs, GPUs) of all the run's Ray bundles: trainer ranks, disaggregated engines, aux
    pools (the same requests `ray_placement.place` makes)."""
    ro = cfg.rollout
    cpus = ro.trainer_ranks * ro.trainer_cpus
    gpus = ro.trainer_ranks * ro.trainer_gpus
    if ro.layout == "disaggregated":
        cpus += ro.num_engines * ro.engine_cpus
        gpus += ro.num_engines * ro.engine_gpus
    for pool in ro.aux_pools.values():
        cpus += pool.num_engines * pool.engine_cpus
        gpus += pool.num_engines * pool.engine_gpus
    return cpus, gpus


def per_node(cfg: Config, job: JobSpec) -> tuple[int, int]:
    """(CPUs, GPUs) per node: the options, else the recipe's bundles over `job.nodes` nodes
    (STRICT_SPREAD puts one trainer rank on each node, so a node holds at least a bundle)."""
    cpus, gpus = bundle_needs(cfg)
    ro = cfg.rollout
    need_cpu = max(math.ceil(cpus / job.nodes), math.ceil(ro.trainer_cpus), 1)
    need_gpu = max(math.ceil(gpus / job.nodes), ro.trainer_gpus) if gpus else 0
    return (job.cpus_per_node if job.cpus_per_node is not None else need_cpu,
            job.gpus_per_node if job.gpus_per_node is not None else need_gpu)


def _body(template: Path) -> str:
    """The script after its shebang and its own `#SBATCH` defaults."""
    lines = template.read_text().splitlines()
    keep = [x for i, x in enumerate(lines) if not (i == 0 and x.startswith("#!"))
            and not x.startswith("#SBATCH")]
    return "\n".join(keep) + "\n"


def render_train(cfg: Config, job: JobSpec, log_dir: Path) -> str:
    """The sbatch script for `job` on the recipe `cfg` (loaded from job.recipe/overrides)."""
    cpus, gpus = per_node(cfg, job)
    name = job.job_name or f"mrl-{Path(job.recipe).stem}"
    sb = [f"--job-name={name}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
          f"--cpus-per-task={cpus}", f"--time={job.time}",
          f"--output={log_dir}/%x-%j.out"]
    if gpus:
        sb.append(f"--gpus-per-node={gpus}")
    if job.partition:
        sb.append(f"--partition={job.partition}")
    if job.account:
        sb.append(f"--account={job.account}")
    env = {"MRL_PYTHON": "python" if job.container else job.python,
           "MRL_WORKDIR": job.workdir or str(Path.cwd())}
    if job.container:
        # pyxis: the Ray steps and the driver run in the image (srun --container-image)
        env["MRL_CONTAINER_IMAGE"] = job.container
        if job.container_mounts:
            env["MRL_CONTAINER_MOUNTS"] = job.container_mounts
    if job.object_store_mb:
        env["MRL_RAY_OBJECT_STORE_MB"] = str(job.object_store_mb)
    head = ["#!/bin/bash", *(f"#SBATCH {x}" for x in sb),
            f"# rendered by `megatron-rl slurm submit` from {job.recipe}: "
            f"{cfg.rollout.trainer_ranks} trainer rank(s) x {cfg.rollout.trainer_cpus:g} CPU / "
            f"{cfg.rollout.trainer_gpus} GPU, {cfg.rollout.num_engines} engine(s) "
            f"{cfg.rollout.layout}, placement {cfg.rollout.placement_strategy}",
            *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
            "set -- " + " ".join(shlex.quote(a) for a in [job.recipe, *job.overrides])]
    return "\n".join(head) + "\n" + _body(SLURM_DIR / "train.sbatch")


def submit(cfg: Config, job: JobSpec, *, dry_run: bool = False, wait: bool = False) -> int:
    """Render, then print (dry run) or write, print the sbatch command and run it; returns
    sbatch's exit code (with `wait`, the job's)."""
    out = Path(cfg.train.output_dir).resolve()
    log_dir = out / "slurm"
    script = render_train(cfg, job, log_dir)
    if dry_run:
        print(script, end="")
        return 0
    log_dir.mkdir(parents=True, exist_ok=True)  # sbatch does not create --output's folder
    path = log_dir / f"{job.job_name or 'train'}.sbatch"
    path.write_text(script)
    cmd = ["sbatch", *(["--wait"] if wait else []), str(path)]
    print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    return subprocess.run(cmd, check=False).returncode

"""Slurm: `megatron-rl slurm submit` renders slurm/train.sbatch from a recipe, and the project's
own sbatch scripts run on a real Slurm (Debian's slurmctld + two `slurmd -N` nodes n1/n2 at
127.0.0.11/12, in a private network namespace: tools/slurm_up.sh, installed with apt when
missing). The RL sanity recipe runs with one trainer rank and one engine on each node
(STRICT_SPREAD) and must learn; then convert.sbatch exports the run's checkpoint to HF."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MRL = [sys.executable, "-m", "megatron_rl.cli"]
# the sanity recipe with both trainer ranks and both engines spread over the two nodes
STEPS = 12
RUN = [f"train.steps={STEPS}", "rl.eval_every=0", "rollout.num_engines=2",
       "rollout.placement_strategy=STRICT_SPREAD"]


def test_submit_dry_run_renders_the_recipe_resources():
    out = subprocess.run(
        [*MRL, "slurm", "submit", "--recipe", "tiny-moe-rl-sanity-cpu", "--nodes", "2",
         "--partition", "batch", "--account", "proj", "--time", "00:30:00",
         "--container", "nvcr.io/nvidia/pytorch:25.01-py3", "--dry-run",
         "rollout.trainer_gpus=4", "rollout.engine_gpus=4", "rollout.trainer_ranks=4"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout
    head = [x for x in out.splitlines() if x.startswith("#SBATCH")]
    # 4 ranks x 4 GPUs over 2 nodes = 8 GPUs and 2 CPUs a node; colocated engines add none
    assert head == ["#SBATCH --job-name=mrl-tiny-moe-rl-sanity-cpu", "#SBATCH --nodes=2",
                    "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=2",
                    "#SBATCH --time=00:30:00",
                    f"#SBATCH --output={ROOT}/runs/rl-sanity/slurm/%x-%j.out",
                    "#SBATCH --gpus-per-node=8", "#SBATCH --partition=batch",
                    "#SBATCH --account=proj"]
    assert "export MRL_CONTAINER_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3" in out
    assert "export MRL_PYTHON=python" in out  # the image's interpreter
    assert ("set -- tiny-moe-rl-sanity-cpu rollout.trainer_gpus=4 rollout.engine_gpus=4 "
            "rollout.trainer_ranks=4") in out
    assert "rollout.trainer_launcher=ray" in out
    code = [x.split("#")[0] for x in out.splitlines()]  # never `ray stop`: it kills every Ray
    assert not [x for x in code if re.search(r"(\bray|\$RAY\"?)\s+stop\b", x)]
    check = subprocess.run(["bash", "-n"], input=out, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr


def test_submit_rejects_a_bad_recipe_before_slurm():
    r = subprocess.run([*MRL, "slurm", "submit", "--recipe", "tiny-moe-rl-sanity-cpu",
                        "--nodes", "2", "--dry-run", "rollout.layout=sideways"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "rollout.layout" in r.stderr and not r.stdout


# -- a real two-node Slurm ---------------------------------------------------------------------


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (slurmd, munge and a network namespace)"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        return "Slurm is not installed and there is no apt-get to install it"
    return None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """Slurm with nodes n1, n2 in a private netns, up for this module only; yields the env
    whose PATH has its sbatch/srun/scontrol wrappers."""
    if why := _why_not():
        pytest.skip(why)
    # not under pytest's 0700 tmp root: munged runs as user munge and must reach its files
    d = Path(tempfile.mkdtemp(prefix="mrl-slurm-"))
    d.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    env.update(MRL_SLURM_DIR=str(d), NODES="2", NETNS=f"mrl{os.getpid()}")
    t0 = time.monotonic()
    up = subprocess.run([str(ROOT / "tools/slurm_up.sh")], env=env, capture_output=True,
                        text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        print(f"\n[slurm] up in {time.monotonic() - t0:.1f}s\n{up.stdout}")
        yield {**env, "PATH": f"{d}/bin:{env['PATH']}"}
    finally:
        down = subprocess.run([str(ROOT / "tools/slurm_down.sh"), "--purge"], env=env,
                              capture_output=True, text=True, timeout=300)
        print(f"[slurm] {down.stdout.strip()}")
        shutil.rmtree(d, ignore_errors=True)


def _job(env: dict[str, str], job_id: str, timeout_s: float = 30.0) -> dict[str, str]:
    """The job's record once it has left COMPLETING (`sbatch --wait` can return while the
    nodes still run the job's epilogue)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True,
                             text=True, check=True).stdout
        job = dict(re.findall(r"(\w+)=(\S+)", out))
        if job.get("JobState") != "COMPLETING" or time.monotonic() > deadline:
            return job
        time.sleep(0.5)


def _daemons_only(env: dict[str, str], timeout_s: float = 20.0) -> list[str]:
    """What still runs in the cluster's netns besides munge and Slurm's daemons, after up to
    `timeout_s` (slurmstepd takes a moment to reap a finished job's steps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = subprocess.run(["ip", "netns", "pids", env["NETNS"]], capture_output=True,
                              text=True).stdout.split()
        left = []
        for p in pids:
            try:
                comm = Path(f"/proc/{p}/comm").read_text().strip()
            except OSError:
                continue
            if comm not in ("munged", "slurmctld", "slurmscriptd", "slurmd"):
                left.append(f"{p} {comm}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


@pytest.fixture(scope="module")
def train_job(slurm, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    t0 = time.monotonic()
    r = subprocess.run(
        [*MRL, "slurm", "submit", "--recipe", "tiny-moe-rl-sanity-cpu", "--nodes", "2",
         "--time", "00:08:00", "--object-store-mb", "300", "--wait", *RUN,
         f"train.output_dir={out}", f"checkpoint.dir={out}/ckpt"],
        cwd=ROOT, env=slurm, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    job_id = re.search(r"Submitted batch job (\d+)", r.stdout)
    assert job_id, r.stdout + r.stderr
    logs = list((out / "slurm").glob("*.out"))
    log = logs[0].read_text() if logs else ""
    print(f"\n[slurm] train job {job_id[1]}: sbatch --wait returned {r.returncode} after "
          f"{took:.1f}s\n" + "\n".join(x for x in log.splitlines() if x.startswith(
              ("[train.sbatch", "[megatron-rl]", "step ", "ray nodes"))))
    return {"rc": r.returncode, "stdout": r.stdout, "job": _job(slurm, job_id[1]),
            "log": log, "out": out, "seconds": took}


def test_train_sbatch_runs_rl_across_two_nodes_and_learns(slurm, train_job):
    job, log = train_job["job"], train_job["log"]
    assert train_job["rc"] == 0, log[-4000:]
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", job
    assert job["NodeList"] == "n[1-2]"
    assert train_job["stdout"].startswith("sbatch --wait ")  # the command it ran, first
    assert "ray nodes alive: [('n1', '127.0.0.11'), ('n2', '127.0.0.12')]" in log
    # one trainer rank and one engine on each node
    ranks = dict(re.findall(r"trainer rank (\d): host (n\d)", log))
    assert sorted(ranks.values()) == ["n1", "n2"], log[-4000:]
    engines = re.search(r"policy engines: (.*)", log)[1].split()
    assert sorted(u.split(":")[1] for u in engines) == ["//127.0.0.11", "//127.0.0.12"]
    # the sanity task: a random policy's ~0.5 share of even tokens climbs
    rows = [json.loads(x) for x in (train_job["out"] / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/outcome_mean"] for r in rows]
    assert len(rewards) == STEPS
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"[slurm] reward/outcome_mean per step: {[round(x, 3) for x in rewards]} "
          f"(first 3 {first:.3f}, last 3 {last:.3f})")
    assert first < 0.6 and last > first + 0.1, rewards
    assert "ray stopped" in log and "job end" in log
    assert _daemons_only(slurm) == []  # no Ray process of the job is left on either node


def test_convert_sbatch_exports_the_runs_checkpoint(slurm, train_job):
    out = train_job["out"]
    assert (out / "ckpt" / "latest").exists(), "the train job saved no checkpoint"
    env = {**slurm, "MRL_PYTHON": sys.executable}
    r = subprocess.run(
        ["sbatch", "--wait", "--time=00:05:00", f"--output={out}/convert-%j.out",
         str(ROOT / "slurm/convert.sbatch"), "megatron-to-hf", "--ckpt", f"{out}/ckpt",
         "--out", f"{out}/hf", "--model", "tiny-moe"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    job_id = re.search(r"Submitted batch job (\d+)", r.stdout)[1]
    log = (out / f"convert-{job_id}.out").read_text()
    assert r.returncode == 0, log
    job = _job(slurm, job_id)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", job
    print(f"\n[slurm] convert job {job_id}: {job['RunTime']} on {job['NodeList']}")
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    assert sum(p.numel() for p in model.parameters()) > 0
    assert json.loads((out / "hf" / "config.json").read_text())["model_type"] == "qwen3_moe"

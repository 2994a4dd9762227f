"""Trainer ranks as Ray actors (`rollout.trainer_launcher=ray`) on one machine: a real local Ray
on 127.0.0.1, real gloo process groups, real Megatron jobs; the preflight's failures; and no
process left behind after close, after a failing job, or when SIGTERM ends the driver."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import ray
import torch.distributed as dist

from megatron_rl.config.loader import load_config
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.distributed.ray_placement import init_ray, place
from megatron_rl.distributed.ray_trainer import RayTrainerGroup, TrainerLaunchError
from megatron_rl.distributed.spmd import RankObjects
from megatron_rl.distributed.worker_pool import WorkerError
from megatron_rl.train import train
from tests import dist_cases
from tests.pools import get_pool

# two colocated CPU trainer bundles: all this machine's 2 CPUs
RANKS = dict(ray=True, trainer_launcher="ray", trainer_ranks=2, trainer_cpus=1,
             layout="colocated")


@pytest.fixture(scope="module")
def local_ray():
    # one GPU declared on a machine that has none: the preflight must notice
    init_ray(num_cpus=2, num_gpus=1, object_store_memory=256 << 20)
    yield
    ray.shutdown()


def _group(**overrides) -> RayTrainerGroup:
    cfg = RolloutConfig(**{**RANKS, **overrides})
    return RayTrainerGroup(place(cfg), cfg, "gloo", owns_placement=True)


def _gone(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    """The pids still running (not zombies) after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in pids:
            try:
                if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _rank_and_env() -> tuple[int, int, str | None, str | None]:
    return (dist.get_rank(), dist.get_world_size(), os.environ.get("GLOO_SOCKET_IFNAME"),
            os.environ.get("NCCL_SOCKET_IFNAME"))


def _child_pid() -> int:
    """A helper process the rank starts (as megatron's checkpoint writer does)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid


def _die_on_rank_1() -> int:
    if dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank()


def test_ray_ranks_run_megatron_as_the_local_pool_does(local_ray, tmp_path):
    """The same 3 steps of EP2 Megatron training on 2 Ray actors and on 2 spawned ranks: the
    same losses and grad norms, bit for bit."""
    run = ["parallel.ep=2", "train.steps=3", "checkpoint.dir=null"]
    with _group() as group:
        assert group.world_size == 2 and group.alive
        assert group.run(_rank_and_env) == [(0, 2, "lo", "lo"), (1, 2, "lo", "lo")]
        assert [r["ip"] for r in group.ranks] == ["127.0.0.1"] * 2
        assert [r["iface"] for r in group.ranks] == ["lo"] * 2
        assert len({r["pid"] for r in group.ranks}) == 2
        on_ray = group.run(dist_cases.lm_run, [*run, f"train.output_dir={tmp_path}/ray"])
        with pytest.raises(WorkerError, match=r"(?s)rank 1 on .*deliberate failure on rank 1"):
            group.run(dist_cases.rank_of_failure, 1)
        assert group.alive  # a job that raised everywhere it failed leaves the group usable
    local = get_pool(2).run(dist_cases.lm_run, [*run, f"train.output_dir={tmp_path}/pool"])
    assert len(on_ray[0]) == 3
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in on_ray[0]] == [r[key] for r in local[0]], key
    assert [r["loss"] for r in on_ray[0]] == [r["loss"] for r in on_ray[1]]  # one DP loss


def test_rl_steps_on_ray_ranks_with_colocated_engines(local_ray, tmp_path):
    """`train` with Ray trainer ranks: the engine goes into the ranks' own placement group
    (colocated in rank 0's bundle) and serves the weights synced before each step."""
    cfg = load_config("tiny-moe-rl-sanity-cpu", [
        "train.steps=2", "rl.eval_every=0", f"train.output_dir={tmp_path}",
        "rollout.ray=true", "rollout.trainer_launcher=ray", "rollout.max_restarts=0"])
    with RayTrainerGroup(place(cfg.rollout), cfg.rollout, "gloo", owns_placement=True) as group:
        pg = group.placement.trainer_pg
        rows = train(cfg, group)
        # the engines were closed but the ranks' placement group is still theirs
        assert ray.util.placement_group_table(pg)["state"] == "CREATED"
        assert group.alive
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    assert len(rows) == 2 and rows[-1]["sync/mb"] > 0
    assert all(0.0 <= r["reward/outcome_mean"] <= 1.0 for r in rows)
    trajs = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 2 * 2 * 8
    for t in trajs:
        assert {v for turn in t["turns"] for v in turn["weight_versions"]} == {t["step"] - 1}


def test_a_missing_interface_fails_the_preflight_naming_the_rank(local_ray):
    t0 = time.monotonic()
    with pytest.raises(TrainerLaunchError) as e:
        _group(trainer_nic="nosuch0")
    msg = str(e.value)
    assert "rank 0 on " in msg and "rank 1 on " in msg and "127.0.0.1" in msg
    assert "rollout.trainer_nic='nosuch0': no interface 'nosuch0' on this node" in msg
    assert "lo" in msg.split("has: ")[1]  # the interfaces it does have
    assert time.monotonic() - t0 < 60
    # nothing of the failed bring-up holds the cluster: all CPUs are free again
    assert _free_cpus() == 2.0


def test_an_unreachable_rendezvous_fails_within_the_timeout(local_ray):
    """Rank 0 listens on its own 127.0.0.1; the ranks are told to dial 127.0.0.2, where
    nothing listens: both are named with the reason, after the 3 s preflight timeout."""
    t0 = time.monotonic()
    with pytest.raises(TrainerLaunchError) as e:
        _group(trainer_master_addr="127.0.0.2", preflight_timeout_s=3.0)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "the rendezvous 127.0.0.2:" in msg and "unreachable within 3 s" in msg, msg
    assert "rank 0 on " in msg and "rank 1 on " in msg and "ConnectionRefusedError" in msg
    assert "rank 0 listens on 127.0.0.1:" in msg
    assert took < 40, took  # actors' start + 3 s, not the 30-minute collective timeout
    assert _free_cpus() == 2.0


def test_a_missing_gpu_fails_the_preflight(local_ray):
    """Ray was told this node has a GPU; the rank's torch sees none."""
    with pytest.raises(TrainerLaunchError,
                       match=r"rank 0 on .*: sees 0 GPU\(s\) \(CUDA_VISIBLE_DEVICES=0\), "
                             r"rollout.trainer_gpus=1 needed"):
        _group(trainer_ranks=1, trainer_gpus=1, layout="disaggregated")


def _free_cpus(timeout_s: float = 20.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (free := ray.available_resources().get("CPU", 0.0)) < 2.0 \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    return free


def test_no_process_outlives_close_or_a_failing_job(local_ray):
    group = _group()
    pids = [r["pid"] for r in group.ranks]
    helper = group.run(_child_pid)  # each rank's own child process
    objects = RankObjects(group, dict)  # objects on the ranks go with the group
    group.close()
    objects.close()  # a closed group has nothing left to drop
    assert _gone(pids + helper) == []
    assert _free_cpus() == 2.0
    with pytest.raises(WorkerError, match="closed"):
        group.run(_rank_and_env)

    group = _group()
    pids = [r["pid"] for r in group.ranks]
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"(?s)rank 1 on .*the rank's process died"):
        group.run(_die_on_rank_1)
    assert time.monotonic() - t0 < 60
    assert not group.alive  # a dead rank closes the group: the others go too
    assert _gone(pids) == []
    assert _free_cpus() == 2.0


DRIVER = textwrap.dedent("""
    import sys, time
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.distributed.ray_trainer import ray_trainer_ranks
    cfg = RolloutConfig(ray=True, trainer_launcher="ray", trainer_ranks=2, trainer_cpus=1,
                        layout="colocated")
    with ray_trainer_ranks(cfg, "gloo") as group:
        print("PIDS", *[r["pid"] for r in group.ranks], flush=True)
        time.sleep(600)
""")


def test_sigterm_to_the_driver_leaves_no_process_behind(tmp_path):
    """A driver with its own local Ray and two ranks, ended by SIGTERM: it exits on its own
    and every process it started (Ray's included) is gone."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = ""
        deadline = time.monotonic() + 180
        while not line.startswith("PIDS") and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "driver exited early"
        ranks = [int(p) for p in line.split()[1:]]
        assert len(ranks) == 2
        started = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert set(ranks) <= set(started)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=90)
        # exited through the group's SystemExit, unwinding: not killed by the signal (-15),
        # nor aborted by the crash handler of Ray's C++ core (-6)
        assert rc == 128 + signal.SIGTERM, rc
        assert _gone(started, timeout_s=30) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

"""`megatron-rl train` with `rollout.ray`: the engine is a Ray-placed, supervised process
(`launch_rollout`), not a thread of the driver; weights reach it over HTTP after every update."""

from __future__ import annotations

import json

from megatron_rl.config.loader import load_config
from megatron_rl.train import train
from tests.pools import get_pool
from tests.test_train_rl import BASE


def test_rl_loop_with_a_ray_placed_engine_process(tmp_path):
    cfg = load_config("tiny-moe-rl-cpu", [
        *BASE, "parallel.ep=1", f"train.output_dir={tmp_path}", "checkpoint.dir=null",
        "rollout.ray=true", "rollout.layout=disaggregated", "rollout.trainer_ranks=1",
        "rollout.trainer_cpus=1", "rollout.engine_cpus=1", "rollout.max_restarts=1"])
    rows = train(cfg, get_pool(1))
    assert len(rows) == 2 and "time/generate" not in rows[0]  # not an in-process engine
    assert rows[-1]["sync/mb"] > 0
    trajs = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 2 * 2 * 2
    for t in trajs:  # the engine process served the weights synced before each step
        assert {v for turn in t["turns"] for v in turn["weight_versions"]} == {t["step"] - 1}
    import ray
    assert not ray.is_initialized()  # the driver stops the Ray it started

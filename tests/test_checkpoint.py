"""Training checkpoints: exact resume, resharding, and loud failure on damaged folders."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_rl.checkpoint.training_checkpoint import MANIFEST
from megatron_rl.distributed.worker_pool import WorkerError
from tests import dist_cases
from tests.pools import get_pool

RUN = ["train.steps=6", "optim.lr=1e-2", "train.global_batch_size=4"]


def _losses(rows):
    return [r["loss"] for r in rows]


@pytest.mark.parametrize("world,layout", [(1, []), (2, ["parallel.ep=2",
                                                         "parallel.distributed_optimizer=true"])])
def test_resume_after_kill_is_bit_identical(tmp_path, world, layout):
    """Steps 4-6 after a restart from the step-3 checkpoint equal an uninterrupted run exactly."""
    pool = get_pool(world)
    straight = pool.run(dist_cases.lm_run, RUN + layout + [f"train.output_dir={tmp_path}/a"])[0]
    ckpt = tmp_path / "ckpt"
    common = RUN + layout + [f"checkpoint.dir={ckpt}", "checkpoint.save_every=3",
                             f"train.output_dir={tmp_path}/b"]
    first = pool.run(dist_cases.lm_run, common, stop_after=3)[0]  # "killed" after step 3
    assert (ckpt / "latest").read_text() == "step_000003"
    resumed = pool.run(dist_cases.lm_run, [*common, "checkpoint.load=latest"])[0]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert _losses(first) == _losses(straight)[:3]
    assert _losses(resumed) == _losses(straight)[3:], (_losses(resumed), _losses(straight))
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in straight[3:]]
    assert _losses(straight)[-1] < _losses(straight)[0]  # and it trains
    # metrics.jsonl of the resumed run continues the interrupted one
    lines = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5, 6]


def test_a_run_that_stops_before_its_decay_ends_trains_as_the_longer_run_began(tmp_path):
    """`optim.lr_decay_steps`: 3 steps of a 6-step cosine schedule are the first 3 steps of the
    6-step run (LR and losses), and stop at a higher LR than a 3-step schedule."""
    pool = get_pool(1)
    cosine = [*RUN, "optim.lr_decay_style=cosine", "optim.min_lr=1e-5"]
    long = pool.run(dist_cases.lm_run, [*cosine, f"train.output_dir={tmp_path}/a"])[0]
    cut = pool.run(dist_cases.lm_run, [*cosine, "train.steps=3", "optim.lr_decay_steps=6",
                                       f"train.output_dir={tmp_path}/b"])[0]
    short = pool.run(dist_cases.lm_run, [*cosine, "train.steps=3",
                                         f"train.output_dir={tmp_path}/c"])[0]
    assert len(long) == 6 and len(cut) == len(short) == 3
    assert [r["lr"] for r in cut] == [r["lr"] for r in long[:3]]
    assert _losses(cut) == _losses(long)[:3]
    assert cut[-1]["lr"] > short[-1]["lr"]


def test_a_save_starts_no_process(tmp_path):
    """The first save of a rank used to spawn megatron's results Manager (~5 s, each rank)."""
    assert get_pool(1).run(dist_cases.save_and_list_children, str(tmp_path / "c"))[0] == []
    assert (tmp_path / "c" / "step_000000" / MANIFEST).is_file()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    get_pool(1).run(dist_cases.save_initial, str(root / "good"))
    return root / "good" / "step_000000"


def _copy(saved, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(saved, target)
    return target


def _load_error(folder) -> str:
    with pytest.raises(WorkerError) as info:
        get_pool(1).run(dist_cases.full_parameters, str(folder))
    return str(info.value)


def test_truncated_file_is_named(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    victim = next(folder.glob("*.distcp"))
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    msg = _load_error(folder)
    assert "CheckpointError" in msg and victim.name in msg and "truncated" in msg


def test_flipped_bytes_fail_the_checksum(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    victim = next(folder.glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    msg = _load_error(folder)
    assert victim.name in msg and "crc32" in msg and "corrupt" in msg


def test_missing_file_and_missing_manifest(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    (folder / "metadata.json").unlink()
    assert "metadata.json: missing" in _load_error(folder)
    folder2 = _copy(saved, tmp_path / "x")
    (folder2 / MANIFEST).unlink()
    assert "save was interrupted" in _load_error(folder2)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    assert "not a checkpoint folder" in _load_error(tmp_path)
    assert "checkpoint folder not found" in _load_error(tmp_path / "nope")


def test_interrupted_save_leaves_latest_untouched(saved, tmp_path):
    """A save that died before its rename is a .tmp- folder: `latest` still names the old one."""
    run = tmp_path / "run"
    shutil.copytree(saved, run / "step_000000")
    (run / "latest").write_text("step_000000")
    partial = run / ".tmp-step_000005"
    shutil.copytree(saved, partial)
    (partial / MANIFEST).unlink()
    params = get_pool(1).run(dist_cases.full_parameters, str(run))[0]  # resolves `latest`
    assert params


def test_checkpoint_of_another_model_is_refused(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["model"] = "qwen3-8b"
    (folder / MANIFEST).write_text(json.dumps(manifest))
    assert "holds model 'qwen3-8b'" in _load_error(folder)


def test_checkpoint_before_the_first_optimizer_step_loads(tmp_path):
    """An RL run whose first steps trained nothing (every trajectory excluded) saves a
    checkpoint with no Adam moments yet; it must load, optimizer requested or not."""
    get_pool(1).run(dist_cases.save_initial, str(tmp_path / "ckpt"))
    got = get_pool(1).run(dist_cases.resume_and_step, [], str(tmp_path / "ckpt"))[0]
    assert got["loss2"] > 0 and got["grad_norm2"] > 0


def test_the_actors_adam_runs_its_foreach_form_bit_for_bit(tmp_path):
    got = get_pool(1).run(dist_cases.foreach_adam_against_loop, str(tmp_path / "ckpt"))[0]
    assert got["built"] and all(got["built"]) and all(got["loaded"]), got
    assert got["same"] and got["moved"] > 10, got


@pytest.mark.parametrize("layout", [["optim.clip_grad=1.0"],
                                    ["parallel.ep=2", "parallel.distributed_optimizer=true"]])
def test_a_step_with_a_non_finite_gradient_is_skipped_on_every_rank(layout):
    """NaN on one rank's loss reaches every rank's gradient norm: no rank updates (an update
    would write NaN into every weight), all report it, and the next step trains."""
    out = get_pool(2).run(dist_cases.non_finite_step, layout, 1)
    for rank in out:
        assert rank["bad"]["skipped"] == 1.0 and rank["unchanged"], rank["bad"]
        assert rank["bad"]["grad_norm"] != rank["bad"]["grad_norm"]  # NaN
        assert rank["good"]["skipped"] == 0.0 and rank["good"]["grad_norm"] > 0
        assert rank["finite"] and rank["moved"] > 10 and rank["optimizer_steps"] == 1, rank

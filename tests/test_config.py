from __future__ import annotations

import re
import subprocess
import sys

import pytest

from megatron_rl.config.loader import CONFIG_ROOT, ConfigError, load_config, parse_overrides
from megatron_rl.config.schema import Config


def test_recipe_and_overrides_resolve_with_types():
    cfg = load_config("tiny-moe-cpu", ["optim.lr=3e-4", "parallel.tp=2", "train.steps=7",
                                       "parallel.sp=false", "checkpoint.dir=null"])
    assert isinstance(cfg, Config)
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.parallel.tp == 2 and cfg.parallel.ep == 2  # recipe value kept
    assert cfg.parallel.sequence_parallel is False
    assert cfg.train.steps == 7
    assert cfg.checkpoint.dir is None
    assert load_config("tiny-moe-cpu").optim.lr == pytest.approx(1e-2)


def test_sequence_parallel_defaults_on_with_tp():
    assert load_config(None, ["parallel.tp=2"]).parallel.sequence_parallel is True
    assert load_config(None, []).parallel.sequence_parallel is False


@pytest.mark.parametrize("override,message", [
    ("train.lr=1", "unknown config key 'train.lr' (did you mean 'optim.lr'?)"),
    ("optim.lrr=1", "(did you mean 'optim.lr'?)"),
    ("paralel.tp=2", "(did you mean 'parallel'?)"),
    ("parallel.tp=0", "parallel.tp=0: must be >= 1"),
    ("parallel.tp=two", "parallel.tp='two': expected an integer"),
    ("optim.lr=-1", "optim.lr=-1.0: must be > 0"),
    ("model.dtype=fp8", "model.dtype='fp8': must be one of ['fp32', 'bf16', 'fp16']"),
    ("parallel.distributed_optimizer=1", "expected true or false"),
    ("train.global_batch_size=6", "train.global_batch_size=6 is not a multiple of "
                                  "train.micro_batch_size=4"),
    ("nonsense", "must look like section.key=value"),
])
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.micro_batch_size=4", "train.global_batch_size=8", override])
    assert message in str(info.value)


def test_unknown_recipe_suggests_closest():
    with pytest.raises(ConfigError, match="did you mean 'tiny-moe-cpu'"):
        load_config("tiny-moe-cp")


def test_bad_yaml_file_names_the_file(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("optim: {lr: [\n")
    with pytest.raises(ConfigError, match="r.yaml: not valid YAML"):
        load_config(str(bad))
    bad.write_text("optim:\n  warmup: 3\n")
    with pytest.raises(ConfigError, match="optim.warmup.*did you mean 'optim.warmup_steps'"):
        load_config(str(bad))


def test_yaml_scientific_notation_is_a_float():
    assert parse_overrides(["optim.lr=1e-6"]) == {"optim": {"lr": "1e-6"}}  # YAML 1.1 quirk
    assert load_config(None, ["optim.lr=1e-6"]).optim.lr == pytest.approx(1e-6)


def test_shared_prefixes_need_packed_rows():
    with pytest.raises(ConfigError, match="train.share_prefixes: needs train.pack_sequences"):
        load_config(None, ["train.share_prefixes=true"])
    cfg = load_config(None, ["train.share_prefixes=true", "train.pack_sequences=true"])
    assert cfg.train.share_prefixes and cfg.train.pack_sequences


def test_cli_config_show(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "config", "show",
                          "tiny-moe-cpu", "optim.lr=5e-3", "parallel.pp=2"],
                         capture_output=True, text=True, check=True).stdout
    assert "lr: 0.005" in out and "pp: 2" in out and "name: tiny-moe" in out
    bad = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "config", "show",
                          "tiny-moe-cpu", "train.lr=1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "did you mean 'optim.lr'" in bad.stderr


@pytest.mark.parametrize("override", ["optim.lr=nan", "optim.lr=.inf", "rl.temperature=nan",
                                      "rl.loss.clip_ratio_high=1e999", "train.seed=.nan",
                                      "rl.tis.threshold=-.inf"])
def test_non_finite_numbers_are_refused(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}=.*(finite|integer)"):
        load_config("tiny-moe-rl-cpu", [override])


def test_yaml_tags_that_build_objects_are_refused(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(ConfigError, match=r"override 'train.output_dir=!!python.*not valid YAML"):
        load_config("tiny-moe-cpu", [f"train.output_dir=!!python/object/apply:os.system "
                                     f"['touch {marker}']"])
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(f"train:\n  output_dir: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(recipe))}: not valid YAML"):
        load_config(str(recipe))
    assert not marker.exists()


def test_non_utf8_recipe_and_duplicate_keys_name_the_file(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("train:\n  output_dir: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"{re.escape(str(bad))}: not UTF-8 text \(byte 24\)"):
        load_config(str(bad))
    dup = tmp_path / "dup.yaml"
    dup.write_text("optim:\n  lr: 1.0e-3\n  lr: 1.0e-6\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(dup))}: .*duplicate key 'lr'"):
        load_config(str(dup))
    # the same key in two different mappings is fine
    ok = tmp_path / "ok.yaml"
    ok.write_text("optim:\n  lr: 1.0e-3\ntrain:\n  seed: 3\n")
    assert load_config(str(ok)).optim.lr == 1e-3


@pytest.mark.parametrize("yaml_text,expected", [
    ("{[1]: 2}", "found unhashable key"), ("{? {a: 1} : 2}", "found unhashable key"),
    ("[" * 20_000, "nested too deeply"), ("{a: " * 5_000 + "1" + "}" * 5_000, "nested too deeply"),
])
def test_unhashable_keys_and_deep_nesting_name_the_override_and_the_file(tmp_path, yaml_text,
                                                                        expected):
    with pytest.raises(ConfigError, match=rf"override 'rl.judge=.*not valid YAML: {expected}"):
        load_config(None, [f"rl.judge={yaml_text}"])
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(f"rl:\n  judge: {yaml_text}\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(recipe))}: not valid YAML: {expected}"):
        load_config(str(recipe))
    block = tmp_path / "block.yaml"  # the block form `? [a]` of an unhashable key
    block.write_text("rl:\n  judge:\n    ? [a]\n    : 1\n")
    with pytest.raises(ConfigError,
                       match=rf"{re.escape(str(block))}: not valid YAML: found unhashable"):
        load_config(str(block))


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (CONFIG_ROOT / "recipes").glob("*.yaml")))
def test_every_recipe_loads(recipe):
    import megatron_rl.tasks  # noqa: F401  (registry fields checked against every registry)

    load_config(recipe)


def test_the_seeds_recipes_carry_their_numbers():
    s1, s2 = load_config("literesearcher-stage1"), load_config("literesearcher-stage2")
    assert (s1.model.name, s1.rl.sampling.groups_per_step, s1.rl.sampling.samples_per_prompt,
            s1.rl.max_turns, s1.rl.temperature) == ("qwen3-4b", 256, 8, 40, 0.7)
    assert (s1.rl.loss.clip_ratio_low, s1.rl.loss.clip_ratio_high, s1.rl.loss.kl_coef,
            s1.rl.loss.entropy_coef) == (0.2, 0.4, 0.0, 0.0)
    assert (s1.rl.tis.level, s1.rl.tis.mode, s1.rl.tis.threshold) == ("token", "truncate", 2.0)
    assert s1.rollout.trainer_ranks * s1.rollout.trainer_gpus == 8           # 1 node x 8
    assert (s2.rl.sampling.groups_per_step, s2.rl.max_turns, s2.rl.temperature) == (128, 60, 1.0)
    assert s2.rollout.trainer_ranks == 16                                     # 2 nodes x 8
    assert s2.checkpoint.init_from == s1.checkpoint.dir                       # from stage 1
    assert s2.model.seq_length - s1.model.seq_length == 16384                 # 32k -> 48k
    it = load_config("itersynth-rdpo")
    assert (it.model.name, it.rl.reward_manager, it.rl.agent) == ("qwen3-8b", "rdpo", "itersynth")
    assert (it.rl.sampling.groups_per_step, it.rl.sampling.samples_per_prompt) == (16, 8)
    assert it.model.seq_length == 24576 + 8192 and it.rl.max_new_tokens == 8192

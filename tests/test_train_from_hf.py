"""A run that starts from an HF folder: its KL reference is those weights (not the random init
the actor is built with), also after a resume; `checkpoint.export_hf_every` writes an HF folder
every N steps whatever `checkpoint.save_every`."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
from megatron_rl.checkpoint.training_checkpoint import load_checkpoint
from megatron_rl.config.loader import load_config
from megatron_rl.models.registry import get_model_spec
from megatron_rl.train import train
from megatron_rl.trainer.actor import MegatronActor
from megatron_rl.trainer.hf_weights import checkpoint_due
from megatron_rl.trainer.worker import TrainerWorker
from tests.conversion_cases import save_random_hf
from tests.pools import get_pool

BASE = ["train.steps=2", "rl.world_docs=60", "rl.sampling.samples_per_prompt=2",
        "rl.sampling.groups_per_step=2", "rl.max_turns=2", "rl.max_new_tokens=16",
        "rl.sampling.oversample=1.0", "rl.sampling.partial_rollout=false", "rl.eval_every=0",
        "parallel.ep=1", "rl.loss.kl_coef=0.1", "rl.loss.entropy_coef=0.01"]


def _hf_folder(root: Path) -> Path:
    folder = root / "hf-tiny-moe"
    save_random_hf("tiny-moe", str(folder))
    tiny_qwen3_tokenizer(vocab_size=get_model_spec("tiny-moe").vocab_size).save_pretrained(folder)
    return folder


def _params(actor: MegatronActor) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in actor.parameters().items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def resumed_reference(overrides: list[str], imported: str, step: str) -> dict[str, float]:
    """Rank job: a resumed worker's reference against the imported HF weights, and its live
    weights against the checkpoint it resumed from."""
    worker = TrainerWorker(load_config("tiny-moe-rl-cpu", overrides))
    cfg = load_config("tiny-moe-rl-cpu", [o for o in overrides if "checkpoint.load" not in o])
    source = MegatronActor(cfg)
    load_checkpoint(source, imported, optimizer=False, rng=False, resume=False)
    saved = MegatronActor(cfg)
    load_checkpoint(saved, step, optimizer=False, rng=False, resume=False)
    live = _params(worker.actor)
    out = {"ref_vs_import": _max_diff(worker.reference.weights, _params(source)),
           "live_vs_saved": _max_diff(live, _params(saved)),
           "live_vs_import": _max_diff(live, _params(source)),
           "step": float(worker.progress["step"])}
    worker.close()
    return out


def test_kl_reference_is_the_hf_weights_and_exports_every_step(tmp_path):
    hf, out = _hf_folder(tmp_path), tmp_path / "run"
    args = [*BASE, f"model.hf_path={hf}", f"train.output_dir={out}",
            f"checkpoint.dir={out / 'ckpt'}", "checkpoint.save_every=0",
            "checkpoint.export_hf_every=1", "checkpoint.keep_last=1"]
    rows = train(load_config("tiny-moe-rl-cpu", args), get_pool(1))
    # step 1 trains the weights the run starts from: they are the reference
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6), rows[0]["kl"]
    assert rows[1]["kl"] > 1e-6, rows[1]["kl"]  # the policy moved, its reference did not
    # an export every step although save_every=0 (each from its step's checkpoint)
    exported = sorted(p.name for p in (out / "hf").iterdir())
    assert exported == ["step_000001", "step_000002"]
    weights = []
    for name in exported:
        model = transformers.AutoModelForCausalLM.from_pretrained(out / "hf" / name,
                                                                  local_files_only=True)
        weights.append(dict(model.named_parameters()))
        tok = transformers.AutoTokenizer.from_pretrained(out / "hf" / name, local_files_only=True)
        ids = tok("Where was it founded?", return_tensors="pt").input_ids
        assert model.generate(ids, max_new_tokens=2, do_sample=False).shape[1] == ids.shape[1] + 2
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])

    # resumed, the reference is still the HF weights, and the live weights the checkpoint's
    (imported,) = out.glob("hf_import-*")
    got = get_pool(1).run(resumed_reference, [*args, "checkpoint.load=latest"], str(imported),
                          str(out / "ckpt" / "step_000002"))[0]
    assert got["step"] == 2.0
    assert got["ref_vs_import"] == 0.0 and got["live_vs_saved"] == 0.0
    assert got["live_vs_import"] > 0.0


@pytest.mark.parametrize(("save_every", "export_every", "export_hf", "saves", "exports"), [
    (0, 3, False, [3, 6, 9, 10], [3, 6, 9]),      # exports whatever save_every; last step saved
    (4, 3, False, [3, 4, 6, 8, 9, 10], [3, 6, 9]),
    (0, 0, True, [10], [10]),
    (5, 0, False, [5, 10], []),
])
def test_exports_follow_export_hf_every_whatever_save_every(save_every, export_every, export_hf,
                                                            saves, exports):
    ck = SimpleNamespace(dir="ckpt", save_every=save_every, export_hf_every=export_every,
                         export_hf=export_hf)
    due = {s: checkpoint_due(ck, s, 10) for s in range(1, 11)}
    assert [s for s, (save, _) in due.items() if save] == saves
    assert [s for s, (_, export) in due.items() if export] == exports
    # an export is written from its step's checkpoint
    assert all(save for save, export in due.values() if export)

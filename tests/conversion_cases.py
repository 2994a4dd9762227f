"""Job bodies for conversion tests (run inside the worker pools)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.checkpoint.convert import export_hf, import_hf
from megatron_rl.checkpoint.training_checkpoint import load_checkpoint
from megatron_rl.config.loader import load_config
from megatron_rl.models.registry import get_model_spec
from megatron_rl.records.batch import TokenBatch
from megatron_rl.trainer.actor import MegatronActor

__all__ = ["export_hf", "import_hf"]


def tokens(vocab: int, rows: int = 2, seq: int = 24, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))


def save_random_hf(model_name: str, out: str, seed: int = 0) -> None:
    """A random transformers model of the registry entry; norms randomised too, so a swapped
    or missed norm cannot hide behind an all-ones initialisation. transformers has no MTP
    module, so MTP tensors (Qwen3.5) are added to the file the way released checkpoints carry
    them."""
    import transformers
    from safetensors.torch import load_file, save_file

    from megatron_rl.checkpoint.weight_map import WeightMap

    torch.manual_seed(seed)
    spec = get_model_spec(model_name)
    model = transformers.AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.05)
    model.save_pretrained(out)
    mtp = {n: s for n, s in WeightMap(spec).hf_shapes().items() if n.startswith("mtp.")}
    if mtp:
        path = f"{out}/model.safetensors"
        tensors = load_file(path)
        for name, shape in mtp.items():
            noise = torch.randn(shape)
            tensors[name] = 1 + 0.2 * noise if "norm" in name else 0.05 * noise
        save_file(tensors, path, metadata={"format": "pt"})


def hf_logits(hf_dir: str, ids: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def megatron_logits(model_name: str, ckpt: str, overrides: list[str],
                    ids: torch.Tensor) -> torch.Tensor:
    cfg = load_config(None, [f"model.name={model_name}", f"model.seq_length={ids.shape[1]}",
                             f"train.global_batch_size={ids.shape[0]}",
                             "train.micro_batch_size=1", *overrides])
    actor = MegatronActor(cfg)
    load_checkpoint(actor, ckpt, optimizer=False, rng=False)
    batch = TokenBatch(ids, ids, torch.ones_like(ids))
    return actor.compute_logits(batch)


def hf_generates(hf_dir: str) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False)
    return out[0].tolist()


def read_safetensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors

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
    from safetensors.torch import load_file, save_file

    spec = get_model_spec(model_name)
    model = _random_model(model_name, seed)
    model.save_pretrained(out)
    mtp = _random_mtp(spec)
    if mtp:
        path = f"{out}/model.safetensors"
        tensors = load_file(path)
        tensors.update(mtp)
        save_file(tensors, path, metadata={"format": "pt"})


def _random_model(model_name: str, seed: int):
    import transformers

    torch.manual_seed(seed)
    spec = get_model_spec(model_name)
    model = transformers.AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.05)
    return model


def _random_mtp(spec) -> dict[str, torch.Tensor]:
    """Per-expert MTP tensors (transformers has no MTP module), from the global RNG."""
    from megatron_rl.checkpoint.weight_map import WeightMap

    tensors = {}
    for name, shape in WeightMap(spec).hf_shapes().items():
        if name.startswith("mtp."):
            noise = torch.randn(shape)
            tensors[name] = 1 + 0.2 * noise if "norm" in name else 0.05 * noise
    return tensors


# Expert layouts of the released checkpoints: (decoder layers, MTP layer)
RELEASE_LAYOUTS = {
    "per_expert": ("per_expert", "per_expert"),  # save_pretrained, Qwen3-MoE, FP8 releases
    "qwen3.5": ("fused", "per_expert"),          # Qwen3.5 bf16: fused decoder, per-expert MTP
    "qwen3.6": ("fused", "fused"),               # Qwen3.6: MTP fused too
}


def _unfuse(tensors: dict[str, torch.Tensor], group: str) -> None:
    """transformers' in-memory experts → `save_pretrained`'s per-expert keys: gate_up_proj
    [E, 2I, H] is gate rows then up rows (Qwen3_5MoeExperts: `linear(x, gate_up_proj[e])
    .chunk(2, dim=-1)` → gate, up), down_proj [E, H, I]. Written independently of the code
    under test."""
    gate_up, down = tensors.pop(f"{group}.gate_up_proj"), tensors.pop(f"{group}.down_proj")
    i = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        tensors[f"{group}.{e}.gate_proj.weight"] = gate_up[e, :i].clone()
        tensors[f"{group}.{e}.up_proj.weight"] = gate_up[e, i:].clone()
        tensors[f"{group}.{e}.down_proj.weight"] = down[e].clone()


def _fuse(tensors: dict[str, torch.Tensor], group: str, experts: int) -> None:
    pop = tensors.pop
    tensors[f"{group}.gate_up_proj"] = torch.stack([torch.cat(
        [pop(f"{group}.{e}.gate_proj.weight"), pop(f"{group}.{e}.up_proj.weight")])
        for e in range(experts)])
    tensors[f"{group}.down_proj"] = torch.stack([pop(f"{group}.{e}.down_proj.weight")
                                                 for e in range(experts)])


def save_layout_hf(model_name: str, out: str, experts: str, mtp_experts: str = "per_expert",
                   dtype: torch.dtype = torch.float32, seed: int = 0,
                   per_expert_layers: tuple[int, ...] = ()) -> None:
    """A random transformers model written the way a release stores it (`save_pretrained`
    would write per-expert keys only): its in-memory state dict, decoder experts fused unless
    `experts` is 'per_expert' (or the layer is in `per_expert_layers`), MTP experts in
    `mtp_experts`. Same seed, same weights in every layout."""
    from safetensors.torch import save_file

    spec = get_model_spec(model_name)
    model = _random_model(model_name, seed)
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if spec.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    tensors.update(_random_mtp(spec))
    for layer in range(spec.num_layers):
        if experts == "per_expert" or layer in per_expert_layers:
            _unfuse(tensors, f"model.layers.{layer}.mlp.experts")
    if spec.mtp_num_layers and mtp_experts == "fused":
        _fuse(tensors, "mtp.layers.0.mlp.experts", spec.num_experts)
    Path(out).mkdir(parents=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()},
              f"{out}/model.safetensors", metadata={"format": "pt"})


def hf_state(hf_dir: str) -> dict[str, torch.Tensor]:
    """What transformers loads from `hf_dir` (its in-memory, fused names)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def load_and_save(model_name: str, ckpt: str, root: str) -> str:
    """A training run's checkpoint of weights loaded from `ckpt` (no step taken)."""
    from megatron_rl.checkpoint.training_checkpoint import save_checkpoint

    cfg = load_config(None, [f"model.name={model_name}", "model.seq_length=24",
                             "train.global_batch_size=2", "train.micro_batch_size=1"])
    actor = MegatronActor(cfg)
    load_checkpoint(actor, ckpt, optimizer=False, rng=False)
    return str(save_checkpoint(actor, root))


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

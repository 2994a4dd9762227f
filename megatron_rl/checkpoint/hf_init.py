"""A new HF checkpoint folder with random weights (`megatron-rl convert init-hf`): a registry
architecture sized to a tokenizer folder, seeded, saved by transformers with that tokenizer,
written to a temporary folder and renamed into place. The embedded default starts from one
(a tiny MoE over a tokenizer trained on its world); so can any user's from-scratch run."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from megatron_rl.checkpoint.errors import HFCheckpointError
from megatron_rl.models.registry import ModelSpec


def init_hf_model(spec: ModelSpec, tokenizer_dir: str | Path, out: str | Path, *,
                  seed: int = 0, vocab_multiple: int = 64,
                  embedding_std: float | None = None) -> Path:
    """`out`: config.json, safetensors and the tokenizer files of `tokenizer_dir`; the
    embedding holds the tokenizer's ids rounded up to `vocab_multiple`. `embedding_std`:
    the input embedding drawn from N(0, std²) instead of the architecture's init (0.02);
    with tied embeddings a copied id's logit starts as its row's squared norm
    (benchmarks/copy_probe.py compares)."""
    import torch
    import transformers

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; remove it or choose another --out")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir),
                                                               local_files_only=True)
    except (OSError, ValueError) as e:
        raise HFCheckpointError(f"{tokenizer_dir}: no usable tokenizer "
                                f"({type(e).__name__}: {str(e)[:200]})") from None
    if getattr(tokenizer, "chat_template", None) is None:
        raise HFCheckpointError(f"{tokenizer_dir}: the tokenizer has no chat template")
    vocab = -(-len(tokenizer) // vocab_multiple) * vocab_multiple
    spec = dataclasses.replace(spec, vocab_size=vocab)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(spec.hf_config())
    if embedding_std is not None:
        if not embedding_std > 0:
            raise ValueError(f"embedding_std={embedding_std}: must be > 0")
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(0.0, embedding_std)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(out)
    return out

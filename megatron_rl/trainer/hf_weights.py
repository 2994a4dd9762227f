"""A run's Hugging Face boundary: the policy's initial weights imported from `model.hf_path`
(once, reused while the folder is unchanged), and HF folders exported from its checkpoints
(`checkpoint.export_hf_every`, and at the end) with the run's tokenizer and chat template."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from megatron_rl.checkpoint.convert import export_hf, import_hf
from megatron_rl.config.schema import Config
from megatron_rl.models.registry import ModelSpec


def _fingerprint(folder: Path) -> str:
    """Changes when a weight file or the config of `folder` changes (name, size, mtime)."""
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".json"))
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    key = json.dumps([str(folder.resolve()), stats])
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def initial_weights(cfg: Config, spec: ModelSpec, progress: bool = True) -> str | None:
    """The torch_dist folder the trainer starts from: `model.hf_path` converted (into the run's
    output folder, reused while the source is unchanged), unless the run resumes
    (`checkpoint.load`) or starts from another run (`checkpoint.init_from`)."""
    if cfg.model.hf_path is None or cfg.checkpoint.load or cfg.checkpoint.init_from:
        return None
    source = Path(cfg.model.hf_path)
    out = Path(cfg.train.output_dir) / f"hf_import-{_fingerprint(source)}"
    if not (out / "manifest.json").is_file():
        r = import_hf(str(source), str(out), spec, dtype=cfg.model.dtype, progress=progress)
        print(f"[megatron-rl] imported {source} ({r['tensors']} chunks, {r['bytes'] / 1e6:.1f} "
              f"MB) in {r['seconds']:.1f}s", flush=True)
    return str(out)


def checkpoint_due(ck: Any, step: int, steps: int) -> tuple[bool, bool]:
    """(save, export) after run step `step` of `steps`: exports every `export_hf_every` steps
    and at the end with `export_hf`; saves every `save_every` steps, at the end (a run's final
    model is always kept when `checkpoint.dir` is set) and on every export step (an export is
    written from that step's checkpoint)."""
    last = step == steps
    export = bool(ck.dir) and ((bool(ck.export_hf_every) and step % ck.export_hf_every == 0)
                               or (last and ck.export_hf))
    save = bool(ck.dir) and (last or export or bool(ck.save_every and step % ck.save_every == 0))
    return save, export


def save_run_tokenizer(tokenizer: Any, out: Path) -> Path:
    """The tokenizer (and chat template) exports copy: `model.hf_path`'s files when the run has
    one, else the run's own tokenizer saved once."""
    folder = out / "tokenizer"
    if not (folder / "tokenizer_config.json").is_file():
        tokenizer.save_pretrained(str(folder))
    return folder


def export_step(cfg: Config, spec: ModelSpec, step: int, tokenizer_dir: Path,
                progress: bool = False) -> Path:
    """The checkpoint of step `step` as an HF folder `<output_dir>/hf/step_XXXXXX`."""
    src = Path(cfg.checkpoint.dir) / f"step_{step:06d}"
    dst = Path(cfg.train.output_dir) / "hf" / f"step_{step:06d}"
    export_hf(str(src), str(dst), spec, tokenizer_dir=str(tokenizer_dir), overwrite=True,
              progress=progress)
    return dst

"""Bring your own model, tokenizer, data and corpus, end to end on CPU: a tiny MoE saved by
transformers with a tokenizer folder built offline (Qwen3's format, and Qwen3.5's XML calls
for the hybrid), a verl parquet, a user corpus indexed with the CLI → `megatron-rl train ...
model.hf_path=... data.train_files=...` for 2 steps at EP2 → the exported HF folder loads with
transformers and generates, and its weights are the trained continuation of the source's."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from safetensors.torch import load_file

from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
from megatron_rl.models.registry import get_model_spec
from tests.conversion_cases import save_random_hf
from tests.fakes import build_index_cli
from tests.test_chat_formats import QWEN3_5_SPECIAL, TEMPLATES, build_tokenizer

CORPUS = [{"id": str(i), "url": f"https://w.test/p{i}", "title": f"Page {i}",
           "text": f"Entity {i} was founded in {1900 + i} in the city of Velt{i % 3}."}
          for i in range(12)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    build_index_cli(root, CORPUS)
    rows = [{"data_source": "own", "ability": "search",
             "prompt": [{"role": "user", "content": f"Where was entity {i} founded?"}],
             "reward_model": {"ground_truth": {"target": [f"Velt{i % 3}"]}},
             "extra_info": {"index": i, "bucket": i % 2},
             "tools_kwargs": {"search": {"top_k": 3}}} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    return root


def _hf_folder(root, name: str):
    spec = get_model_spec(name)
    folder = root / f"hf-{name}"
    save_random_hf(name, str(folder))  # with the MTP tensors released Qwen3.5 folders carry
    if spec.architecture == "qwen3_5_moe":
        build_tokenizer(folder, TEMPLATES["qwen3_5"], QWEN3_5_SPECIAL,
                        vocab_size=spec.vocab_size)
    else:
        tiny_qwen3_tokenizer(vocab_size=spec.vocab_size).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-qwen3.5"])
def test_train_your_own_model_and_export_it(name, corpus, tmp_path):
    hf = _hf_folder(tmp_path, name)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "tiny-moe-rl-cpu",
           f"model.hf_path={hf}", f"data.train_files=[{corpus / 'train.parquet'}]",
           "data.curriculum=bucket", f"env.search.index={corpus / 'index'}",
           "train.steps=2", "rl.max_turns=2", "rl.max_new_tokens=16", "rl.eval_every=0",
           "rl.sampling.samples_per_prompt=2", "rl.sampling.oversample=1.0",
           "rl.sampling.partial_rollout=false", f"train.output_dir={out}",
           f"checkpoint.dir={out / 'ckpt'}", "checkpoint.save_every=2",
           "checkpoint.export_hf=true"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"imported {hf}" in proc.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["num_tokens"] > 0 for r in rows)
    trajs = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert {t["group_id"].split(".")[0] for t in trajs} <= {f"train:{i}" for i in range(6)}
    # bucket curriculum: step 1 draws bucket-0 rows (even indices)
    assert {int(t["group_id"].split(":")[1].split(".")[0]) % 2 for t in trajs
            if t["step"] == 1} == {0}

    exported = out / "hf" / "step_000002"
    tok = transformers.AutoTokenizer.from_pretrained(exported, local_files_only=True)
    assert tok.chat_template == transformers.AutoTokenizer.from_pretrained(hf).chat_template
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    ids = tok("Where was entity 3 founded?", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] == ids.shape[1] + 4
    # the run started from the folder's weights (imported), not from a random init: two
    # steps at lr 1e-4 move them a little
    src = {k: v for f in hf.glob("*.safetensors") for k, v in load_file(f).items()}
    got = {k: v for f in exported.glob("*.safetensors") for k, v in load_file(f).items()}
    assert src.keys() == got.keys()
    diff = torch.cat([(got[k].float() - src[k].float()).abs().flatten() for k in src])
    assert 0 < diff.mean().item() < 1e-3, diff.mean().item()

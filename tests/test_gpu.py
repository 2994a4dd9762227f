"""Checks that need CUDA (run by tests/gpu/run_all.sh on a lent GPU; skipped elsewhere)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests import dist_cases
from tests.pools import get_pool

pytestmark = pytest.mark.gpu


def _te_train(overrides):
    from megatron_rl.models.builder import use_transformer_engine

    actor = dist_cases.make_actor(overrides)
    batch = dist_cases.fixed_batch()
    losses = [actor.train_step(batch, dist_cases.lm_loss)["loss"] for _ in range(4)]
    return losses, use_transformer_engine(actor.cfg.model)


def test_bf16_step_on_gpu_learns():
    losses, te = get_pool(1).run(_te_train, ["model.dtype=bf16", "optim.lr=1e-2"])[0]
    assert losses[-1] < losses[0], losses
    print("transformer engine spec:", te, "losses:", losses)


def test_cuda_is_visible():
    assert torch.cuda.is_available()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed")
def test_nccl_weight_broadcast_into_a_real_sglang_engine(tmp_path):
    """The `distributed` transport into SGLang: rank 0 broadcasts over NCCL, the server loads
    the buckets and stamps the new version on what it generates, its log-probs then close to
    the trainer's (bf16 kernels differ)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL cannot put the trainer and the engine on one GPU: needs 2")
    from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
    from megatron_rl.checkpoint.convert import export_hf
    from megatron_rl.distributed.process_groups import free_port
    from megatron_rl.engines.sglang import ServerProcess, SGLangConfig
    from tests import sync_cases

    init = str(tmp_path / "init")
    get_pool(1).run(dist_cases.save_initial, init)
    hf = tmp_path / "hf"
    export_hf(init, str(hf), "tiny-moe", dtype="bf16", progress=False)
    tiny_qwen3_tokenizer(vocab_size=512).save_pretrained(hf)
    cfg = SGLangConfig(model_path=str(hf), port=free_port(), base_gpu_id=1,
                       mem_fraction_static=0.3, skip_server_warmup=True)
    with ServerProcess(cfg.command(), cfg.url, env=cfg.environment(), require="sglang",
                       log_path=tmp_path / "sglang.log", startup_timeout_s=300).start():
        r = get_pool(1).run(sync_cases.step_sync_probe, [], init, cfg.url, "distributed", 7,
                            str(tmp_path))[0]
    _, engine_logp, versions = r["after"]
    assert versions == [7] * sync_cases.NEW_TOKENS
    mismatch = max(abs(a - b) for a, b in zip(engine_logp, r["trainer_after"], strict=True))
    print(f"sglang NCCL sync: {r['tensors']} tensors, max |engine - trainer| {mismatch:.3f}")
    assert mismatch < 0.1

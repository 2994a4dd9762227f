"""Weight sync in FP8 (`WeightSyncer(fp8=True)`): the projections travel as blockwise e4m3 +
`weight_scale_inv`, as an engine serving an FP8 checkpoint takes them. The real embedded engine
dequantizes what it receives; its weights then equal the trainer's within the e4m3 bound (the
rest bit for bit), over the tensor and the disk transports."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from megatron_rl.checkpoint.convert import export_hf
from megatron_rl.checkpoint.fp8 import REL_BOUND, is_quantized_name
from megatron_rl.checkpoint.training_checkpoint import load_checkpoint
from megatron_rl.engines.embedded import EmbeddedServer
from megatron_rl.trainer.losses import lm_loss
from megatron_rl.trainer.weight_sync import WeightSyncer, gatherer_for
from tests import dist_cases
from tests.pools import get_pool


def fp8_sync_job(init: str, url: str, transport: str, version: int, disk_dir: str) -> dict:
    """One step, an FP8 sync; the trainer's full-precision HF tensors and the sync's bytes."""
    actor = dist_cases.make_actor(["model.seq_length=24", "train.global_batch_size=2"])
    load_checkpoint(actor, init, optimizer=False, rng=False)
    actor.train_step(dist_cases.fixed_batch(rows=2, seq=24), lm_loss)
    gatherer = gatherer_for(actor)
    with WeightSyncer(gatherer, [url], transport=transport, bucket_bytes=16 << 10,
                      disk_dir=disk_dir, fp8=True) as syncer:
        stats = syncer.sync(version)
    return {"hf": {n: t.clone() for n, t in gatherer.hf_tensors()}, "bytes": stats.bytes,
            "sent_bytes": stats.extra["sent_bytes"]}


def test_fp8_sync_into_the_embedded_engine(tmp_path):
    init = str(tmp_path / "init")
    get_pool(1).run(dist_cases.save_initial, init)
    hf = tmp_path / "hf"
    export_hf(init, str(hf), "tiny-moe", progress=False)
    for version, transport in ((3, "tensor"), (4, "disk")):
        with EmbeddedServer.from_pretrained(str(hf)).start() as server:
            r = get_pool(1).run(fp8_sync_job, init, server.url, transport, version,
                                str(tmp_path / "disk"))[0]
            assert server.core.weight_version == str(version)
            saved = tmp_path / f"engine-{transport}"
            server.core.model.save_pretrained(saved)
        engine = load_file(saved / "model.safetensors")
        trainer = r["hf"]
        quantized = [n for n in trainer if is_quantized_name(n)]
        assert len(quantized) > 0 and set(trainer) <= set(engine)
        worst = 0.0
        for name, t in trainer.items():
            got = engine[name].float()
            if name in quantized:
                err = (got - t.float()).abs()
                assert bool((err <= t.float().abs() * REL_BOUND + 1e-4).all()), name
                worst = max(worst, float(err.max()))
            else:  # norms, router, embeddings: sent as they are
                assert torch.equal(got, t.float()), name
        assert worst > 0  # it really went through e4m3
        # fp32 trainer weights: a projection goes as 1 byte per element + one fp32 scale per
        # 128x128 block; the rest as it is
        blocks = sum(-(-t.shape[0] // 128) * -(-t.shape[1] // 128) for n, t in trainer.items()
                     if n in quantized)
        expected = sum(t.numel() * (1 if n in quantized else t.element_size())
                       for n, t in trainer.items()) + 4 * blocks
        assert r["sent_bytes"] == expected < r["bytes"]
        print(f"\n{transport}: {len(quantized)} FP8 tensors, {r['bytes'] / 1e6:.3f} MB gathered"
              f" -> {r['sent_bytes'] / 1e6:.3f} MB sent; max abs error {worst:.2e}")

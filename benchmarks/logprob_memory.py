"""Peak memory of one train step's log-prob computation, chunked vs whole-sequence, same run.

Each setting runs in its own process (peak RSS is per process): a tiny MoE with a large
vocabulary on one long sequence, where the [tokens, vocab] logits dominate memory unless they
are computed a chunk at a time (and recomputed in backward).

    python benchmarks/logprob_memory.py [--seq 8192 --vocab 65536 --chunks 1024 0]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, resource, sys, time, torch
from megatron_rl.utils.logs import quiet_libraries
quiet_libraries()
from megatron_rl.config.loader import load_config
from megatron_rl.distributed.process_groups import init_distributed
from megatron_rl.trainer.actor import MegatronActor
from megatron_rl.records.batch import TokenBatch
from megatron_rl.trainer.losses import lm_loss
spec, seq, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(2)
init_distributed("gloo")
actor = MegatronActor(load_config(None, [f"model.name={spec}", f"model.seq_length={seq}",
    "train.global_batch_size=1", "train.micro_batch_size=1",
    f"train.logprob_chunk_tokens={chunk or 1 << 30}"]))
g = torch.Generator().manual_seed(0)
tokens = torch.randint(0, actor.spec.vocab_size, (1, seq + 1), generator=g)
batch = TokenBatch.from_sequences(tokens)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.time()
loss = actor.train_step(batch, lm_loss)["loss"]
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"chunk": chunk, "loss": loss, "seconds": time.time() - t0,
                  "rss_before_mb": before, "peak_mb": peak}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--chunks", type=int, nargs="+", default=[1024, 0],
                   help="tokens per chunk; 0 = the whole sequence at once")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "wide-vocab-moe.yaml"
        spec.write_text("architecture: qwen3_moe\nhidden_size: 64\nnum_layers: 2\n"
                        "num_attention_heads: 4\nnum_query_groups: 2\nhead_dim: 16\n"
                        f"vocab_size: {a.vocab}\nnum_experts: 4\nmoe_router_topk: 2\n"
                        "moe_ffn_hidden_size: 64\n")
        rows = []
        for chunk in a.chunks:
            cmd = [sys.executable, "-c", CHILD, str(spec), str(a.seq), str(chunk)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                sys.exit(out.stderr[-2000:])
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    logits_mb = a.seq * a.vocab * 4 / 1e6
    print(f"seq {a.seq}, vocab {a.vocab}: one fp32 logits tensor = {logits_mb:.0f} MB")
    header = ("chunk tokens", "step s", "peak RSS", "step growth", "loss")
    print("{:>12s} {:>7s} {:>9s} {:>12s} {:>8s}".format(*header))
    for r in rows:
        growth = r["peak_mb"] - r["rss_before_mb"]
        print(f"{r['chunk'] or 'whole':>12} {r['seconds']:7.1f} {r['peak_mb']:7.0f}MB "
              f"{growth:10.0f}MB {r['loss']:8.4f}")
    if len(rows) >= 2:
        base = rows[-1]["peak_mb"] - rows[-1]["rss_before_mb"]
        best = rows[0]["peak_mb"] - rows[0]["rss_before_mb"]
        print(f"ratio step-growth chunked/whole = {best / max(base, 1):.2f}")


if __name__ == "__main__":
    main()

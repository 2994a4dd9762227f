"""Tokens/s of one Megatron train step (tiny MoE, CPU, fp32) vs plain PyTorch, same run.

The plain-PyTorch side is transformers' eager implementation of the same architecture, built
from the same registry entry (identical parameter count), trained with torch AdamW on the same
batch; it is built first, before the Megatron CPU shims touch torch. The two steps alternate
(median of `--steps` each), so load from other processes hits both alike. Prints both and
their ratio.

    python benchmarks/megatron_cpu_step.py [--model tiny-moe] [--batch 8] [--seq 256]
        [--vocab N] [--chunk-tokens N] [--profile]

`--profile` prints, for each side, the operators with the most CPU time in one step (torch
profiler): where the Megatron step loses against the plain one.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from results import emit


def _profile(step, title: str, rows: int = 18) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(f"-- {title}: top operators by self CPU time, one step")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


PROFILE = False
CHUNK = 4096


def plain_pytorch(spec, tokens: torch.Tensor):
    """(one train step, parameter count) of transformers' eager model with torch AdamW."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1])
        out.loss.backward()
        opt.step()

    return step, sum(p.numel() for p in model.parameters())


def megatron(spec, tokens: torch.Tensor):
    """(one train step, parameter count) of the Megatron actor (local spec, CPU shims)."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.distributed.process_groups import init_distributed
    from megatron_rl.records.batch import TokenBatch
    from megatron_rl.trainer.actor import MegatronActor
    from megatron_rl.trainer.losses import lm_loss

    rows, seq = tokens.shape[0], tokens.shape[1] - 1
    init_distributed("gloo")
    cfg = load_config(None, [f"model.name={spec.name}", f"model.seq_length={seq}",
                             f"train.global_batch_size={rows}", f"train.micro_batch_size={rows}",
                             "optim.lr=1e-3", f"train.logprob_chunk_tokens={CHUNK}"])
    actor = MegatronActor(cfg, spec)
    batch = TokenBatch.from_sequences(tokens)
    return (lambda: actor.train_step(batch, lm_loss),
            sum(p.numel() for p in actor.parameters().values()))


def interleaved(steps: dict, warmup: int, n: int) -> dict[str, float]:
    """Median seconds per step of each, the steps alternating so that whatever else loads the
    machine meanwhile hits both alike."""
    for name, step in steps.items():
        for _ in range(warmup):
            step()
        if PROFILE:
            _profile(step, name)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(n):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-moe")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=0, help="override the entry's vocabulary")
    p.add_argument("--chunk-tokens", type=int, default=4096,
                   help="tokens per output-layer chunk (train.logprob_chunk_tokens)")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    global PROFILE, CHUNK
    PROFILE, CHUNK = args.profile, args.chunk_tokens

    from megatron_rl.models.registry import get_model_spec
    from megatron_rl.utils.host_memory import reuse_freed_memory
    from megatron_rl.utils.logs import quiet_libraries

    quiet_libraries()
    reuse_freed_memory()  # as every megatron-rl process on a CPU host (both sides alike)
    torch.set_num_threads(args.threads)
    spec = get_model_spec(args.model)
    if args.vocab:
        spec = dataclasses.replace(spec, vocab_size=args.vocab)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (args.batch, args.seq + 1), generator=g)
    n_tokens = args.batch * args.seq

    plain_step, n_plain = plain_pytorch(spec, tokens)  # built before the shims touch torch
    mcore_step, n_mcore = megatron(spec, tokens)
    t = interleaved({"plain PyTorch": plain_step, "Megatron": mcore_step}, args.warmup,
                    args.steps)
    t_plain, t_mcore = t["plain PyTorch"], t["Megatron"]
    plain_tps, mcore_tps = n_tokens / t_plain, n_tokens / t_mcore
    print(f"model {args.model}: {n_mcore:,} params (plain PyTorch: {n_plain:,}); "
          f"batch {args.batch}x{args.seq}, fp32, {args.threads} threads, median of {args.steps}")
    print(f"{'implementation':28s} {'step (ms)':>10s} {'tokens/s':>10s}")
    print(f"{'plain PyTorch (transformers)':28s} {t_plain * 1e3:10.1f} {plain_tps:10.0f}")
    print(f"{'Megatron-core (local spec)':28s} {t_mcore * 1e3:10.1f} {mcore_tps:10.0f}")
    print(f"ratio megatron/plain tokens/s = {mcore_tps / plain_tps:.2f}")
    emit(f"Megatron CPU train step / plain PyTorch, tokens/s ({args.model})",
         mcore_tps / plain_tps, 1.0)


if __name__ == "__main__":
    main()

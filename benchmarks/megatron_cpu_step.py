"""Tokens/s of one Megatron train step (tiny MoE, CPU, fp32) vs plain PyTorch, same run.

The plain-PyTorch side is transformers' eager implementation of the same architecture, built
from the same registry entry (identical parameter count), trained on the same batch with the
same objective and update as the Megatron actor: the LM loss plus the MoE router's
load-balancing loss at the entry's coefficient, gradients clipped to norm 1.0 (`optim.
clip_grad`'s default), torch AdamW. It is built first, before the Megatron CPU shims touch
torch. The steps alternate (at least `--steps` rounds, more as `--seconds` allow), so load
from other processes hits all alike; the ratio is the median of the rounds' own ratios (the
medians of each side apart are printed too). Also timed, for reference only: the plain step
without the router loss and clipping.

Two cases by default: the test model at a tiny batch (`tiny-moe`, 8 x 256 tokens: fixed
per-step costs weigh most there) and the quickstart's policy at its SFT micro-batch
(`tiny-moe-agent` with the quickstart tokenizer's 34,048 ids, 4 x 1,024 tokens).

    python benchmarks/megatron_cpu_step.py [--cases tiny-moe:8x256,tiny-moe-agent@34048:4x1024]
        [--chunk-tokens N] [--profile]

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
CLIP_GRAD = 1.0  # optim.clip_grad's default, which the Megatron actor applies


def plain_pytorch(spec, tokens: torch.Tensor, same_update: bool = True):
    """(one train step, parameter count) of transformers' eager model with torch AdamW.
    `same_update`: the Megatron actor's objective and update (router load-balancing loss,
    gradient clipping); without, the bare LM-loss step."""
    import transformers

    torch.manual_seed(0)
    config = spec.hf_config()
    config.output_router_logits = same_update and spec.is_moe  # adds the router's aux loss
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1])
        out.loss.backward()
        if same_update:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)
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


def interleaved(steps: dict, warmup: int, n: int, seconds: float = 0.0
                ) -> tuple[int, dict[str, list[float]]]:
    """(rounds run, each step's seconds in every round), the steps alternating so that
    whatever else loads the machine meanwhile hits all alike: `n` rounds, more until
    `seconds` have passed (a 40 ms step's median of 10 moved 0.97-1.02 between runs, of 60
    1.004-1.012)."""
    for name, step in steps.items():
        for _ in range(warmup):
            step()
        if PROFILE:
            _profile(step, name)
    times: dict[str, list[float]] = {name: [] for name in steps}
    names, start, rounds = list(steps), time.perf_counter(), 0
    while rounds < n or rounds % len(names) or time.perf_counter() - start < seconds:
        # each round starts one step later (whole cycles): no step always runs right after
        # the same other (in a fixed order the second of three read ~1.3 % slower, 8 x 256)
        turn = rounds % len(names)
        rounds += 1
        for name in names[turn:] + names[:turn]:
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    return rounds, times


def parse_case(text: str) -> tuple[str, int, int, int]:
    """'model[@vocab]:rowsxseq' → (model, vocab or 0 for the entry's, rows, seq)."""
    name, shape = text.split(":")
    model, _, vocab = name.partition("@")
    rows, seq = shape.lower().split("x")
    return model, int(vocab or 0), int(rows), int(seq)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="tiny-moe:8x256,tiny-moe-agent@34048:4x1024",
                   help="comma-separated model[@vocab]:ROWSxSEQ")
    p.add_argument("--warmup", type=int, default=2)
    # 4 x 1,024's 1.2 s steps: 12 rounds read 0.95 (the bare step, which does less, 3 %
    # slower than the full one), 24 read 1.01
    p.add_argument("--steps", type=int, default=24, help="at least this many rounds")
    # 8 x 256 with 8 s (~57 rounds) read 0.984-1.068 in one session, with 40 s 1.029-1.034
    p.add_argument("--seconds", type=float, default=20.0,
                   help="and alternate steps for at least this long per case")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk-tokens", type=int, default=4096,
                   help="tokens per output-layer chunk (train.logprob_chunk_tokens)")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    global PROFILE, CHUNK
    PROFILE, CHUNK = args.profile, args.chunk_tokens

    from megatron_rl.models.registry import get_model_spec
    from megatron_rl.utils.host_memory import tune_host_memory
    from megatron_rl.utils.logs import quiet_libraries

    quiet_libraries()
    tune_host_memory()  # as every megatron-rl process on a CPU host (every side alike)
    torch.set_num_threads(args.threads)
    cases = []
    for text in args.cases.split(","):
        model, vocab, rows, seq = parse_case(text)
        spec = get_model_spec(model)
        if vocab:
            spec = dataclasses.replace(spec, vocab_size=vocab)
        g = torch.Generator().manual_seed(0)
        cases.append((text, spec, torch.randint(0, spec.vocab_size, (rows, seq + 1),
                                                generator=g)))
    # every plain model is built before the shims touch torch
    plain = [(plain_pytorch(spec, tokens), plain_pytorch(spec, tokens, same_update=False))
             for _, spec, tokens in cases]
    for (text, spec, tokens), ((plain_step, n_plain), (bare_step, _)) in zip(cases, plain,
                                                                            strict=True):
        mcore_step, n_mcore = megatron(spec, tokens)
        rounds, times = interleaved({"plain PyTorch": plain_step, "Megatron": mcore_step,
                                     "plain, LM loss only": bare_step}, args.warmup,
                                    args.steps, args.seconds)
        t = {name: statistics.median(ts) for name, ts in times.items()}
        n_tokens = tokens.shape[0] * (tokens.shape[1] - 1)
        print(f"\n{text}: {n_mcore:,} params (plain PyTorch: {n_plain:,}); batch "
              f"{tokens.shape[0]}x{tokens.shape[1] - 1}, fp32, {args.threads} threads, median "
              f"of {rounds}")
        print(f"{'implementation':40s} {'step (ms)':>10s} {'tokens/s':>10s}")
        for name, label in (("plain PyTorch", "plain PyTorch (transformers), same update"),
                            ("Megatron", "Megatron-core (local spec)"),
                            ("plain, LM loss only", "plain, no router loss, no clipping")):
            print(f"{label:40s} {t[name] * 1e3:10.1f} {n_tokens / t[name]:10.0f}")
        apart = t["plain PyTorch"] / t["Megatron"]
        # paired: each round's two steps ran seconds apart, so a slow stretch of the host (a
        # 1.2 s step at 4 x 1,024 spans one) slows both; the medians apart let it decide
        ratio = statistics.median(p / m for p, m in zip(times["plain PyTorch"],
                                                         times["Megatron"], strict=True))
        print(f"ratio megatron/plain tokens/s = {ratio:.3f} (median of the rounds' ratios; "
              f"the medians apart {apart:.3f}; against the bare plain step: "
              f"{t['plain, LM loss only'] / t['Megatron']:.3f})")
        vocab = f", vocab {spec.vocab_size}" if "@" in text else ""
        emit(f"Megatron CPU train step / plain PyTorch, tokens/s ({spec.name} "
             f"{tokens.shape[0]}x{tokens.shape[1] - 1}{vocab})", ratio, 1.0,
             note=f"medians apart {apart:.3f}, {rounds} rounds")


if __name__ == "__main__":
    main()

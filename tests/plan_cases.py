"""Job bodies for the memory planner's checks (tests/test_plan.py), run inside the worker
pools: the built model's parameters per rank, and the measured peak memory of a train step."""

from __future__ import annotations

import ctypes
import gc

import torch.distributed as dist

from megatron_rl.config.loader import load_config


def rank_parameters(overrides: list[str]) -> dict[str, int]:
    """{name: numel} of this rank's built model stage (what the planner counts per rank),
    and its pipeline stage under `__stage__`."""
    from megatron.core import parallel_state as ps

    from megatron_rl.distributed.process_groups import init_model_parallel
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.registry import model_spec

    cfg = load_config(None, list(overrides))
    init_model_parallel(cfg.parallel, cfg.train.seed)
    model = build_gpt_model(model_spec(cfg.model), cfg.model, cfg.parallel)
    out = {name: p.numel() for name, p in model.named_parameters()}
    out["__stage__"] = ps.get_pipeline_model_parallel_rank()
    del model
    gc.collect()
    return out


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _malloc_live_bytes(libc: ctypes.CDLL) -> int:
    """Bytes malloc has handed out and not got back (the main arena's in use plus mmap'd
    blocks): what an allocation costs whether or not it reuses freed heap chunks, which
    the RSS depends on (a worker's earlier jobs leave more or fewer of them)."""
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _reset_peak_rss() -> None:
    # writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_step_memory(overrides: list[str], rows: int, seq: int) -> dict[str, int]:
    """Peak RSS of a steady-state train step (the second: Adam's states exist from the first)
    over the rank's RSS before the actor was built, after a throwaway actor has done the lazy
    imports and first-use allocations. Also the bytes the build alone allocates (malloc's
    live bytes: its RSS growth moved 8-10 MB with what the worker had run before)."""
    import torch

    from megatron_rl.records.batch import TokenBatch
    from megatron_rl.trainer.actor import MegatronActor
    from megatron_rl.trainer.losses import lm_loss

    # large allocations straight from mmap, so a freed tensor leaves the RSS and the peak RSS
    # follows the live tensors (glibc's default threshold grows and keeps freed blocks; the
    # pool's ranks keep them on purpose, utils/host_memory.py)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-4, 65536)  # M_MMAP_MAX: glibc's default, mmap on again
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD
    cfg = load_config(None, list(overrides))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (rows, seq + 1), generator=g)
    batch = TokenBatch.from_sequences(tokens, torch.ones_like(tokens))
    warm = MegatronActor(cfg)
    warm.train_step(batch, lm_loss)
    del warm
    gc.collect()
    libc.malloc_trim(0)
    dist.barrier()
    base, base_live = _rss_bytes("VmRSS"), _malloc_live_bytes(libc)
    actor = MegatronActor(cfg)
    gc.collect()
    built = _malloc_live_bytes(libc) - base_live
    actor.train_step(batch, lm_loss)
    gc.collect()
    libc.malloc_trim(0)
    _reset_peak_rss()
    actor.train_step(batch, lm_loss)
    peak = _rss_bytes("VmHWM")
    params = sum(p.numel() for p in actor.model[0].module.parameters())
    del actor
    gc.collect()
    return {"built": built, "peak": peak - base, "params": params}

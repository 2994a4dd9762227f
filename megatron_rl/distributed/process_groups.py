"""Process groups: gloo on CPU, nccl on GPU; Megatron's model-parallel groups on top."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import random
import socket
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.config.schema import ParallelConfig


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_backend(backend: str = "auto") -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def init_distributed(backend: str = "auto", rank: int | None = None,
                     world_size: int | None = None, init_method: str | None = None,
                     timeout_minutes: int = 30) -> None:
    """Join (or create) the default process group; torchrun's env vars are honoured.

    With no env and no arguments this is a 1-process group on 127.0.0.1.
    """
    if dist.is_initialized():
        return
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if init_method is None:
        if "MASTER_ADDR" in os.environ:
            init_method = "env://"
        elif world_size == 1:
            init_method = f"tcp://127.0.0.1:{free_port()}"
        else:
            raise RuntimeError("init_distributed: world_size > 1 needs MASTER_ADDR/MASTER_PORT "
                               "(torchrun sets them) or an explicit init_method")
    backend = resolve_backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=timeout_minutes))


def shutdown_distributed() -> None:
    """Destroy every process group before the interpreter exits: gloo's C++ worker threads
    otherwise outlive it and abort the process ("terminate called without an active
    exception", pytorch#190489), which turns a finished run into exit code -6."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


@dataclass(frozen=True)
class Layout:
    """Where this rank sits in the parallel grid."""

    world_size: int
    dp: int
    tp_rank: int
    pp_rank: int
    ep_rank: int
    dp_rank: int


def min_world_size(parallel: ParallelConfig) -> int:
    """Fewest ranks that fit the layout: a multiple of tp*pp*cp whose DP*TP*CP holds EP*ETP."""
    mp = parallel.model_parallel_size
    dp = 1
    while (dp * parallel.tp * parallel.cp) % (parallel.ep * parallel.etp):
        dp += 1
    return mp * dp


def destroy_model_parallel() -> None:
    """Megatron's `destroy_model_parallel` forgets most of its groups without destroying them;
    on gloo each keeps its threads and sockets (~60 threads per layout), so a long-lived worker
    that rebuilds its layout (a test session, several runs in one pool) would pile them up
    until the machine spends its time in the kernel. Destroy every group it held; a group's
    threads end when its last user goes, so drop the MoE metrics tracker (its entries keep
    their reduce groups) and collect the unreachable old models too."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_logging

    held: dict[int, Any] = {}
    for value in list(vars(ps).values()):
        for g in value if isinstance(value, list | tuple) else (value,):
            if isinstance(g, dist.ProcessGroup) and g is not dist.GroupMember.WORLD:
                held[id(g)] = g
    ps.destroy_model_parallel()
    for g in held.values():
        with contextlib.suppress(Exception):  # megatron already destroyed its *_GLOO groups
            dist.destroy_process_group(g)
    held.clear()
    moe_logging.set_moe_metrics_tracker(moe_logging.MoEMetricsTracker())
    gc.collect()


def init_model_parallel(parallel: ParallelConfig, seed: int) -> Layout:
    """(Re)build Megatron's TP/PP/EP/CP/DP groups over the default group and seed every RNG."""
    from megatron_rl.models import cpu_compat

    cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    world = dist.get_world_size()
    mp = parallel.model_parallel_size
    if world % mp:
        raise ValueError(f"world size {world} is not divisible by parallel.tp*pp*cp={mp}")
    dp = world // mp
    if (dp * parallel.tp * parallel.cp) % (parallel.ep * parallel.etp):
        raise ValueError(f"parallel.ep*etp={parallel.ep * parallel.etp} must divide "
                         f"dp*tp*cp={dp * parallel.tp * parallel.cp} (world {world})")
    if ps.model_parallel_is_initialized():
        destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
    )
    # as megatron's training does: distinct per pipeline stage, same across TP/DP; CPU weight
    # init draws from the default generator, so seed it too
    stage_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)
    return Layout(world_size=world, dp=dp,
                  tp_rank=ps.get_tensor_model_parallel_rank(),
                  pp_rank=ps.get_pipeline_model_parallel_rank(),
                  ep_rank=ps.get_expert_model_parallel_rank(),
                  dp_rank=ps.get_data_parallel_rank())

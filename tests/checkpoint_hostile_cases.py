"""Job bodies for tests/test_checkpoint_hostile.py (run inside the worker pools)."""

from __future__ import annotations

import os
import pickle
import random
from typing import Any

import numpy as np
import torch

from megatron_rl.checkpoint import training_checkpoint as tc
from tests.dist_cases import fixed_batch, full_parameters, make_actor


class Plant:
    """A pickled object that, when unpickled, creates `marker` (stands for any code)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def save_with_planted_progress(folder: str, marker: str) -> None:
    """A real checkpoint whose common state (megatron's one bytes entry) carries a payload."""
    tc.save_checkpoint(make_actor([]), folder, progress={"planted": Plant(marker)})


def save_with_planted_rng(folder: str, marker: str) -> None:
    """A real checkpoint whose per-rank RNG entry (a ShardedObject) carries a payload."""
    real = tc._rng_state
    tc._rng_state = lambda: {**real(), "planted": Plant(marker)}
    try:
        tc.save_checkpoint(make_actor([]), folder)
    finally:
        tc._rng_state = real


def load_everything(ckpt: str) -> dict[str, Any]:
    """Model, optimizer, scheduler and RNG (same layout as the save)."""
    return tc.load_checkpoint(make_actor([]), ckpt)


def full_parameters_with_env(ckpt: str, env: dict[str, str]) -> dict[str, torch.Tensor]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return full_parameters(ckpt)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def unpickling_during_load(ckpt: str) -> list[str]:
    """Every pickle.load / torch.load call a full load_checkpoint makes, with weights_only."""
    calls: list[str] = []
    real_torch_load, real_pickle_load = torch.load, pickle.load

    def torch_load(*args: Any, **kwargs: Any) -> Any:
        calls.append(f"torch.load(weights_only={kwargs.get('weights_only')})")
        return real_torch_load(*args, **kwargs)

    def pickle_load(*args: Any, **kwargs: Any) -> Any:
        calls.append("pickle.load")
        return real_pickle_load(*args, **kwargs)

    actor = make_actor([])
    torch.load, pickle.load = torch_load, pickle_load
    try:
        tc.load_checkpoint(actor, ckpt)
    finally:
        torch.load, pickle.load = real_torch_load, real_pickle_load
    return calls


def _draws() -> list[float]:
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracked = torch.rand(2).tolist()
    return [random.random(), float(np.random.random()), *torch.rand(2).tolist(), *tracked]


def rng_and_step_round_trip(folder: str) -> dict[str, Any]:
    """Train a step, save, draw; in a fresh actor move every RNG on; load; draw again."""
    actor = make_actor([])
    actor.train_step(fixed_batch(), _lm_loss())
    path = tc.save_checkpoint(actor, folder)
    before, steps = _draws(), actor.optimizer_steps
    fresh = make_actor([])  # seeded as `actor` was: its streams start where actor's did
    _draws()
    scrambled = _draws()
    tc.load_checkpoint(fresh, str(path))
    return {"before": before, "after": _draws(), "scrambled": scrambled, "steps": steps,
            "loaded_steps": fresh.optimizer_steps}


def _lm_loss():
    from megatron_rl.trainer.losses import lm_loss

    return lm_loss


def save_sharded_hf(model_name: str, out: str, max_shard_size: int = 200_000) -> list[str]:
    """A random transformers checkpoint in several shards with an index, as save_pretrained
    writes it."""
    import transformers

    from megatron_rl.models.registry import get_model_spec

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(get_model_spec(model_name).hf_config(),
                                                          dtype=torch.float32)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return sorted(os.listdir(out))

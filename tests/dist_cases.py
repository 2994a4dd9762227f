"""Job bodies that run inside the worker pools (every rank runs the same function).

Kept apart from the test files so the spawned ranks import only this and the package.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_rl.checkpoint.training_checkpoint import load_checkpoint, save_checkpoint
from megatron_rl.config.loader import load_config
from megatron_rl.records.batch import TokenBatch
from megatron_rl.trainer.actor import MegatronActor
from megatron_rl.trainer.losses import lm_loss

# adam_eps: Adam's first step is lr*g/(|g|+eps), a near-sign function. For gradient entries
# around eps (1e-8) a 1e-7 relative fp32 reordering difference between layouts moves the update
# by up to ~1e-5; eps=1e-6 keeps the comparison about the layouts, not about that cliff.
BASE = ["model.name=tiny-moe", "model.seq_length=64", "train.global_batch_size=4",
        "train.micro_batch_size=1", "optim.lr=1e-3", "optim.clip_grad=0", "train.seed=1234",
        "optim.adam_eps=1e-6"]


def fixed_batch(rows: int = 4, seq: int = 64, vocab: int = 512, seed: int = 7) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    mask = torch.ones_like(tokens)
    mask[0, :10] = 0  # uneven token counts across rows: the global token mean must still hold
    return TokenBatch.from_sequences(tokens, mask)


def make_actor(overrides: list[str]) -> MegatronActor:
    return MegatronActor(load_config(None, BASE + list(overrides)))


def save_initial(folder: str, overrides: list[str] = ()) -> None:
    actor = make_actor(list(overrides))
    save_checkpoint(actor, folder)


def save_and_list_children(folder: str) -> list[str]:
    """Save, then the child processes this rank has: megatron's writer would spawn a
    multiprocessing Manager (a whole Python) on the first save without our in-process queue."""
    import multiprocessing

    save_checkpoint(make_actor([]), folder)
    return [p.name for p in multiprocessing.active_children()]


def two_steps(overrides: list[str], init: str, save: str | None) -> dict[str, float]:
    """Load the shared initial weights, step, (save), step again. Returns the numbers."""
    actor = make_actor(overrides)
    load_checkpoint(actor, init, optimizer=False, rng=False)
    batch = fixed_batch()
    first = actor.train_step(batch, lm_loss)
    after = actor.evaluate(batch, lm_loss)["loss"]
    if save:
        save_checkpoint(actor, save)
    second = actor.train_step(batch, lm_loss)
    return {"loss": first["loss"], "grad_norm": first["grad_norm"], "loss_after": after,
            "loss2": second["loss"], "grad_norm2": second["grad_norm"]}


def resume_and_step(overrides: list[str], ckpt: str) -> dict[str, float]:
    """Load model + optimizer (resharded) and take the next step."""
    actor = make_actor(overrides)
    load_checkpoint(actor, ckpt, optimizer=True, rng=False)
    batch = fixed_batch()
    before = actor.evaluate(batch, lm_loss)["loss"]
    step = actor.train_step(batch, lm_loss)
    return {"loss_loaded": before, "loss2": step["loss"], "grad_norm2": step["grad_norm"]}


def full_parameters(ckpt: str, overrides: list[str] = ()) -> dict[str, torch.Tensor]:
    """Parameters of a checkpoint, loaded (resharded) into a 1-process model."""
    actor = make_actor(list(overrides))
    load_checkpoint(actor, ckpt, optimizer=False, rng=False)
    return {k: v.detach().clone() for k, v in actor.parameters().items()}


def logprobs_at(overrides: list[str], ckpt: str, chunk_tokens: int) -> torch.Tensor:
    actor = make_actor([*overrides, f"train.logprob_chunk_tokens={chunk_tokens}"])
    load_checkpoint(actor, ckpt, optimizer=False, rng=False)
    lp, ent = actor.compute_logprobs(fixed_batch())
    return torch.stack([lp, ent], -1)


def lm_run(overrides: list[str], stop_after: int | None = None) -> list[dict]:
    from megatron_rl.trainer.lm_loop import run_lm_training

    return run_lm_training(load_config(None, BASE + list(overrides)), stop_after=stop_after)


def rank_of_failure(fail_rank: int) -> int:
    if dist.get_rank() == fail_rank:
        raise ValueError(f"deliberate failure on rank {fail_rank}")
    return dist.get_rank()


def threads_after_actors(overrides: list[str], n: int) -> list[int]:
    """This process's thread count after each of `n` actor builds (each rebuilds the layout)."""
    counts = []
    for _ in range(n):
        make_actor(overrides)
        counts.append(len(os.listdir("/proc/self/task")))
    return counts


def frozen_step(overrides: list[str], ckpt: str) -> dict[str, float]:
    """One step with `optim.frozen` in `overrides`, then a save and a resume (model and
    optimizer) and one more step: per parameter, the largest change over the steps."""
    actor = make_actor(overrides)
    before = {n: p.detach().clone() for n, p in actor.model[0].module.named_parameters()}
    actor.train_step(fixed_batch(), lm_loss)
    save_checkpoint(actor, ckpt)
    again = make_actor(overrides)
    load_checkpoint(again, ckpt, optimizer=True, rng=False)
    again.train_step(fixed_batch(seed=8), lm_loss)
    return {n: float((p.detach() - before[n]).abs().max())
            for n, p in again.model[0].module.named_parameters()}


def single_rank_moe_against_dispatcher(model: str) -> dict:
    """One forward/backward of the global batch with the MoE layers' single-rank path, then
    the same with megatron's all-to-all dispatcher: metrics and every gradient, bit for bit."""
    from megatron_rl.models.layer_specs import single_rank_moe

    actor = make_actor([f"model.name={model}", "model.seq_length=32",
                        "train.micro_batch_size=2"])
    vocab = actor.spec.vocab_size
    layers = [m for c in actor.model for m in c.modules() if isinstance(m, single_rank_moe())]
    direct = [m.single_rank for m in layers]
    batch, out = fixed_batch(seq=32, vocab=vocab), {}
    for single in (True, False):
        for m in layers:
            m.single_rank = single
        for chunk in actor.model:
            chunk.zero_grad_buffer()
        metrics = actor._forward_backward(batch, lm_loss, forward_only=False)
        grads = {n: p.main_grad.clone() for c in actor.model for n, p in c.named_parameters()}
        out[single] = (metrics, grads)
    (m1, g1), (m0, g0) = out[True], out[False]
    return {"layers": len(layers), "direct": direct, "metrics_equal": m1 == m0,
            "grads_equal": sorted(n for n in g1 if torch.equal(g1[n], g0[n])) == sorted(g0),
            "router_grad_nonzero": all(bool(g1[n].abs().sum() > 0) for n in g1
                                       if "router" in n),
            "loss": m1["loss"]}


def short_softmax_router_against_megatrons() -> dict:
    """`ShortSoftmaxRouter.routing` against megatron's `TopKRouter.routing` on the same logits
    (a padding mask, the aux loss on; softmax before or after the top-k): routing maps equal,
    probabilities and the logits' gradient (the aux loss's included) within float32 rounding;
    also without grad (no aux loss) and on rows of tied logits."""
    from megatron_rl.models.layer_specs import short_softmax_router

    actor = make_actor([])
    router = next(m for c in actor.model for m in c.modules()
                  if isinstance(m, short_softmax_router()))
    router.train()
    cfg, experts = router.config, router.config.num_moe_experts
    g = torch.Generator().manual_seed(0)
    logits0 = torch.randn(8, 3, experts, generator=g) * 2  # [s, b, experts]
    logits0[0, 0] = torch.tensor([1.0, 1.0, 0.5, 0.5])[:experts]  # ties
    pad = torch.rand(8, 3, generator=g) < 0.3
    weigh = torch.randn(24, experts, generator=g)
    out: dict = {"eligible": router.short_softmax, "cases": []}
    pre = cfg.moe_router_pre_softmax
    try:
        for cfg.moe_router_pre_softmax in (False, True):
            for grad in (True, False):
                got = {}
                for short in (True, False):
                    router.short_softmax = short
                    logits = logits0.clone().requires_grad_()
                    with torch.set_grad_enabled(grad):
                        probs, routing_map = router.routing(logits, padding_mask=pad)
                    if grad:
                        (probs * weigh).sum().backward()
                    got[short] = (probs.detach(), routing_map, logits.grad)
                (p1, m1, g1), (p0, m0, g0) = got[True], got[False]
                out["cases"].append({
                    "maps_equal": torch.equal(m1, m0), "probs_diff": float((p1 - p0).abs().max()),
                    "grad_diff": float((g1 - g0).abs().max()) if grad else 0.0,
                    "grad_size": float(g0.abs().max()) if grad else 1.0})
    finally:
        cfg.moe_router_pre_softmax, router.short_softmax = pre, True
    return out


def grads_in_place_against_ddp_hooks() -> dict:
    """Two micro-batches accumulated by autograd into `main_grad` (the gradinplace shim)
    against megatron's per-parameter DDP hooks re-registered on the same actor: the same
    gradient buffer bit for bit, and no Python hook left on the in-place path."""
    actor = make_actor(["train.micro_batch_size=2"])
    ddp = actor.model[0]
    params = list(ddp.grads_in_place)
    batch, out = fixed_batch(rows=4, seq=32), {}
    for in_place in (True, False):
        if not in_place:  # back to megatron's path: its hooks, grads freed after each add
            ddp.grads_in_place = []
            for p, acc in zip(params, ddp.grad_accs, strict=True):
                p.grad = None
                acc.register_hook(ddp._make_backward_post_hook(p))
        ddp.zero_grad_buffer()
        actor.optimizer.zero_grad()
        metrics = actor._forward_backward(batch, lm_loss, forward_only=False)
        out[in_place] = (metrics, [p.main_grad.clone() for p in params],
                         sum(p.grad is p.main_grad for p in params))
    (m1, g1, aliased), (m0, g0, _) = out[True], out[False]
    return {"params": len(params), "all": len(params) == sum(
                p.requires_grad for p in ddp.module.parameters()),
            "metrics_equal": m1 == m0, "aliased": aliased,
            "grads_equal": all(torch.equal(a, b) for a, b in zip(g1, g0, strict=True)),
            "nonzero": sum(bool(g.abs().sum() > 0) for g in g1)}


def one_rank_collectives() -> dict:
    """The onerank and foreachnorm shims against what they replace, on a one-rank group."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    make_actor([])  # initialises the groups
    group, x = ps.get_data_parallel_group(), torch.arange(4.0)
    ret = [dist.all_reduce(x, group=group), dist.broadcast(x, src=0, group=group),
           dist.all_reduce(x, op=dist.ReduceOp.MAX)]
    work = dist.all_reduce(x, group=group, async_op=True)  # async: still torch's (a Work)
    work.wait()
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=g) for n in (7, 64, 1, 300)]
    copies = [t.clone() for t in grads]
    mine, _ = clip_grads.l2_norm_impl(0, None, [grads], False)
    theirs, _ = local_multi_tensor_l2_norm(0, None, [grads], False)
    clip_grads.multi_tensor_scale_impl(0, None, [grads, grads], 0.37)
    local_multi_tensor_scale(0, None, [copies, copies], 0.37)
    return {"returns": ret, "values": x.tolist(), "work": work is not None,
            "norm_equal": torch.equal(mine, theirs),
            "scaled_equal": all(torch.equal(a, b) for a, b in zip(grads, copies, strict=True)),
            "linear_equal": _one_rank_linear_as_megatrons(ps.get_tensor_model_parallel_group()),
            "reset_after": _router_statistics_reset(),
            "mappings_pass_through": _one_rank_mappings(ps.get_tensor_model_parallel_group())}


def _one_rank_mappings(tp_group) -> bool:
    """megatron's tensor-parallel copy/reduce/scatter/gather on one rank: the input itself,
    and its gradient flows through unchanged."""
    from megatron.core.tensor_parallel import mappings

    x = torch.arange(6.0).reshape(2, 3).requires_grad_()
    outs = [fn(x, group=tp_group) for fn in (
        mappings.copy_to_tensor_model_parallel_region,
        mappings.reduce_from_tensor_model_parallel_region,
        mappings.scatter_to_tensor_model_parallel_region,
        mappings.gather_from_tensor_model_parallel_region)]
    sum(o.sum() for o in outs).backward()
    return all(o is x for o in outs) and torch.equal(x.grad, torch.full((2, 3), 4.0))


def _router_statistics_reset() -> list[float]:
    """What the idlereset shim's finalisation leaves in a quantile-balancing accumulator: kept
    under the aux loss (nothing of megatron's to reset), zeroed under quantile balancing."""
    import importlib
    from types import SimpleNamespace

    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    out = []
    for balancing in ("aux_loss", "quantile_balancing"):
        module = torch.nn.Module()
        module.qb_beta_accum, module.qb_beta_count = torch.ones(2), torch.ones(())
        finalize.reset_model_temporary_tensors(SimpleNamespace(
            moe_router_enable_expert_bias=False, moe_router_load_balancing_type=balancing),
            [module])
        out.append(float(module.qb_beta_accum.sum() + module.qb_beta_count))
    return out


def _one_rank_linear_as_megatrons(tp_group) -> bool:
    """The plainlinear shim's linears against megatron's autograd functions (the parallel
    linear, the router's gate): output, input and weight (and bias) gradients, bit for bit."""
    from megatron.core.tensor_parallel import layers

    g = torch.Generator().manual_seed(5)
    x, w, b = (torch.randn(*s, generator=g) for s in ((12, 3, 16), (24, 16), (24,)))
    grad = torch.randn(12, 3, 24, generator=g)
    results = []
    for fn in (layers.linear_with_grad_accumulation_and_async_allreduce,
               layers.LinearWithGradAccumulationAndAsyncCommunication.apply):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        out = fn(xs, ws, bs, False, False, False, None, 0, tp_group, 1)
        out.backward(grad)
        results.append([out.detach(), xs.grad, ws.grad, bs.grad])
    from megatron.core.transformer.moe import moe_utils, router

    for fn in (router.router_gating_linear, moe_utils.RouterGatingLinearFunction.apply):
        xs, ws = (t.clone().requires_grad_() for t in (x, w))
        out = fn(xs, ws, None, torch.float32)
        out.backward(grad)
        results.append([out.detach(), xs.grad, ws.grad])
    shimmed = all(hasattr(f, "__wrapped__") for f in (
        layers.linear_with_grad_accumulation_and_async_allreduce, router.router_gating_linear))
    return shimmed and all(torch.equal(a, b) for pair in (results[:2], results[2:])
                           for a, b in zip(*pair, strict=True))


def foreach_adam_against_loop(folder: str) -> dict:
    """The actor's Adam runs torch's for-each form, also after loading a checkpoint saved with
    no choice in its param groups (an older one's); two steps of it and of torch's per-tensor
    loop from the same weights and optimizer state leave the same parameters bit for bit."""
    from megatron_rl.trainer.offload import torch_optimizers

    def groups(actor: MegatronActor) -> list:
        return [g for o in torch_optimizers(actor.optimizer) for g in o.param_groups]

    first = make_actor([])
    built = [g.get("foreach") for g in groups(first)]
    for g in groups(first):
        g["foreach"] = None
    save_checkpoint(first, folder)
    batch, params, loaded = fixed_batch(), [], []
    for loop in (False, True):
        actor = make_actor([])
        load_checkpoint(actor, folder, optimizer=True, rng=False)
        loaded.append([g.get("foreach") for g in groups(actor)])
        for g in groups(actor):
            g["foreach"] = not loop
        for _ in range(2):
            actor.train_step(batch, lm_loss)
        params.append({k: v.detach().clone() for k, v in actor.parameters().items()})
    start = first.parameters()
    return {"built": built, "loaded": loaded[0],
            "same": all(torch.equal(params[0][k], params[1][k]) for k in params[0]),
            "moved": sum(not torch.equal(params[0][k], start[k]) for k in start)}


def non_finite_step(overrides: list[str], poisoned_rank: int) -> dict:
    """A train step whose loss is NaN on one rank only, then a clean one: what each reports
    and whether the weights moved."""
    import dataclasses

    actor = make_actor(overrides)
    start = {k: v.detach().clone() for k, v in actor.parameters().items()}

    def poisoned(logprobs, entropy, mb):
        out = lm_loss(logprobs, entropy, mb)
        if dist.get_rank() == poisoned_rank:
            return dataclasses.replace(out, loss_sum=out.loss_sum * float("nan"))
        return out

    batch = fixed_batch()
    bad = actor.train_step(batch, poisoned)
    after_bad = actor.parameters()
    unchanged = all(torch.equal(start[k], after_bad[k]) for k in start)
    good = actor.train_step(batch, lm_loss)
    after = actor.parameters()
    return {"bad": bad, "unchanged": unchanged, "good": good,
            "finite": all(bool(torch.isfinite(v).all()) for v in after.values()),
            "moved": sum(not torch.equal(start[k], after[k]) for k in start),
            "optimizer_steps": actor.optimizer_steps}

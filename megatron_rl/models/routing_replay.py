"""MoE routing replay (R3): the trainer sends each token to the experts the rollout engine chose.

The engine reports, for every token it was fed, the top-k expert ids of each MoE layer (SGLang's
`return_routed_experts`). A `TokenBatch` carries them as `extras["routed_experts"]`, shaped
[rows, seq, layers, top_k] (or [rows, seq, layers * top_k]) and aligned with `input_ids`; a
token the engine never saw (the last sampled token, a trailing observation, padding) has -1
ids and is routed as the model itself would route it.

megatron-core's `RouterReplay` (built when `TransformerConfig.moe_enable_routing_replay`) makes
each `TopKRouter` take given top-k indices instead of its own top-k; the routing probabilities
are still the router's own scores gathered at those indices, so the router keeps its gradient.
`RoutingReplay` finds this model's routers (not the process-wide list, which holds every model
ever built in the process), maps the batch's routing onto each router's local tokens (megatron's
[seq, batch] order, the TP rank's sequence chunk under sequence parallelism; expert parallelism
needs nothing: router logits cover all experts on every rank) and sets them for one forward.
For activation recomputation in backward (where a later micro-batch's forward may have run in
between, with pipelining) the same routing is set again when backward reaches the micro-batch's
output.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch


def moe_layer_index(config: Any, layer_number: int) -> int:
    """0-based index among the MoE layers of the 1-based global decoder `layer_number`."""
    freq = config.moe_layer_freq
    pattern = ([1 if i % freq == 0 else 0 for i in range(config.num_layers)]
               if isinstance(freq, int) else list(freq))
    return sum(pattern[:layer_number - 1])


def num_moe_layers(config: Any) -> int:
    return moe_layer_index(config, config.num_layers + 1)


def _replay_topk(self: Any, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                 group_topk: int | None = None, default_compute_topk: Callable | None = None):
    """`RouterReplay.get_replay_topk` for REPLAY_FORWARD where a row of -1 ids is routed by
    the router's own top-k (megatron's version needs ids for every token)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
        return RouterReplay.get_replay_topk(self, scores, topk, num_groups, group_topk,
                                            default_compute_topk)
    target = self.target_topk_idx.to(scores.device)
    if target.shape != (scores.shape[0], topk):
        raise ValueError(f"routing replay (layer {self.layer_number}): {tuple(target.shape)} "
                         f"expert ids for {scores.shape[0]} tokens x top-{topk}")
    missing = (target < 0).any(-1, keepdim=True)
    if bool(missing.any()):
        _, natural = default_compute_topk(scores, topk, num_groups=num_groups,
                                          group_topk=group_topk)
        target = torch.where(missing, natural, target)
    return scores.gather(1, target), target


class RoutingReplay:
    """Routes the forwards of one model (its pipeline stage's chunks) by given expert ids."""

    def __init__(self, chunks: list[torch.nn.Module], config: Any):
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router import TopKRouter

        if not config.moe_enable_routing_replay:
            raise ValueError("routing replay needs a model built with moe_enable_routing_replay")
        if config.context_parallel_size > 1:
            raise NotImplementedError("routing replay with context parallelism")
        self.topk = config.moe_router_topk
        self.num_layers = num_moe_layers(config)
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.sequence_parallel = bool(config.sequence_parallel)
        # (MoE layer index, its RouterReplay); MTP layers have no engine routing: left natural
        self.routers: list[tuple[int, Any]] = []
        for chunk in chunks:
            for name, m in chunk.named_modules():
                if isinstance(m, TopKRouter) and m.router_replay is not None and (
                        "mtp." not in name):
                    replay = m.router_replay
                    replay.get_replay_topk = types.MethodType(_replay_topk, replay)
                    self.routers.append((moe_layer_index(config, m.layer_number), replay))

    def targets(self, routed: torch.Tensor) -> list[torch.Tensor]:
        """Per router, its tokens' expert ids [local tokens, top_k] from a micro-batch's
        [b, s, layers(, top_k)] routing, in megatron's [s, b] token order."""
        b, s = routed.shape[:2]
        if routed[0, 0].numel() != self.num_layers * self.topk:
            raise ValueError(f"routed experts: {tuple(routed.shape[2:])} ids per token; the "
                             f"model has {self.num_layers} MoE layers x top-{self.topk}")
        r = routed.reshape(b, s, self.num_layers, self.topk).transpose(0, 1).long()
        if self.sequence_parallel and self.tp > 1:  # the router sees this rank's chunk of s
            chunk = s // self.tp
            r = r[self.tp_rank * chunk:(self.tp_rank + 1) * chunk]
        return [r[:, :, layer].reshape(-1, self.topk) for layer, _ in self.routers]

    def set(self, routed: torch.Tensor | None) -> Callable[..., None] | None:
        """Route the next forward by `routed` (None: the model's own routing). Returns a
        callable that sets the same routing again (for recomputation in backward)."""
        if routed is None:
            self.clear()
            return None
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        targets = self.targets(routed)

        def apply(*_: Any) -> None:
            for (_, replay), target in zip(self.routers, targets, strict=True):
                replay.target_topk_idx = target
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

        apply()
        return apply

    def clear(self) -> None:
        for _, replay in self.routers:
            replay.clear_indices()
            replay.clear_router_replay_action()

"""Job bodies for the micro-batching tests (run inside the worker pools)."""

from __future__ import annotations

import dataclasses

import torch

from megatron_rl.algorithms.policy_loss import PolicyLossConfig, make_policy_loss_fn
from megatron_rl.checkpoint.training_checkpoint import load_checkpoint, save_checkpoint
from megatron_rl.config.loader import load_config
from megatron_rl.models.registry import get_model_spec
from megatron_rl.records.batch import ADVANTAGES, OLD_LOGPROBS, TokenBatch
from megatron_rl.trainer import microbatching
from megatron_rl.trainer.actor import MegatronActor
from megatron_rl.trainer.losses import lm_loss
from tests import dist_cases

SEQ = 64
# heavy-tailed: one full-length row, a few medium, many short; row 5 trains nothing
LENGTHS = [64, 9, 40, 3, 17, 0, 25, 6, 50, 12, 4, 31]
PROMPT = 2  # the first targets of every row are prompt (not trained)
# ... but these rows open with the same SHARED_PROMPT untrained tokens (a role's system prompt)
SHARED_ROWS, SHARED_PROMPT = (0, 2, 6, 8, 11), 20
MODES = {
    "fixed": {},
    "budget": {"max_tokens_per_microbatch": 64},
    "packed": {"max_tokens_per_microbatch": 96, "pack_sequences": True},
    "shared": {"max_tokens_per_microbatch": 96, "pack_sequences": True,
               "share_prefixes": True},
}
AGG = [PolicyLossConfig(loss_agg_mode=m) for m in
       ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")]
AGG.append(PolicyLossConfig(ratio_level="sequence", loss_agg_mode="seq-mean-token-mean"))


def rl_batch(lengths=tuple(LENGTHS), seq: int = SEQ, vocab: int = 512, seed: int = 11
             ) -> TokenBatch:
    """Right-padded rows of the given lengths (inputs), prompt targets masked, advantages
    and made-up old log-probs as extras; -1 routing where the extras say 'not routed'."""
    g = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    tokens = torch.zeros(rows, seq + 1, dtype=torch.long)
    mask = torch.zeros(rows, seq + 1)
    adv = torch.zeros(rows, seq + 1)
    for i, n in enumerate(lengths):
        tokens[i, :n + 1] = torch.randint(1, vocab, (n + 1,), generator=g)
        prompt = SHARED_PROMPT if i in SHARED_ROWS else PROMPT
        if i in SHARED_ROWS:
            tokens[i, :prompt] = tokens[SHARED_ROWS[0], :prompt]
        mask[i, prompt + 1:n + 1] = 1.0
        adv[i, :n + 1] = float(torch.randn((), generator=g))
    batch = TokenBatch.from_sequences(tokens, mask, **{ADVANTAGES: adv})
    batch.extras[OLD_LOGPROBS] = -6.0 + 0.05 * torch.randn(rows, seq, generator=g)
    return batch


def make_actor(overrides: list[str], mode: str, spec: dict | None = None,
               model: str = "tiny-moe") -> MegatronActor:
    """`spec`: registry values to override (the MoE aux loss and MTP loss cover padding, so
    they differ with the padding by design; comparisons switch them off)."""
    cfg = load_config(None, [*dist_cases.BASE, f"model.name={model}", f"model.seq_length={SEQ}",
                             "train.global_batch_size=12", *overrides])
    for key, value in MODES[mode].items():  # works before and after the schema has the fields
        setattr(cfg.train, key, value)
    return MegatronActor(cfg, dataclasses.replace(get_model_spec(model), **(spec or {})))


def save_initial(folder: str, model: str = "tiny-moe", spec: dict | None = None) -> None:
    save_checkpoint(make_actor([], "fixed", spec, model), folder)


NO_AUX = {"router_aux_loss_coef": 0.0}


def compare_modes(overrides: list[str], init: str, spec: dict | None = NO_AUX,
                  modes: tuple[str, ...] = tuple(MODES), model: str = "tiny-moe") -> dict:
    """Per batching mode, from the same weights: log-probs and entropy, the policy loss under
    every aggregation mode, one optimizer step (loss, grad norm) and the log-probs after it."""
    from megatron_rl.models.layer_specs import torch_sdpa_attention

    attention = torch_sdpa_attention()
    per_sequence = attention._per_sequence
    out = {}
    for mode in modes:
        calls: list[int] = []  # packed rows attended sequence by sequence, not masked

        def counted(self, *args, _calls=calls):
            _calls.append(1)
            return per_sequence(self, *args)

        attention._per_sequence = counted
        try:
            res = _one_mode(overrides, mode, spec, model, init)
        finally:
            attention._per_sequence = per_sequence
        out[mode] = {**res, "sequence_attention_calls": len(calls)}
    return out


def _one_mode(overrides: list[str], mode: str, spec: dict | None, model: str, init: str
              ) -> dict:
    actor = make_actor(overrides, mode, spec, model)
    load_checkpoint(actor, init, optimizer=False, rng=False)
    batch = rl_batch()
    lp, ent = actor.compute_logprobs(batch)
    evals = [actor.evaluate(batch, make_policy_loss_fn(c))["loss"] for c in AGG]
    step = actor.train_step(batch, make_policy_loss_fn(AGG[2]))
    lm = actor.train_step(batch, lm_loss)
    after, _ = actor.compute_logprobs(batch)
    micro = actor._micro_batches(batch)
    return {"logprobs": lp, "entropy": ent, "evals": evals, "loss": step["loss"],
            "grad_norm": step["grad_norm"], "num_tokens": step["num_tokens"],
            "lm_loss": lm["loss"], "lm_grad_norm": lm["grad_norm"], "after": after,
            "pack": actor.pack, "budget": actor.token_budget,
            "logged": sorted(microbatching._LOGGED),
            "micro": [tuple(mb.input_ids.shape) for mb in micro],
            "tokens": sum(int(getattr(mb, "valid", mb.loss_mask).sum()) for mb in micro),
            "seqs_per_row": max((int(getattr(mb, "segments", None).max()) + 1
                                 if getattr(mb, "segments", None) is not None else 1)
                                for mb in micro)}


def replay_modes(overrides: list[str], init: str, modes: tuple[str, ...] = ("fixed", "packed")
                 ) -> dict:
    """MoE routing replay with packed extras: log-probs replaying a made-up routing (top-2 of
    4 experts per token and layer; -1 past each row = routed naturally) and without it, and
    one training step's loss and grad norm under replay."""
    from megatron_rl.records.batch import ROUTED_EXPERTS

    g = torch.Generator().manual_seed(3)
    batch = rl_batch()
    routed = torch.rand(batch.rows, SEQ, 2, 4, generator=g).argsort(-1)[..., :2]
    lengths = microbatching.effective_lengths(batch)
    routed[torch.arange(SEQ) >= lengths.unsqueeze(1)] = -1
    out = {}
    for mode in modes:
        actor = make_actor(["rl.routing_replay=true", *overrides], mode, NO_AUX)
        load_checkpoint(actor, init, optimizer=False, rng=False)
        natural, _ = actor.compute_logprobs(batch)
        batch.extras[ROUTED_EXPERTS] = routed
        replayed, _ = actor.compute_logprobs(batch)
        step = actor.train_step(batch, make_policy_loss_fn(AGG[0]))
        del batch.extras[ROUTED_EXPERTS]
        out[mode] = {"natural": natural, "replayed": replayed, "loss": step["loss"],
                     "grad_norm": step["grad_norm"], "pack": actor.pack}
    return out


def fallback_attention_masks(init: str) -> dict:
    """A packed micro-batch through one layer's attention: the masks megatron's own attention
    got, spans path (no dropout) then its fallback (attention dropout while training), and
    whether the latter was the micro-batch's dense mask."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    actor = make_actor([], "shared")
    load_checkpoint(actor, init, optimizer=False, rng=False)
    mb = next(m for m in actor._micro_batches(rl_batch()) if m.packed)
    attention = actor.model[0].module.decoder.layers[0].self_attention.core_attention
    got: list[torch.Tensor] = []
    parent = DotProductAttention.forward

    def spy(self, query, key, value, attention_mask, *args, **kwargs):
        got.append(attention_mask)
        return parent(self, query, key, value, attention_mask, *args, **kwargs)

    s, b = mb.input_ids.shape[1], mb.input_ids.shape[0]
    heads = attention.num_attention_heads_per_partition
    dim = attention.hidden_size_per_attention_head
    groups = attention.num_query_groups_per_partition
    q = torch.randn(s, b, heads, dim)
    k, v = torch.randn(s, b, groups, dim), torch.randn(s, b, groups, dim)
    DotProductAttention.forward = spy
    try:
        attention.train()
        attention.forward(q, k, v, mb.attention_mask())
        spans_path = len(got)
        attention.attention_dropout.p = 0.1
        out = attention.forward(q, k, v, mb.attention_mask())
    finally:
        DotProductAttention.forward = parent
        attention.attention_dropout.p = 0.0
    return {"spans_path_parent_calls": spans_path, "fallback_calls": len(got) - spans_path,
            "dense": bool(torch.equal(got[-1], mb.dense_attention_mask())),
            "out_shape": tuple(out.shape), "expected": (s, b, heads * dim)}

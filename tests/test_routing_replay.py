"""MoE routing replay (R3): the engine reports its routing, the trainer replays it.

Engine: the embedded engine's routed experts (prompt + generated, through KV-cached decode of
a left-padded batch) are the top-k of the router logits of a plain forward. Trainer: replaying
the natural routing changes nothing, a different routing changes the log-probs, and replay
gives the same numbers at EP2 and TP2 (sequence parallel) as at one process, in training too.
End to end: agent → trajectory → batch → trainer, with engine and trainer sharing weights.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.agents import ReActAgent
from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
from megatron_rl.algorithms.rdpo import SequenceAdvantages
from megatron_rl.checkpoint.convert import export_hf
from megatron_rl.engines.base import GenerateRequest, SamplingParams
from megatron_rl.engines.embedded import EmbeddedServer
from megatron_rl.engines.http_client import HttpEngine
from megatron_rl.models.registry import get_model_spec
from megatron_rl.records.batch import ROLLOUT_LOGPROBS, ROUTED_EXPERTS
from megatron_rl.records.trajectory import Trajectory, Turn
from megatron_rl.trainer.batching import build_batch
from tests import dist_cases, routing_cases
from tests.fakes import agent_config
from tests.pools import get_pool

TOL = 1e-5
LAYOUT = (2, 2)  # tiny-moe: MoE layers, top-k
E2E_SEQ = routing_cases.E2E_SEQ


def same_experts(a, b) -> bool:
    a, b = torch.as_tensor(np.asarray(a)), torch.as_tensor(np.asarray(b))
    return a.shape == b.shape and torch.equal(a.sort(-1).values, b.sort(-1).values)


# -- engine -----------------------------------------------------------------------------------

def test_engine_routing_is_the_routers_top_k_through_batched_decode():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(get_model_spec("tiny-moe").hf_config()).eval()
    prompts = [[5, 17, 33, 2, 99, 100, 7], [301, 4, 88], [12, 250, 251, 9, 10, 11, 400, 3, 2]]

    async def generate(url: str):
        async with HttpEngine(url, moe_layout=LAYOUT) as eng:
            return await asyncio.gather(*[eng.generate(GenerateRequest(
                f"r{i}", p, SamplingParams(max_new_tokens=5 + i, ignore_eos=True, seed=i),
                return_routed_experts=True)) for i, p in enumerate(prompts)])

    with EmbeddedServer(model).start() as server:
        results = asyncio.run(generate(server.url))
        assert server.core.max_running > 1  # decoded as one left-padded batch
    for prompt, res in zip(prompts, results, strict=True):
        fed = prompt + res.output_ids[:-1]
        assert res.routed_experts.shape == (len(fed), *LAYOUT)
        with torch.no_grad():
            logits = model(torch.tensor([fed]), output_router_logits=True).router_logits
        expected = np.stack([torch.topk(r, LAYOUT[1], -1).indices.numpy() for r in logits], 1)
        assert same_experts(res.routed_experts, expected)


# -- trajectory and batch -----------------------------------------------------------------------

def _routing(n: int, base: int) -> list:
    return [[[(base + t) % 4, (base + t + 1) % 4]] * 2 for t in range(n)]


def test_sequences_take_each_tokens_routing_from_the_latest_turn_that_fed_it():
    t1 = Turn("agent", [1, 2, 3], [10, 11], [-0.5] * 2, [0] * 2, [90, 91],
              routed_experts=_routing(4, 0))
    # the second call re-fed the whole context (and routed its first tokens differently)
    t2 = Turn("agent", [1, 2, 3, 10, 11, 90, 91], [12, 13], [-0.5] * 2, [0] * 2,
              routed_experts=_routing(8, 1))
    traj = Trajectory("u", "g", "q", turns=[t1, t2])
    (seq,) = traj.sequences()
    assert len(seq.routed_experts) == len(seq.tokens) == 9
    assert seq.routed_experts[:8] == _routing(8, 1) and seq.routed_experts[8] is None
    back = Trajectory.from_dict(json.loads(json.dumps(traj.to_dict())))
    assert back == traj and back.sequences()[0].routed_experts == seq.routed_experts
    # a turn without routing: the sequence has none
    assert Trajectory("u", "g", "q", turns=[t1, Turn("agent", [7], [8], [0.0], [0])]
                      ).sequences()[0].routed_experts is None
    with pytest.raises(ValueError, match="routed experts for 3 tokens; it fed 4"):
        Turn("agent", [1, 2, 3], [10, 11], [0.0] * 2, [0] * 2, routed_experts=_routing(3, 0))

    adv = SequenceAdvantages(np.zeros(9), np.array(seq.loss_mask))
    batch = build_batch([seq, seq], [adv, adv], seq_length=12, pad_id=0, rows_multiple=4)
    routed = batch.extras[ROUTED_EXPERTS]
    assert routed.shape == (4, 12, *LAYOUT) and routed.dtype == torch.long
    # aligned with the inputs: input t is token t
    assert routed[0, :8].tolist() == _routing(8, 1)
    assert (routed[0, 8:] == -1).all() and (routed[2:] == -1).all()
    assert batch.input_ids[0, :9].tolist() == seq.tokens


# -- trainer replay -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    init = str(tmp_path_factory.mktemp("r3") / "init")
    pool = get_pool(1)
    pool.run(dist_cases.save_initial, init, [f"model.seq_length={routing_cases.SEQ}"])
    ref = pool.run(routing_cases.replay_reference, init)[0]
    routings = {"natural": ref["natural"], "shifted": ref["shifted"]}
    step = pool.run(routing_cases.replay_layout, [], init, routings)[0]
    return init, ref, routings, step


def test_replay_at_one_process(reference):
    _, ref, _, step = reference
    lp = ref["lp"]
    assert ref["natural"].shape == (4, routing_cases.SEQ, *LAYOUT)
    assert same_experts(ref["used_natural"], ref["natural"])
    assert same_experts(ref["used_shifted"], ref["shifted"])
    assert same_experts(ref["used_half"], ref["natural"])  # -1 rows: the router's own choice
    assert (ref["lp_natural"] - lp).abs().max() <= 1e-6
    assert (ref["lp_half"] - lp).abs().max() <= 1e-6
    moved = (ref["lp_shifted"] - lp).abs().max()
    print(f"\nmax |log-prob change| under a shifted routing: {moved:.3f}; replayed step: "
          f"loss {step['loss']:.6f}, grad norm {step['grad_norm']:.6f}")
    assert moved > 1e-2
    assert step["grad_norm"] > 0


@pytest.mark.gpu  # megatron's activation checkpointing saves the CUDA RNG state
@pytest.mark.parametrize("world,layout", [(1, []), (2, ["parallel.pp=2"])])
def test_replay_survives_activation_recomputation(world, layout, reference):
    """Recomputation in backward routes each micro-batch by its own routing, also when the
    pipeline ran a later micro-batch's forward in between (1F1B at PP2)."""
    init, _, routings, step = reference
    for got in get_pool(world).run(routing_cases.replay_layout,
                                   ["model.recompute_activations=true", *layout], init,
                                   routings):
        for key in ("loss", "grad_norm"):
            assert got[key] == pytest.approx(step[key], rel=TOL), (layout, key)


@pytest.mark.parametrize("layout", [["parallel.ep=2"], ["parallel.tp=2"]])
def test_two_ranks_replay_like_one(layout, reference):
    init, ref, routings, step = reference
    for got in get_pool(2).run(routing_cases.replay_layout, layout, init, routings):
        assert (got["lp_natural"] - ref["lp"]).abs().max() <= TOL, layout
        assert (got["lp_shifted"] - ref["lp_shifted"]).abs().max() <= TOL, layout
        for key in ("loss", "grad_norm"):
            assert abs(got[key] - step[key]) <= TOL * max(1.0, abs(step[key])), (layout, key)


# -- end to end -----------------------------------------------------------------------------------

def _rollout_batch(url: str, episodes: int = 2):
    tok = tiny_qwen3_tokenizer(vocab_size=get_model_spec("tiny-moe").vocab_size)
    agent = ReActAgent(tok, [], agent_config(
        max_turns=1, max_context_tokens=E2E_SEQ, max_continuations=2, degenerate_check=None,
        sampling=SamplingParams(max_new_tokens=8), return_routed_experts=True),
        system_prompt="Answer.")

    async def run():
        async with HttpEngine(url, moe_layout=LAYOUT) as eng:
            return [await agent.run("Capital of France?", "Paris", eng, group_id="g",
                                    uid=f"u{i}") for i in range(episodes)]

    trajs = asyncio.run(run())
    seqs = [s for t in trajs for s in t.sequences()]
    assert all(t.routed_experts is not None for tr in trajs for t in tr.turns)
    adv = [SequenceAdvantages(np.zeros(len(s.tokens)), np.array(s.loss_mask)) for s in seqs]
    return trajs, build_batch(seqs, adv, seq_length=E2E_SEQ, pad_id=0)


def test_end_to_end_trainer_replays_the_engines_routing(reference, tmp_path):
    init = reference[0]
    hf = tmp_path / "hf"
    export_hf(init, str(hf), "tiny-moe", progress=False)
    with EmbeddedServer.from_pretrained(str(hf)).start() as server:
        trajs, same = _rollout_batch(server.url)
        # the engine's routers drift from the trainer's (e.g. a stale or low-precision copy)
        g = torch.Generator().manual_seed(3)
        gates = [(n, t + 0.3 * torch.randn(t.shape, generator=g))
                 for n, t in load_file(hf / "model.safetensors").items() if "mlp.gate." in n]

        async def perturb():
            async with HttpEngine(server.url) as eng:
                await eng.update_weights_from_tensors(gates, 1)

        asyncio.run(perturb())
        _, drifted = _rollout_batch(server.url)
    assert len(trajs[0].turns) >= 1
    results = get_pool(1).run(routing_cases.engine_batches, init, [same, drifted])[0]
    report = []
    for name, batch, r in zip(("same weights", "drifted routers"), (same, drifted), results,
                              strict=True):
        engine = batch.extras[ROUTED_EXPERTS]
        fed = (engine >= 0).all(-1)  # [rows, seq, layers]
        assert fed.any()
        # the replayed routing is the engine's, token by token and layer by layer
        assert same_experts(r["used"][fed], engine[fed])
        agree = (r["natural"].sort(-1).values == engine.sort(-1).values).all(-1)[fed]
        mask = batch.loss_mask.bool()
        rollout = batch.extras[ROLLOUT_LOGPROBS]
        err = {k: (r[k] - rollout)[mask].abs() for k in ("lp_replay", "lp_natural")}
        report.append(f"{name}: natural routing agrees on {agree.float().mean():.1%}; "
                      f"|trainer - engine| log-prob mean/max with replay "
                      f"{err['lp_replay'].mean():.2e}/{err['lp_replay'].max():.2e}, "
                      f"without {err['lp_natural'].mean():.2e}/{err['lp_natural'].max():.2e}")
        r.update(agree=agree, err=err)
    print("\n" + "\n".join(report))
    same_r, drift_r = results
    assert same_r["agree"].all()  # one expert numbering on both sides
    assert same_r["err"]["lp_replay"].max() <= same_r["err"]["lp_natural"].max() + 1e-6
    assert same_r["err"]["lp_replay"].max() <= TOL
    assert not drift_r["agree"].all()
    assert drift_r["err"]["lp_replay"].mean() < drift_r["err"]["lp_natural"].mean()

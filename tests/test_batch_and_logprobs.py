from __future__ import annotations

import pytest
import torch

from megatron_rl.data.synthetic import ArithmeticSequences
from megatron_rl.models.logprobs import chunked_logprobs
from megatron_rl.records.batch import TokenBatch


def test_token_batch_shapes_and_errors():
    tokens = torch.arange(20).view(2, 10)
    b = TokenBatch.from_sequences(tokens)
    assert b.input_ids.shape == (2, 9) and torch.equal(b.labels, tokens[:, 1:])
    assert b.loss_mask.dtype == torch.float32 and b.position_ids[1, 3] == 3
    with pytest.raises(ValueError, match=r"TokenBatch.labels has shape \(2, 8\)"):
        TokenBatch(b.input_ids, b.labels[:, :8], b.loss_mask)
    with pytest.raises(ValueError, match="extras\\['adv'\\]"):
        TokenBatch(b.input_ids, b.labels, b.loss_mask, extras={"adv": torch.zeros(3, 9)})
    with pytest.raises(ValueError, match="does not split over 4 DP ranks"):
        b.shard(0, 4)
    parts = TokenBatch.from_sequences(torch.arange(40).view(4, 10)).shard(1, 2).micro_batches(1)
    assert [p.input_ids[0, 0].item() for p in parts] == [20, 30]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_match_log_softmax_with_padded_vocab(monkeypatch, temperature):
    """The fused chunked path against autograd through log_softmax: values and the gradients
    of hidden states and output weights, with two padded vocabulary rows and chunks of 4."""
    from megatron.core import parallel_state as ps

    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
    g = torch.Generator().manual_seed(0)
    vocab, padded, seq, batch, h = 50, 52, 6, 3, 8
    hidden = torch.randn(seq, batch, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(padded, h, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    weigh_lp, weigh_ent = torch.rand(batch, seq, generator=g), torch.rand(batch, seq, generator=g)
    logp, ent = chunked_logprobs(hidden, weight, labels, vocab_size=vocab,
                                 sequence_parallel=False, temperature=temperature,
                                 chunk_tokens=4)
    z = (hidden.transpose(0, 1) @ weight[:vocab].T).float() / temperature
    ref = torch.log_softmax(z, -1)
    ref_logp = ref.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(ref.exp() * ref).sum(-1)
    assert logp.dtype == torch.float32 and logp.shape == labels.shape
    assert (logp - ref_logp).abs().max() < 1e-5 and (ent - ref_ent).abs().max() < 1e-5
    grads = [torch.autograd.grad((lp * weigh_lp).sum() + (e * weigh_ent).sum(), (hidden, weight),
                                 retain_graph=True)
             for lp, e in ((logp, ent), (ref_logp, ref_ent))]
    for got, want in zip(grads[0], grads[1], strict=True):
        assert (got - want).abs().max() < 1e-5 and want.abs().max() > 1e-2
    assert grads[0][1][vocab:].abs().max() == 0  # padded ids get no gradient
    # entropy unused (its gradient is None): the log-prob gradient alone
    g_lp = torch.autograd.grad((chunked_logprobs(hidden, weight, labels, vocab_size=vocab,
                                                 sequence_parallel=False,
                                                 temperature=temperature)[0] * weigh_lp).sum(),
                               hidden)[0]
    want = torch.autograd.grad((ref_logp * weigh_lp).sum(), hidden)[0]
    assert (g_lp - want).abs().max() < 1e-5


def test_synthetic_stream_is_deterministic_and_learnable():
    data = ArithmeticSequences(vocab_size=64, seq_length=8, seed=3)
    assert torch.equal(data.batch(5, 2).input_ids, data.batch(5, 2).input_ids)
    seq = data.sample(11)
    strides = (seq[1:] - seq[:-1]) % 64
    assert len(set(strides.tolist())) == 1 and 1 <= strides[0] <= data.max_stride


def test_trained_positions_only_give_the_same_logprobs_and_gradients(monkeypatch):
    """`keep`: only the trained positions go through the output layer; the loss over them and
    its gradients are those of the full computation, the other positions are 0."""
    from megatron.core import parallel_state as ps


    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
    g = torch.Generator().manual_seed(0)
    seq, batch, h, vocab = 7, 3, 8, 50
    hidden = torch.randn(seq, batch, h, generator=g, requires_grad=True)
    weight = torch.randn(vocab, h, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    keep = torch.rand(batch, seq, generator=g) > 0.5
    keep[2] = False  # a row with nothing trained
    results = []
    for k in (None, keep):
        lp, ent = chunked_logprobs(hidden, weight, labels, vocab_size=vocab,
                                   sequence_parallel=False, chunk_tokens=4, keep=k)
        loss = -(lp * keep).sum() + (ent * keep).sum() * 0.1
        gh, gw = torch.autograd.grad(loss, (hidden, weight))
        results.append((lp.detach(), ent.detach(), gh, gw))
    (lp_all, ent_all, gh_all, gw_all), (lp_k, ent_k, gh_k, gw_k) = results
    assert torch.allclose(lp_k[keep], lp_all[keep], atol=1e-6)
    assert torch.allclose(ent_k[keep], ent_all[keep], atol=1e-6)
    assert (lp_k[~keep] == 0).all() and (ent_k[~keep] == 0).all()
    assert torch.allclose(gh_k, gh_all, atol=1e-6) and torch.allclose(gw_k, gw_all, atol=1e-6)
    assert gh_k.abs().sum() > 0
    # nothing kept at all: zeros that backward still goes through
    lp, ent = chunked_logprobs(hidden, weight, labels, vocab_size=vocab,
                               sequence_parallel=False, keep=torch.zeros_like(keep))
    assert lp.shape == labels.shape and not lp.any()
    (lp.sum() + ent.sum()).backward()


def test_bf16_matmuls_keep_fp32_tensors_and_bf16_accuracy(monkeypatch):
    """`matmul_dtype=bf16` for an fp32 model: log-probs, entropy and both gradients stay fp32
    and within bf16 rounding of the fp32 results (not equal to them: the matmuls did change)."""
    from megatron.core import parallel_state as ps

    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
    g = torch.Generator().manual_seed(0)
    seq, batch, h, vocab = 16, 4, 32, 300
    hidden = torch.randn(seq, batch, h, generator=g, requires_grad=True)
    weight = (torch.randn(vocab + 4, h, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    out = {}
    for dt in (None, torch.bfloat16):
        lp, ent = chunked_logprobs(hidden, weight, labels, vocab_size=vocab,
                                   sequence_parallel=False, chunk_tokens=24, matmul_dtype=dt)
        gh, gw = torch.autograd.grad(-lp.sum() - 0.1 * ent.sum(), (hidden, weight))
        out[dt] = (lp, ent, gh, gw)
    for want, got in zip(out[None], out[torch.bfloat16], strict=True):
        assert got.dtype == torch.float32 and got.shape == want.shape
        rel = ((got - want).norm() / want.norm()).item()
        assert 1e-6 < rel < 2e-2, rel
    assert out[torch.bfloat16][3][vocab:].abs().max() == 0  # padded ids: no gradient


@pytest.mark.parametrize("temperature", [1.0, 0.4])
def test_row_blocks_and_kept_logits_give_the_same_values_bit_for_bit(monkeypatch, temperature):
    """The softmax's passes over row blocks (a lone tail row folded into the block before it)
    and logits kept for backward instead of recomputed: log-probs, entropy and both
    gradients are exactly those of one block over the whole chunk, recomputed."""
    from megatron_rl.models import logprobs, memory_plan

    g = torch.Generator().manual_seed(0)
    n, vocab, pad = 37, 34048, 40  # 37 rows: blocks of 4 leave a lone row at the end
    h0, w0 = torch.randn(n, 32, generator=g), torch.randn(vocab + pad, 32, generator=g) * 0.3
    labels = torch.randint(0, vocab, (n,), generator=g)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def run(block_bytes: int, keep_bytes: int) -> list[torch.Tensor]:
        monkeypatch.setattr(logprobs, "BLOCK_BYTES", block_bytes)
        monkeypatch.setattr(memory_plan, "KEEP_LOGITS_BYTES", {"cpu": keep_bytes, "cuda": 0})
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        lp, ent = logprobs._LinearLogprobs.apply(h, w, labels, 0, vocab, temperature, None, 1)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        return [lp.detach(), ent.detach(), h.grad, w.grad]

    whole = run(1 << 40, 0)
    for block_bytes in (4 * 4 * vocab, 4 * 7 * vocab):
        for keep in (0, 1 << 40):
            got = run(block_bytes, keep)
            assert all(torch.equal(a, b) for a, b in zip(got, whole, strict=True))
    # kept logits become the gradient in place: a second backward is refused, not wrong
    monkeypatch.setattr(memory_plan, "KEEP_LOGITS_BYTES", {"cpu": 1 << 40, "cuda": 0})
    lp, _ = logprobs._LinearLogprobs.apply(h0.clone().requires_grad_(), w0, labels, 0, vocab,
                                           temperature, None, 1)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()
    monkeypatch.setattr(logprobs, "BLOCK_BYTES", 4 * 4 * vocab)  # 4 rows a block
    assert logprobs._row_cuts(9, vocab) == [4]  # blocks 0-3 and 4-8: no lone 9th row
    assert logprobs._row_cuts(10, vocab) == [4, 8]
    assert logprobs._row_cuts(9, 1) == []


def test_a_batch_fits_its_longest_sequence_rounded_to_the_trainers_multiple():
    from megatron_rl.algorithms.rdpo import token_advantages
    from megatron_rl.algorithms.reward_managers import turn_advantages
    from megatron_rl.trainer.batching import build_batch
    from tests.rl_cases import SEQ, group_of_rollouts

    trajs = group_of_rollouts()  # 20, 22, 24 and 26 tokens
    adv, _ = turn_advantages("grpo", trajs)
    seqs = [t.sequences()[0] for t in trajs]
    per_token = [token_advantages([s], a)[0] for s, a in zip(seqs, adv, strict=True)]
    full = build_batch(seqs, per_token, seq_length=SEQ, pad_id=0, rows_multiple=2)
    assert full.seq_length == SEQ
    for multiple, inputs in ((None, SEQ), (1, 25), (4, 28), (8, 32), (64, SEQ)):
        fit = build_batch(seqs, per_token, seq_length=SEQ, pad_id=0, rows_multiple=2,
                          fit_multiple=multiple)
        assert fit.seq_length == inputs and fit.rows == full.rows
        for name in ("input_ids", "labels", "loss_mask"):
            assert torch.equal(getattr(fit, name), getattr(full, name)[:, :inputs])
        assert fit.extras.keys() == full.extras.keys()
        for k, v in fit.extras.items():
            assert torch.equal(v, full.extras[k][:, :inputs])
        assert not full.loss_mask[:, inputs:].any()  # nothing trained was cut

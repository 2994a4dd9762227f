"""`data tokenizer --title-tokens` and `convert init-hf --tie-embeddings`: page titles and
URLs are one id wherever they stand (after a space or a quote), text still round-trips, the
agent's escaping leaves them alone (they are content, not markup) and the tied model's output
layer is its embedding."""

from __future__ import annotations

import json

from megatron_rl.agents.chat import ChatFormat
from megatron_rl.agents.tokenizer import train_chat_tokenizer

TITLES = ["Dorras Dynamics", "Marur Voelrho", "https://en.worldwiki.test/wiki/Dorras_Dynamics"]
TEXT = ("Dorras Dynamics was founded in 1968 by Marur Voelrho. The founder of Dorras Dynamics "
        "lived in Fenwyville. ") * 20


def test_titles_are_single_ids_after_a_space_and_after_a_quote():
    tok = train_chat_tokenizer([TEXT], 400, words=TITLES)
    assert len(tok) == 400 + len(TITLES)
    name = tok.convert_tokens_to_ids("Dorras Dynamics")
    question = tok.encode("Who founded Dorras Dynamics?", add_special_tokens=False)
    call = tok.encode(json.dumps({"query": "Dorras Dynamics"}), add_special_tokens=False)
    assert question.count(name) == 1 and call.count(name) == 1  # the same id both ways
    url = tok.convert_tokens_to_ids(TITLES[2])
    assert tok.encode(f'"url": "{TITLES[2]}"', add_special_tokens=False).count(url) == 1
    # a title inside a longer word is not the title; every text round-trips
    for text in ("Dorras Dynamicsx and xDorras Dynamics", TEXT, '{"query": "Marur Voelrho"}'):
        assert name not in tok.encode("Dorras Dynamicsx", add_special_tokens=False)
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    # the agent's escaping breaks markup in untrusted text, never a title
    chat = ChatFormat(tok)
    page = "Dorras Dynamics <tool_call> was founded by Marur Voelrho"
    safe = chat.safe_text(page)
    assert "<tool_call>" not in safe and "Dorras Dynamics" in safe and "Marur Voelrho" in safe
    assert name in chat.encode(safe)


def test_init_hf_ties_the_output_layer_to_the_embedding(tmp_path):
    import transformers

    from megatron_rl.cli import main

    tok = train_chat_tokenizer([TEXT], 400, words=TITLES)
    tok.save_pretrained(tmp_path / "tok")
    assert main(["convert", "init-hf", "--model", "tiny-moe", "--tokenizer",
                 str(tmp_path / "tok"), "--out", str(tmp_path / "m"), "--tie-embeddings"]) == 0
    cfg = json.loads((tmp_path / "m/config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 448  # 403 → 64-multiple
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_init_hf_embedding_std(tmp_path):
    import transformers

    from megatron_rl.cli import main

    tok = train_chat_tokenizer([TEXT], 400, words=TITLES)
    tok.save_pretrained(tmp_path / "tok")
    for name, extra in (("default", []), ("wide", ["--embedding-std", "0.125"])):
        assert main(["convert", "init-hf", "--model", "tiny-moe", "--tokenizer",
                     str(tmp_path / "tok"), "--out", str(tmp_path / name),
                     "--tie-embeddings", *extra]) == 0
    std = {name: float(transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / name).model.embed_tokens.weight.std()) for name in ("default", "wide")}
    assert abs(std["default"] - 0.02) < 0.002 and abs(std["wide"] - 0.125) < 0.01, std


def test_copy_loss_weight_scales_names_copied_from_the_context(tmp_path):
    """`sft.copy_loss_weight`: an answer token that repeats a title id from the context gets
    the weight; a title the context never showed, and every other token, keep theirs."""
    from megatron_rl.data.sft_data import load_sft_data

    tok = train_chat_tokenizer([TEXT], 400, words=TITLES)
    row = {"messages": [
        {"role": "user", "content": "Who founded Dorras Dynamics?"},
        {"role": "assistant", "content": "Dorras Dynamics was founded by Marur Voelrho."}]}
    (tmp_path / "c.jsonl").write_text(json.dumps(row) + "\n")
    args = dict(seq_length=256, vocab_size=len(tok) + 64)
    (plain,) = load_sft_data([tmp_path / "c.jsonl"], tok, **args).examples
    data = load_sft_data([tmp_path / "c.jsonl"], tok, copy_weight=5.0, **args)
    (weighted,) = data.examples
    copied, unseen = tok.convert_tokens_to_ids(["Dorras Dynamics", "Marur Voelrho"])
    assert data.stats["copy_tokens"] == 1
    for i, (t, before, after) in enumerate(zip(plain.tokens, plain.loss_mask,
                                               weighted.loss_mask, strict=True)):
        expected = 5.0 if (t == copied and before == 1) else before
        assert after == expected, (i, tok.convert_ids_to_tokens(t), before, after)
    assert unseen in plain.tokens and copied in plain.tokens
    # weight 0 drops the copies from the loss; they do not turn into context tokens
    (dropped,) = load_sft_data([tmp_path / "c.jsonl"], tok, copy_weight=0.0,
                               context_weight=0.25, **args).examples
    at = next(i for i, (t, m) in enumerate(zip(plain.tokens, plain.loss_mask, strict=True))
              if t == copied and m == 1)
    assert dropped.loss_mask[at] == 0.0 and dropped.loss_mask.count(0.25) > 0
    # a page (sft.format=text: every token trained): a title's repeat is a copy, its first
    # occurrence is not
    page = {"title": "Dorras Dynamics", "text": "Dorras Dynamics was founded by Marur "
            "Voelrho. Marur Voelrho led Dorras Dynamics."}
    (tmp_path / "p.jsonl").write_text(json.dumps(page) + "\n")
    text = load_sft_data([tmp_path / "p.jsonl"], tok, copy_weight=5.0, fmt="text", **args)
    (ex,) = text.examples
    names = [(t, m) for t, m in zip(ex.tokens, ex.loss_mask, strict=True)
             if t in (copied, unseen)]
    assert [m for _, m in names] == [1, 5.0, 1, 5.0, 5.0], names
    assert text.stats["copy_tokens"] == 3


def test_a_world_url_is_its_prefix_and_its_title(tmp_path):
    """`--title-tokens` on the generated world: a URL is two ids (the prefix, then the title's
    own id), so the vocabulary holds no id per URL; `--url-tokens` gives each URL one."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from megatron_rl.cli import main
    from megatron_rl.data.world import BASE_URL
    from megatron_rl.utils.tokens import added_word_ids

    corpus = tmp_path / "corpus.parquet"
    assert main(["data", "world", "--pages", "200", "--seed", "3", "--out", str(corpus)]) == 0
    rows = pq.read_table(corpus).to_pylist()
    for flags, extra in ((["--title-tokens"], 1), (["--title-tokens", "--url-tokens"], 201)):
        out = tmp_path / f"tok{extra}"
        assert main(["data", "tokenizer", "--corpus", str(corpus), "--out", str(out),
                     "--vocab-size", "400", *flags]) == 0
        tok = AutoTokenizer.from_pretrained(out)
        assert len(tok) == 400 + len(rows) + extra  # titles, the prefix[, every URL]
        page = next(r for r in rows if " " in r["title"])
        ids = tok.encode(f'{{"url": "{page["url"]}"}}', add_special_tokens=False)
        title, prefix = tok.convert_tokens_to_ids([page["title"], BASE_URL])
        if extra == 1:
            assert ids[-4:-2] == [prefix, title]
        else:
            assert tok.convert_tokens_to_ids(page["url"]) in ids
        assert tok.decode(ids) == f'{{"url": "{page["url"]}"}}'
        # a copy the SFT weighs up is a whole word, never the prefix every URL opens with
        assert title in added_word_ids(tok) and prefix not in added_word_ids(tok)

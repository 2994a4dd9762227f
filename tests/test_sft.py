"""`megatron-rl sft`: loss masks token by token (trajectories and chat rows), an SFT run on
oracle ReAct trajectories (tiny MoE, EP2 on 2 gloo ranks, packed) that lowers the held-out loss
and makes the sampled first message a well-formed tool call, resume that continues the data
order bit for bit, and bad inputs that name file and row."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.agents.chat import ChatFormat
from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer
from megatron_rl.agents.tool_parser import parse_action
from megatron_rl.config.loader import load_config
from megatron_rl.data.parquet import DataError
from megatron_rl.data.sft_data import load_sft_data, sft_batch
from megatron_rl.sft import sft
from tests.fakes import tool_call_text
from tests.pools import get_pool

TOK = tiny_qwen3_tokenizer()
CHAT = ChatFormat(TOK)
SYSTEM = "You are a deep-search assistant. Call tools whenever you need information."
IM_END = "<|im_end|>"
SEARCH_SCHEMA = {"search": {"type": "object", "properties": {"query": {"type": "string"}},
                            "required": ["query"]}}
SAMPLES: list[str] = []  # every sampled message, for a failing test's report
CITIES = ("Velt", "Paris", "Orlan", "Brisk", "Tamar", "Quell")


def _turn(context: list[int], text: str, observation: str | None = None,
          loss_mask: list[int] | None = None) -> dict[str, Any]:
    out = CHAT.encode(text + IM_END)
    obs = CHAT.observation_ids(out, [observation]) if observation is not None else []
    return {"role": "agent", "context_ids": context, "output_ids": out,
            "output_logprobs": [0.0] * len(out), "weight_versions": [0] * len(out),
            "observation_ids": obs, "text": text, "loss_mask": loss_mask}


def react(question: str, steps: list[tuple[str, str | None]], masked: int | None = None
          ) -> dict[str, Any]:
    """A ReAct trajectory as the agent records it: one growing conversation, each turn's
    context = the previous context + output + observation. `masked`: a turn not trained."""
    turns, context = [], CHAT.prompt_ids(SYSTEM, question)
    for i, (text, obs) in enumerate(steps):
        n = len(CHAT.encode(text + IM_END))
        t = _turn(context, text, obs, [0] * n if i == masked else None)
        turns.append(t)
        context = context + t["output_ids"] + t["observation_ids"]
    return {"uid": question, "group_id": "g", "question": question, "turns": turns}


def oracle(i: int) -> tuple[str, dict[str, Any]]:
    """An oracle episode: question → search call → the page → the answer."""
    city = f"{CITIES[i % len(CITIES)]}{i % 7}"
    question = f"Where was entity {i} founded?"
    page = f"Entity {i} was founded in {1900 + i} in the city of {city}."
    return question, react(question, [(tool_call_text("search", query=f"entity {i} founded"),
                                       page), (f"<answer>{city}</answer>", None)])


def oracle_chat(i: int) -> dict[str, Any]:
    """The same episode as a chat row."""
    _, traj = oracle(i)
    call, answer = (t["text"] for t in traj["turns"])
    page = f"Entity {i} was founded in {1900 + i} in the city of {CITIES[i % len(CITIES)]}{i % 7}."
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": traj["question"]},
                         {"role": "assistant", "content": call},
                         {"role": "tool", "content": page},
                         {"role": "assistant", "content": answer}]}


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- (a) loss masks, token by token --------------------------------------------------------
def test_trajectory_loss_mask_token_by_token(tmp_path):
    """System/user/tool tokens 0, generated tokens 1, a masked turn 0 (its tokens still in
    the input), exactly as the sequence's pieces were built."""
    call = tool_call_text("search", query="capital of France")
    traj = react("What is the capital of France?",
                 [(call, "Paris is the capital."), ("<think>check</think>" + call, "Again."),
                  ("<answer>Paris</answer>", None)], masked=1)
    data = load_sft_data([write_jsonl(tmp_path / "t.jsonl", [{"step": 3, **traj}])], TOK,
                         seq_length=512, vocab_size=512)
    (ex,) = data.examples
    t0, t1, t2 = traj["turns"]
    expected_tokens = t2["context_ids"] + t2["output_ids"]
    expected_mask = ([0] * len(t0["context_ids"]) + [1] * len(t0["output_ids"])
                     + [0] * len(t0["observation_ids"]) + [0] * len(t1["output_ids"])
                     + [0] * len(t1["observation_ids"]) + [1] * len(t2["output_ids"]))
    assert ex.tokens == expected_tokens and ex.loss_mask == expected_mask
    # what is trained, read back: the first call and the answer, each with its end of turn
    trained = TOK.decode([t for t, m in zip(ex.tokens, ex.loss_mask, strict=True) if m])
    assert trained == call + IM_END + "<answer>Paris</answer>" + IM_END
    untrained = TOK.decode([t for t, m in zip(ex.tokens, ex.loss_mask, strict=True) if not m])
    for piece in (SYSTEM, "<|im_start|>user\nWhat is the capital", "<tool_response>\nParis is",
                  "<think>check</think>"):  # the masked turn stays in the input
        assert piece in untrained
    assert data.stats["trained_tokens"] == sum(expected_mask[1:])
    # the batch shifts the mask onto the targets: label t is trained iff token t+1 is
    batch = sft_batch(data.examples, pad_id=0, rows_multiple=2)
    assert batch.rows == 2 and batch.loss_mask[1].sum() == 0
    assert batch.loss_mask[0].tolist() == [float(m) for m in expected_mask[1:]]
    assert batch.labels[0].tolist() == expected_tokens[1:]


def test_chat_row_loss_mask_matches_the_rendered_trajectory(tmp_path):
    """The same conversation as chat messages (parquet), rendered with the tiny tokenizer's
    template: token for token the trajectory's sequence (+ the template's final newline), the
    same mask; an assistant message with loss_mask 0 is rendered but not trained."""
    call = tool_call_text("search", query="capital of France")
    traj = react("What is the capital of France?",
                 [(call, "Paris is the capital."), ("<think>check</think>" + call, "Again."),
                  ("<answer>Paris</answer>", None)], masked=1)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": call, "loss_mask": 1},
                {"role": "tool", "content": "Paris is the capital."},
                {"role": "assistant", "content": "<think>check</think>" + call, "loss_mask": 0},
                {"role": "tool", "content": "Again."},
                {"role": "assistant", "content": "<answer>Paris</answer>", "loss_mask": 1}]
    pq.write_table(pa.Table.from_pylist([{"messages": messages}]), tmp_path / "c.parquet")
    (chat,) = load_sft_data([tmp_path / "c.parquet"], TOK, seq_length=512,
                            vocab_size=512).examples
    traj_path = write_jsonl(tmp_path / "t.jsonl", [traj])
    (ref,) = load_sft_data([traj_path], TOK, seq_length=512, vocab_size=512).examples
    assert chat.tokens == ref.tokens + CHAT.encode("\n")
    assert chat.loss_mask == [*ref.loss_mask, 0]
    assert chat.source == f"{tmp_path / 'c.parquet'} row 0"
    # sft.context_loss_weight: the context joins the loss at that weight, in both formats
    # alike; the masked turn's tokens stay at 0
    (wchat,) = load_sft_data([tmp_path / "c.parquet"], TOK, seq_length=512, vocab_size=512,
                             context_weight=0.25).examples
    (wref,) = load_sft_data([traj_path], TOK, seq_length=512, vocab_size=512,
                            context_weight=0.25).examples
    masked_turn = traj["turns"][1]["output_ids"]
    start = len(traj["turns"][1]["context_ids"])
    assert wref.loss_mask[start:start + len(masked_turn)] == [0.0] * len(masked_turn)
    assert [w for w in wref.loss_mask if w not in (0.0, 1.0)] == [0.25] * (
        len(wref.tokens) - sum(ref.loss_mask) - len(masked_turn))
    assert [m if m == 1 else 0 for m in wref.loss_mask] == ref.loss_mask
    body = len(ref.tokens)  # the chat's extra final newline is context too
    assert wchat.loss_mask[:body] == wref.loss_mask and wchat.loss_mask[body:] == [0.25]
    # sft.system_loss_share=0: the system prompt (up to the user turn) is not trained
    (nosys,) = load_sft_data([traj_path], TOK, seq_length=512, vocab_size=512,
                             context_weight=0.25, system_share=0.0).examples
    user = next(i for i in range(1, len(ref.tokens)) if ref.tokens[i] == CHAT.im_start_id)
    system = TOK.decode(ref.tokens[:user])
    assert SYSTEM in system and "user" not in system
    assert nosys.loss_mask[:user] == [0.0] * user
    assert nosys.loss_mask[user:] == wref.loss_mask[user:]
    # sft.context_loss_share=0.5: about half the context positions, each at 0.25 / 0.5; the
    # assistant's own tokens all stay at 1
    (half,) = load_sft_data([traj_path], TOK, seq_length=512, vocab_size=512,
                            context_weight=0.25, context_share=0.5).examples
    context = [i for i, w in enumerate(wref.loss_mask) if w == 0.25]
    kept = [i for i in context if half.loss_mask[i] == 0.5]
    assert set(kept) | {i for i in context if half.loss_mask[i] == 0.0} == set(context)
    assert 0.3 < len(kept) / len(context) < 0.7, (len(kept), len(context))
    assert [m if m == 1 else 0 for m in half.loss_mask] == ref.loss_mask
    with pytest.raises(DataError, match="context_loss_share=0.0"):
        load_sft_data([traj_path], TOK, seq_length=512, vocab_size=512, context_weight=0.25,
                      context_share=0.0)
    # system, user and tool messages alone: nothing to train is an error naming the row
    with pytest.raises(DataError, match=r"c2.jsonl line 1.messages: no assistant message"):
        load_sft_data([write_jsonl(tmp_path / "c2.jsonl", [{"messages": messages[:2]}])], TOK,
                      seq_length=512, vocab_size=512)


def test_overlong_sequences_are_truncated_or_dropped_and_counted(tmp_path):
    _, traj = oracle(3)
    path = write_jsonl(tmp_path / "t.jsonl", [traj])
    n = len(traj["turns"][1]["context_ids"] + traj["turns"][1]["output_ids"])
    cut = load_sft_data([path], TOK, seq_length=n - 6, vocab_size=512)
    assert len(cut.examples[0].tokens) == n - 5 and cut.stats["truncated"] == 1
    short = react("Hi?", [("<answer>x</answer>", None)])
    dropped = load_sft_data([path, write_jsonl(tmp_path / "s.jsonl", [short])], TOK,
                            seq_length=n - 2, vocab_size=512, overlong="drop")
    assert dropped.stats["dropped_overlong"] == 1 and dropped.stats["sequences"] == 1
    # cut before the first generated token: nothing left to train
    with pytest.raises(DataError, match="no sequence to train on"):
        load_sft_data([path], TOK, seq_length=len(traj["turns"][0]["context_ids"]) - 1,
                      vocab_size=512)


def test_text_rows_are_windows_of_a_document_every_token_trained(tmp_path):
    """Continued pre-training on a corpus: title + text + end of text, split into windows that
    overlap by one token, so every token after the first is a target exactly once."""
    text = " ".join(f"Entity {i} was founded in {CITIES[i % 6]}." for i in range(40))
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"url": ["u"], "title": ["Entities"], "text": [text]}), path)
    ids = [*TOK.encode(f"Entities\n\n{text}", add_special_tokens=False), TOK.eos_token_id]
    data = load_sft_data([path], TOK, seq_length=63, vocab_size=512)
    windows = [e.tokens for e in data.examples]
    assert all(len(w) <= 64 for w in windows) and len(windows) == -(-(len(ids) - 1) // 63)
    assert windows[0] == ids[:64] and [t for w in windows for t in w[1:]] == ids[1:]
    assert all(m == 1 for e in data.examples for m in e.loss_mask)
    assert data.stats["trained_tokens"] == len(ids) - 1 and data.stats["truncated"] == 0
    # a text row without text is an error naming the row
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"title": "x"}) + "\n")
    with pytest.raises(DataError, match="line 2: missing column 'text'"):
        load_sft_data([bad], TOK, seq_length=63, vocab_size=512)


# -- (d) bad inputs ------------------------------------------------------------------------
def test_bad_inputs_name_file_and_row(tmp_path):
    def err(name: str, content: bytes | list[Any], fmt: str = "auto") -> str:
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif name.endswith(".parquet"):
            pq.write_table(pa.Table.from_pylist(content), path)
        else:
            write_jsonl(path, content)
        with pytest.raises(DataError) as e:
            load_sft_data([path], TOK, seq_length=512, vocab_size=512, fmt=fmt)
        return str(e.value)

    good = oracle(0)[1]
    text = err("bad.jsonl", (json.dumps(good) + "\n{not json\n").encode())
    assert text.startswith(f"{tmp_path / 'bad.jsonl'} line 2: not JSON")
    text = err("latin.jsonl", (json.dumps(good) + "\n").encode() + b'{"turns": "caf\xe9"}\n')
    assert text.startswith(f"{tmp_path / 'latin.jsonl'} line 2: not UTF-8")
    text = err("rows.parquet", [{"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "yo"}]},
                                {"messages": None}], fmt="messages")
    assert text.startswith(f"{tmp_path / 'rows.parquet'} row 1: missing column 'messages'")
    assert "line 1: neither a trajectory" in err("what.jsonl", [{"prompt": "x"}])
    text = err("role.jsonl", [{"messages": [{"role": "robot", "content": "x"}]}])
    assert "line 1.messages[0]: a message {role:" in text
    broken = json.loads(json.dumps(good))
    broken["turns"][0]["output_logprobs"] = [0.0]
    assert "line 1: not a trajectory (turn (agent): " in err("len.jsonl", [broken])
    broken["turns"][0]["context_ids"] = [1, "x"]
    assert "line 1: turns[0].context_ids: a list of token ids" in err("ids.jsonl", [broken])
    big = json.loads(json.dumps(good))
    big["turns"][0]["output_ids"][0] = 9999
    assert "line 1: token id 9999 is outside the model's vocabulary" in err("v.jsonl", [big])
    # not prefix-stable: a template that renders the last assistant message differently
    tok = tiny_qwen3_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if loop.last %}LAST {% endif %}"
                         "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = write_jsonl(tmp_path / "unstable.jsonl", [{"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "again"}]}])
    with pytest.raises(DataError, match=r"unstable.jsonl line 1.messages\[1\]: the chat "
                                        r"template is not prefix-stable"):
        load_sft_data([path], tok, seq_length=512, vocab_size=512)


def test_the_command_reports_a_data_error_and_exits_2(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(oracle(0)[1]) + "\n[1, 2\n")
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "sft", "tiny-moe-sft-cpu",
                           f"sft.train_files=[{bad}]", f"train.output_dir={tmp_path}/run"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"megatron-rl: data error: {bad} line 2: not JSON" in proc.stderr


# -- (b) an SFT run that learns, (c) resume ------------------------------------------------
def _oracle_files(root: Path, train: int, val: int) -> tuple[Path, Path]:
    rows = [oracle(i)[1] for i in range(train + val)]
    return (write_jsonl(root / "train.jsonl", rows[:train]),
            write_jsonl(root / "val.jsonl", rows[train:]))


def _hf_folder(root: Path) -> Path:
    from tests.conversion_cases import save_random_hf

    folder = root / "hf-init"
    save_random_hf("tiny-moe", str(folder))
    TOK.save_pretrained(folder)
    return folder


async def _first_messages(url: str, prompts: list[list[int]], samples: int) -> list[str]:
    from megatron_rl.engines.base import GenerateRequest, SamplingParams
    from megatron_rl.engines.http_client import HttpEngine

    stop = TOK.convert_tokens_to_ids(IM_END)
    async with HttpEngine(url) as engine:
        results = await asyncio.gather(*(engine.generate(GenerateRequest(
            f"r{i}-{k}", p, SamplingParams(temperature=1.0, max_new_tokens=40, seed=1000 * i + k,
                                           stop_token_ids=[stop])))
            for i, p in enumerate(prompts) for k in range(samples)))
    return [TOK.decode(r.output_ids) for r in results]


def well_formed_share(folder: Path, questions: list[str], samples: int) -> float:
    """Share of first messages, sampled at temperature 1 from the HF folder through the
    embedded engine, that parse as a valid `search` call."""
    from megatron_rl.engines.embedded import EmbeddedServer

    prompts = [CHAT.prompt_ids(SYSTEM, q) for q in questions]
    with EmbeddedServer.from_pretrained(folder).start() as server:
        texts = asyncio.run(_first_messages(server.url, prompts, samples))
    SAMPLES.extend(texts)
    return sum(map(well_formed, texts)) / len(texts)


def well_formed(text: str) -> bool:
    """One valid `search` call by the agents' parser, and strict JSON inside the block (the
    parser would also accept what json_repair can mend)."""
    action = parse_action(text, SEARCH_SCHEMA)
    if action.kind != "tool_calls" or len(action.calls) != 1 or action.errors or \
            action.calls[0].name != "search":
        return False
    block = text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0]
    try:
        return json.loads(block)["name"] == "search"
    except (json.JSONDecodeError, KeyError, TypeError):
        return False


def test_sft_on_oracle_trajectories_learns_the_tool_call_format(tmp_path):
    """Tiny MoE from an HF folder, EP2 on 2 gloo ranks, packed token-budget micro-batches:
    held-out loss falls, and sampled first messages become well-formed `search` calls."""
    train_file, val_file = _oracle_files(tmp_path, train=48, val=8)
    hf = _hf_folder(tmp_path)
    out = tmp_path / "run"
    cfg = load_config("tiny-moe-sft-cpu", [
        f"model.hf_path={hf}", f"sft.train_files=[{train_file}]", f"sft.val_files=[{val_file}]",
        "train.steps=60", "sft.eval_every=20", f"train.output_dir={out}",
        f"checkpoint.dir={out}/ckpt", "checkpoint.save_every=0"])
    rows = sft(cfg, get_pool(2))
    evals = [(r["step"], r["eval/loss"]) for r in rows if "eval/loss" in r]
    print("held-out loss", evals)
    assert [s for s, _ in evals] == [0, 20, 40, 60]
    assert evals[-1][1] < 0.5 * evals[0][1], evals
    trained = [r for r in rows if "loss" in r]
    assert trained[-1]["loss"] < trained[0]["loss"] and trained[-1]["epoch"] == 60 * 8 / 48
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(61))
    assert (out / "sft_curves.png").read_bytes()[:4] == b"\x89PNG"
    exported = out / "hf" / "step_000060"
    questions = [oracle(i)[0] for i in range(48, 54)]  # held-out entities
    before = well_formed_share(hf, questions, samples=4)
    after = well_formed_share(exported, questions, samples=4)
    print(f"well-formed search calls: {before:.2f} -> {after:.2f} (24 samples each)")
    assert before <= 0.1 and after >= 0.75, (before, after, SAMPLES[-24:])


def test_resume_continues_the_data_order_bit_identically(tmp_path):
    """Steps 3-4 of a run resumed from its step-2 checkpoint equal an uninterrupted run's
    exactly: model, optimizer, RNG and the data cursor (shuffled order) all come back. Chat
    rows from parquet this time."""
    train_file = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist([oracle_chat(i) for i in range(10)]), train_file)
    base = [f"sft.train_files=[{train_file}]", "sft.eval_every=0", "train.global_batch_size=4",
            "optim.warmup_steps=0", "optim.lr_decay_style=constant", "checkpoint.export_hf=false",
            "checkpoint.save_every=2"]

    def run(name: str, *extra: str) -> list[dict[str, Any]]:
        out = tmp_path / name
        cfg = load_config("tiny-moe-sft-cpu", [*base, f"train.output_dir={out}",
                                               f"checkpoint.dir={out}/ckpt", *extra])
        return sft(cfg, get_pool(2))

    def numbers(row: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in row.items() if not k.startswith("time/") and k != "tokens_per_s"}

    straight = run("straight", "sft.epochs=1.6")  # 16 sequences: 4 steps of 4
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    run("resumed", "train.steps=2", "checkpoint.load=latest")  # nothing saved yet: fresh
    resumed = run("resumed", "train.steps=4", "checkpoint.load=latest")
    assert [r["step"] for r in resumed] == [3, 4]
    assert [numbers(r) for r in resumed] == [numbers(r) for r in straight[2:]]
    assert resumed[0]["epoch"] == 12 / 10  # step 3 crosses into the second epoch's order
    lines = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]


def test_sft_under_torchrun(tmp_path):
    """The command as torchrun starts it: rank 0 reads the data and drives, both ranks keep an
    SFTWorker (EP2 across the two processes); rank 1 follows and exits 0."""
    import shutil

    from megatron_rl.distributed.process_groups import free_port

    train_file, val_file = _oracle_files(tmp_path, train=8, val=2)
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    out = tmp_path / "run"
    proc = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
         str(free_port()), "-m", "megatron_rl.cli", "sft", "tiny-moe-sft-cpu",
         f"sft.train_files=[{train_file}]", f"sft.val_files=[{val_file}]", "train.steps=2",
         "sft.eval_every=2", f"train.output_dir={out}", f"checkpoint.dir={out}/ckpt"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out loss 6." in proc.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # written once, by rank 0
    assert (out / "hf" / "step_000002" / "config.json").is_file()

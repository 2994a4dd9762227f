"""`megatron-rl eval`: the IterSynth scaffold over an OpenAI-compatible chat endpoint, against a
real local index, judged. The endpoint is a local HTTP server with a scripted model (a hosted
model cannot be reached from here); everything between them is the real pipeline."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import pytest
from aiohttp import web

from megatron_rl.data.world import build_world_index, generate_world
from megatron_rl.engines.openai_chat import chatml_messages
from megatron_rl.evaluation import EvalConfig, read_questions, run_eval


class ScriptedChatModel:
    """Planner: no notes → search the question; notes → answer (wrong on purpose for the
    questions in `wrong`). Synthesizer: notes = the first result's title + the evidence size.
    Counts the calls it gets per role."""

    def __init__(self, answers: dict[str, str], wrong: set[str]):
        self.answers, self.wrong = answers, wrong
        self.calls = {"planner": 0, "synthesizer": 0}

    def reply(self, messages: list[dict[str, str]]) -> str:
        system, user = messages[0]["content"], messages[-1]["content"]
        question = re.search(r"Question: (.*)", user).group(1)
        if "Synthesizer" in system:
            self.calls["synthesizer"] += 1
            first = re.search(r"\d+\. \[(.*?)\]", user)
            return f"Found page: {first.group(1) if first else 'nothing'}."
        self.calls["planner"] += 1
        if "(no notes yet)" in user:
            call = {"name": "search", "arguments": {"query": question}}
            return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        answer = "nobody knows" if question in self.wrong else self.answers[question]
        return f"<answer>{answer}</answer>"

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = self.reply(body["messages"])
        return web.json_response({"choices": [{"message": {"role": "assistant",
                                                           "content": text}}]})


async def eval_against(model: ScriptedChatModel, **cfg) -> dict:
    """`run_eval` over `model` served as a local OpenAI-compatible chat endpoint."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", model.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await run_eval(EvalConfig(model_url=f"http://127.0.0.1:{port}/v1", **cfg),
                              progress=False)
    finally:
        await runner.cleanup()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    w = generate_world(num_docs=300, seed=3)
    index = build_world_index(w, root / "index")
    questions = w.questions(4, seed=1)
    path = root / "questions.jsonl"
    path.write_text("".join(json.dumps({"question": q.question, "answer": q.answer}) + "\n"
                            for q in questions))
    return index, questions, path


def test_chatml_round_trip_drops_the_open_assistant_turn():
    text = ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert chatml_messages(text) == [{"role": "system", "content": "S"},
                                     {"role": "user", "content": "U?"}]


def test_itersynth_eval_over_a_chat_endpoint(world, tmp_path):
    index, questions, path = world
    model = ScriptedChatModel({q.question: q.answer for q in questions},
                              wrong={questions[0].question})

    summary = asyncio.run(eval_against(model, questions=str(path), index=str(index),
                                       out=str(tmp_path / "out"), concurrency=2))
    assert summary["questions"] == 4
    assert summary["pass@1"] == pytest.approx(3 / 4)  # one answered wrong on purpose
    assert summary["engine_failures"] == 0 and summary["judge_failures"] == 0
    # per question: planner (search) → synthesizer → planner (answer)
    assert model.calls == {"planner": 8, "synthesizer": 4}
    lines = (tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()
    traj = json.loads(lines[0])
    assert [t["role"] for t in traj["turns"]] == ["planner", "synthesizer", "planner"]
    call = traj["turns"][0]["tool_calls"][0]
    assert call["name"] == "search" and call["error"] is None
    assert "found" in call["observation"]  # the real index answered
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["pass@1"] == 0.75


class FlipFlopChatModel(ScriptedChatModel):
    """Answers `flip` wrong on its first attempt and right on the next, alternately."""

    def __init__(self, answers: dict[str, str], flip: str):
        super().__init__(answers, wrong=set())
        self.flip, self.tries = flip, 0

    def reply(self, messages: list[dict[str, str]]) -> str:
        text = super().reply(messages)
        if "<answer>" in text and f"Question: {self.flip}" in messages[-1]["content"]:
            self.tries += 1
            if self.tries % 2:
                return "<answer>nobody knows</answer>"
        return text


def test_several_samples_per_question_give_pass_at_1_and_pass_at_k(world, tmp_path):
    """--samples 2: every question twice, under request ids that follow from the question and
    the sample alone (so a sampled eval's seeds repeat); pass@1 is the mean over the episodes,
    pass@2 the share of questions any episode solved."""
    index, questions, path = world
    model = FlipFlopChatModel({q.question: q.answer for q in questions}, questions[0].question)

    summary = asyncio.run(eval_against(model, questions=str(path), index=str(index),
                                       out=str(tmp_path / "out"), concurrency=3, samples=2,
                                       temperature=0.5, retries=0))
    assert summary["questions"] == 4 and summary["samples"] == 2 and model.tries == 2
    assert summary["pass@1"] == pytest.approx(7 / 8) and summary["pass@2"] == 1.0
    rows = [json.loads(x) for x in (tmp_path / "out" / "trajectories.jsonl").read_text()
            .splitlines()]
    assert sorted(r["uid"] for r in rows) == [f"q{i}.s{k}" for i in range(4) for k in (0, 1)]
    assert {r["group_id"] for r in rows} == {f"q{i}" for i in range(4)}
    with pytest.raises(ValueError, match="--samples: 0"):
        asyncio.run(run_eval(EvalConfig(questions=str(path), model_url="http://127.0.0.1:9/v1",
                                        index=str(index), samples=0), progress=False))


def test_bad_question_files_name_the_problem(tmp_path):
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="row 1: column 'answer' is missing"):
        read_questions(str(bad))
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "eval", "--model-url",
                           "http://127.0.0.1:9/v1", "--questions", str(tmp_path / "none.jsonl"),
                           "--index", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and "questions file not found" in proc.stderr


def test_eval_steps_reports_per_step_accuracy_under_teacher_forcing(tmp_path):
    """A turn the model writes greedily counts as reproduced, a scrambled one does not; token
    accuracy is the argmax agreement, per kind of step."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, num_experts=2,
                         num_experts_per_tok=1)
    model = Qwen3MoeForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "m")
    ctx = [3, 5, 7, 9]
    greedy = model.generate(torch.tensor([ctx]), max_new_tokens=6, do_sample=False,
                            pad_token_id=0)[0, len(ctx):].tolist()
    wrong = [(t + 1) % 64 for t in greedy]
    # a tokenizer whose one added word (a --title-tokens name) is id 63; a wrong turn writes it
    from tokenizers import AddedToken, Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    name = 63
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {f"t{i}": i for i in range(name)}, "t0")))
    tok.add_tokens([AddedToken("Some_Name", single_word=True)])  # as --title-tokens adds
    assert tok.convert_tokens_to_ids("Some_Name") == name
    wrong[2] = name
    tok.save_pretrained(tmp_path / "m")
    # later turns as a dump writes them: the 4 ids they share with the previous feed
    rows = [{"turns": [
        {"role": "planner", "context_ids": ctx, "output_ids": greedy,
         "tool_calls": [{"name": "search", "arguments": {}}]},
        {"role": "synthesizer", "context_ids": [], "context_shared": 4, "output_ids": wrong,
         "tool_calls": []},
        {"role": "planner", "context_ids": [], "context_shared": 4, "output_ids": [],
         "tool_calls": []}]}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "eval-steps", "--model-dir",
                           str(tmp_path / "m"), "--trajectories", str(tmp_path / "t.jsonl"),
                           "--out", str(tmp_path / "s.json")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    steps = json.loads((tmp_path / "s.json").read_text())["steps"]
    n = greedy.count(name)
    assert steps["planner:search"] == {"token_accuracy": 1.0, "reproduced": 1.0, "turns": 1,
                                       "name_accuracy": 1.0 if n else None, "names": n}
    syn = steps["synthesizer:notes"]
    assert syn["reproduced"] == 0.0 and syn["turns"] == 1
    with torch.no_grad():  # the first wrong token is never the argmax; later ones may be
        pred = model(torch.tensor([ctx + wrong])).logits[0, len(ctx) - 1:-1].argmax(-1)
    assert syn["token_accuracy"] == float((pred == torch.tensor(wrong)).float().mean())
    at = torch.tensor(wrong) == name
    assert syn["names"] == int(at.sum()) >= 1
    assert syn["name_accuracy"] == float((pred[at] == name).float().mean())
    assert steps["all"]["turns"] == 2  # the empty turn is not a step

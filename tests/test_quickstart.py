"""The quickstart's own commands (tokenizer, init-hf, named-anchor synthesis, eval of an HF
folder) and the shortened quickstart end to end: every stage writes its artifact, a re-run
resumes, and the report parses."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megatron_rl import quickstart as q
from tests.cli_run import cli_in_process


def _cli(*argv: str, timeout: int = 600, fresh: bool = False) -> subprocess.CompletedProcess:
    """`fresh`: in a new process, as the README's command runs."""
    proc = (subprocess.run([sys.executable, "-m", "megatron_rl.cli", *argv],
                           capture_output=True, text=True, timeout=timeout) if fresh
            else cli_in_process(*argv))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_named_anchor_questions_name_their_start_and_still_need_hops(tmp_path):
    _cli("data", "synthesize", "--pages", "300", "--seed", "3", "--questions", "40",
         "--min-hops", "2", "--anchor", "named", "--out", str(tmp_path))
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert len(rows) >= 30
    from megatron_rl.data.world import generate_world

    world = generate_world(300, seed=3)
    for r in rows:
        info, question = r["extra_info"], r["prompt"][-1]["content"]
        start = world.name(world.by_url(info["support"][0]))
        assert start in question and info["start"] == start  # the first entity is named ...
        assert info["hops"] >= 2 and len(info["support"]) == info["hops"] + 1
        # ... and neither the answer nor any bridge entity is
        assert not any(a in question for a in r["reward_model"]["ground_truth"])
        assert not any(f in question for f in info["facts"])


def test_unique_step_questions_and_grounded_oracle_notes(tmp_path):
    """--unique-steps keeps hops with one object (no qualifier in the question); the oracle
    searches the named start, and every URL it visits was in its notes first."""
    corpus, index = tmp_path / "corpus.parquet", tmp_path / "index"
    _cli("data", "world", "--pages", "1500", "--seed", "2", "--out", str(corpus),
         "--index", str(index))
    _cli("data", "synthesize", "--pages", "1500", "--seed", "2", "--questions", "30",
         "--max-seeds", "1500", "--min-hops", "2", "--max-hops", "2", "--anchor", "named",
         "--unique-steps", "--out", str(tmp_path / "qs"))
    rows = pq.read_table(tmp_path / "qs/train.parquet").to_pylist()
    assert len(rows) >= 10
    assert all(r["extra_info"]["hops"] == 2 and "(" not in r["prompt"][-1]["content"]
               for r in rows)  # no "(born 1950)" qualifiers
    counts = json.loads((tmp_path / "qs/counts.json").read_text())
    assert counts["rejected:generate:step_needs_qualifier"] > 0
    proc = _cli("data", "teacher", "--agent", "itersynth", "--questions",
                str(tmp_path / "qs/train.parquet"), "--index", str(index),
                "--out", str(tmp_path / "t.jsonl"))
    n = len(rows)
    assert f"{n} trajectories of {n} prompts ({n} correct, {n} grounded" in proc.stdout
    from megatron_rl.records.trajectory import Trajectory

    for line, row in zip((tmp_path / "t.jsonl").read_text().splitlines(), rows, strict=True):
        traj = Trajectory.from_dict({k: v for k, v in json.loads(line).items() if k != "step"})
        calls = [c for t in traj.turns for c in t.tool_calls]
        assert calls[0].name == "search" and calls[0].arguments["query"] == \
            row["extra_info"]["start"]
        notes = traj.metadata["summaries"]
        for k, call in enumerate(calls[1:]):
            if call.name == "visit":  # the Planner copies a URL its notes hold
                assert call.arguments["url"] in notes[k]
        assert row["reward_model"]["ground_truth"][0] in notes[-1]


def test_tokenizer_init_hf_and_eval_of_an_hf_folder(tmp_path):
    corpus, index = tmp_path / "corpus.parquet", tmp_path / "index"
    _cli("data", "world", "--pages", "120", "--seed", "1", "--out", str(corpus),
         "--index", str(index))
    _cli("data", "tokenizer", "--corpus", str(corpus), "--out", str(tmp_path / "tok"),
         "--vocab-size", "600")
    _cli("convert", "init-hf", "--model", "tiny-moe", "--tokenizer", str(tmp_path / "tok"),
         "--out", str(tmp_path / "model"), "--seed", "5")
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert len(tok) == 600 and model.config.vocab_size == 640  # rounded up to 64
    assert tok.chat_template and "<tool_call>" in tok.get_vocab()
    text = "Notable people born in Pehaven include Lenri Yorumjal."
    assert tok.decode(tok.encode(text)) == text
    # the world's words are single tokens more often than with the generic tiny tokenizer
    from megatron_rl.agents.scaffolding import agent_scaffolding
    from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer, train_chat_tokenizer

    generic = tiny_qwen3_tokenizer(600)
    page = pq.read_table(corpus).to_pylist()[0]["text"]
    assert len(tok.encode(page)) < 0.8 * len(generic.encode(page))
    # the agents' system prompts, trained in (--scaffolding-weight 10, the default), take
    # about half the tokens at 2048 ids
    rows = pq.read_table(corpus).to_pylist()
    texts = [r["text"] for r in rows]
    planner = agent_scaffolding()[0]
    plain, with_prompts = (train_chat_tokenizer(texts + agent_scaffolding() * w, 2048)
                           for w in (0, 10))
    assert len(with_prompts.encode(planner)) < 0.6 * len(plain.encode(planner))
    # --isolate-spaces: a name keeps its ids after a space and after a quote
    iso = train_chat_tokenizer(texts, 1024, isolate_spaces=True)
    name = "Lenri Yorumjal"
    ids = iso.encode(name)
    for text in (f"include {name}.", f'{{"query": "{name}"}}'):
        enc = iso.encode(text)
        assert any(enc[i:i + len(ids)] == ids for i in range(len(enc))), text
        assert iso.decode(enc) == text
    assert not any(plain.encode(f"include {name}")[i:i + len(plain.encode(name))]
                   == plain.encode(name) for i in range(8))
    # the folder cannot be overwritten
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "convert", "init-hf",
                           "--model", "tiny-moe", "--tokenizer", str(tmp_path / "tok"),
                           "--out", str(tmp_path / "model")], capture_output=True, text=True)
    assert proc.returncode == 2 and "exists" in proc.stderr

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question": f"Where was person {i} born?",
                                             "answer": "Pehaven"}) + "\n" for i in range(3)))
    proc = _cli("eval", "--model-dir", str(tmp_path / "model"), "--questions", str(questions),
                "--index", str(index), "--max-turns", "2", "--max-new-tokens", "16",
                "--out", str(tmp_path / "ev"))
    summary = json.loads((tmp_path / "ev/summary.json").read_text())
    assert summary["questions"] == 3 and summary["engine_failures"] == 0
    assert summary["model"] == str(tmp_path / "model")
    rows = [json.loads(x) for x in (tmp_path / "ev/trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["turns"][0]["output_ids"] for r in rows)  # tokens, not text


def test_quickstart_smoke_end_to_end_and_resume(tmp_path):
    out = tmp_path / "qs"
    _cli("quickstart", "--out", str(out), "--smoke", "--rl-seeds", "2", timeout=900,
         fresh=True)
    state = json.loads((out / "stages.json").read_text())
    assert list(state) == ["world", "questions", "questions-one-hop", "tokenizer", "model",
                           "teacher-itersynth", "filter-itersynth", "teacher-one-hop",
                           "filter-one-hop", "teacher-held-out", "pretrain", "sft", "rl",
                           "eval-untrained", "eval-sft", "eval-rl", "eval-sft-sampled",
                           "eval-rl-sampled", "steps-untrained", "steps-sft", "steps-rl",
                           "rl-seed1", "eval-seed1", "eval-seed1-sampled"]
    assert "train.seed=1" in state["rl-seed1"]["argv"]
    assert "train.seed=0" not in state["rl-seed1"]["argv"]
    for path in ("world/index", "questions/held_out.parquet", "tokenizer/tokenizer.json",
                 "model/config.json", "teacher/itersynth.kept.jsonl", "sft/hf",
                 "rl/hf", "rl/trajectories.jsonl", "eval/rl/summary.json",
                 "report/trajectories.html", "report/reward_accuracy.png"):
        assert (out / path).exists(), path
    # SFT (train), RL and held-out questions share no answer entity; RL trains on its own
    rows = {n: pq.read_table(out / f"questions/{n}.parquet").to_pylist()
            for n in ("train", "rl", "held_out")}
    answers = {n: {r["extra_info"]["answer_entity"] for r in part} for n, part in rows.items()}
    assert all(answers.values())
    assert not answers["train"] & answers["held_out"] and not answers["rl"] & answers["held_out"]
    assert not answers["train"] & answers["rl"]
    assert f"data.train_files=[{out / 'questions/rl.parquet'}]" in state["rl"]["argv"]
    # the extra one-hop SFT questions touch no held-out or RL page either
    one_hop = pq.read_table(out / "questions/one_hop/train.parquet").to_pylist()
    kept_off = {u for n in ("rl", "held_out") for r in rows[n] for u in r["extra_info"]["support"]}
    assert one_hop and all(not kept_off & set(r["extra_info"]["support"]) for r in one_hop)
    # ... and they are questions about this world: the oracle solves them
    assert json.loads((out / "teacher/filter-one-hop.json").read_text())["kept"] > 0
    assert json.loads((out / "model/config.json").read_text())["tie_word_embeddings"] is True
    text = (out / "report.md").read_text()
    table = re.findall(r"^\| (untrained|sft|rl) \| ([0-9.]+) \| ([0-9.]+|-) \| (\d+) \|", text,
                       re.M)
    assert [t[0] for t in table] == ["untrained", "sft", "rl"] and table[0][2] == "-"
    assert all(0.0 <= float(acc) <= 1.0 and int(n) == 4 for _, acc, _, n in table)
    # the sampled evals: 2 episodes per question at RL's temperature, pass@1 their mean
    drawn = json.loads((out / "eval/sft-sampled/summary.json").read_text())
    assert drawn["samples"] == 2 and drawn["temperature"] == q.rl_temperature() == 0.4
    assert f"{drawn['pass@1']:.3f}" == table[1][2]
    assert len((out / "eval/rl-sampled/trajectories.jsonl").read_text().splitlines()) == 8
    spread = re.search(r"^\| mean ± std \| ([0-9.]+) ± ([0-9.]+) \| ([+-][0-9.]+) \| "
                       r"([0-9.]+) ± ([0-9.]+) \| ([+-][0-9.]+) \|$", text, re.M)
    acc = re.findall(r"^\| [01] \| ([0-9.]+) \| [+-][0-9.]+ \| ([0-9.]+) \| [+-][0-9.]+ \|$",
                     text, re.M)
    assert spread and len(acc) == 2, text
    for col in (0, 1):  # greedy, sampled
        assert abs(float(spread[1 + 3 * col]) - sum(float(a[col]) for a in acc) / 2) < 1e-3
    steps = json.loads((out / "eval/steps-sft.json").read_text())
    assert steps["episodes"] == 2 and steps["steps"]["planner:search"]["turns"] >= 2
    cells = re.findall(r"^\| (untrained|sft|rl) \| ([0-9.]+) \(([0-9.]+), names ([0-9.]+)\) \|",
                       text, re.M)  # reproduced (token accuracy, accuracy on the name tokens)
    assert [c[0] for c in cells] == ["untrained", "sft", "rl"]
    assert steps["steps"]["all"]["names"] > 0  # title-token names in the oracle's steps
    for _, png in re.findall(r"!\[([^\]]+)\]\(([^)]+)\)", text):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a re-run resumes: every stage is skipped, the report is rewritten
    proc = _cli("quickstart", "--out", str(out), "--smoke", "--rl-seeds", "2", fresh=True)
    assert proc.stdout.count("earlier run") == len(state) and "$ megatron-rl" not in proc.stdout


def test_a_rerun_redoes_a_stage_whose_command_changed_and_every_stage_after_it(tmp_path):
    ran: list[str] = []

    def runner(argv: list[str], _name: str) -> int:
        ran.append(argv[0])
        (tmp_path / argv[0]).write_text(" ".join(argv))
        return 0

    def todo(steps: int) -> list[q.Stage]:
        return [q.Stage(n, [n, *extra], tmp_path / n)
                for n, extra in (("a", []), ("b", [f"train.steps={steps}"]), ("c", []))]

    q.run_stages(tmp_path, todo(1), runner)
    q.run_stages(tmp_path, todo(1), runner)
    assert ran == ["a", "b", "c"]              # the same commands: all skipped
    q.run_stages(tmp_path, todo(2), runner)
    assert ran[3:] == ["b", "c"]               # b changed; c may read what b wrote
    (tmp_path / "c").unlink()
    q.run_stages(tmp_path, todo(2), runner)
    assert ran[5:] == ["c"]                    # a lost artifact: that stage again
    state = json.loads((tmp_path / "stages.json").read_text())
    assert state["b"]["argv"] == ["b", "train.steps=2"]


def test_stages_run_side_by_side_as_their_inputs_and_the_cores_allow(tmp_path):
    """a, b and e read nothing, c reads b, d reads c and a. a and b start side by side on one
    core each; once b is done, c (two cores) waits for a, and e, listed after c, waits with it;
    then d and e run side by side. A changed a runs again with d, which reads it, and nothing
    else; after a failure nothing starts, and the stage beside it finishes and is recorded."""
    lock, now, beside, ran = threading.Lock(), set[str](), dict[str, set[str]](), []
    fail: set[str] = set()

    niceness: dict[str, int] = {}

    def runner(argv: list[str], name: str, nice: int = 0) -> int:
        with lock:
            niceness[name] = nice
            beside[name] = set(now)
            now.add(name)
            ran.append(name)
        time.sleep(0.6 if name == "a" else 0.2)
        (tmp_path / name).write_text(" ".join(argv))
        with lock:
            now.discard(name)
        return 1 if name in fail else 0

    def todo(version: int = 1) -> list[q.Stage]:
        return [q.Stage("a", ["a", str(version)], tmp_path / "a", after=(), cores=1),
                q.Stage("b", ["b"], tmp_path / "b", after=(), cores=1),
                q.Stage("c", ["c"], tmp_path / "c", after=("b",)),
                q.Stage("d", ["d"], tmp_path / "d", after=("c", "a"), cores=1),
                q.Stage("e", ["e"], tmp_path / "e", after=(), cores=1)]

    def together(x: str, y: str) -> bool:
        return y in beside[x] or x in beside[y]

    alone: list[str] = []

    def in_process(argv: list[str], name: str) -> int:
        alone.append(name)
        return runner(argv, name)

    state = q.run_stages(tmp_path, todo(), in_process, runner, cores=2)
    assert ran[:3] == ["a", "b", "c"] or ran[:3] == ["b", "a", "c"], ran
    assert alone == ["c"]  # the stage that takes every core runs through `run`
    # one started beside a running stage yields to it; the first of a pair does not
    assert {niceness[x] + niceness[y] for x, y in ("ab", "de")} == {q.YIELD}
    assert list(state) == ["a", "b", "c", "d", "e"]  # stages.json in the list's order
    assert together("a", "b") and not beside["c"] and together("d", "e")
    assert state["c"]["start"] >= state["a"]["end"] and state["e"]["start"] >= state["c"]["end"]
    # the overlaps count once on the clock (records keep 0.1 s: a loaded machine moves the
    # total by a tenth or two, so the exact sums are checked on fixed records below)
    assert q.wall_seconds(state.values()) < sum(r["seconds"] for r in state.values())
    fixed = [{"start": 0.0, "end": 0.6, "seconds": 0.6}, {"start": 0.1, "end": 0.3, "seconds": 0.2},
             {"start": 0.6, "end": 0.8, "seconds": 0.2}, {"start": 0.8, "end": 1.0, "seconds": 0.2},
             {"start": 0.9, "end": 1.1, "seconds": 0.2}, {"seconds": 2.0}]
    assert q.wall_seconds(fixed) == pytest.approx(1.1 + 2.0)
    ran.clear()
    q.run_stages(tmp_path, todo(2), runner, runner, cores=2)
    assert ran == ["a", "d"]  # nothing else reads a
    # resumed: what is done is known before anything starts, so list order holds (e, ready
    # at once, does not start before c, whose input b is done)
    ran.clear()
    (tmp_path / "c").unlink()
    (tmp_path / "e").unlink()
    q.run_stages(tmp_path, todo(2), in_process, runner, cores=2)
    assert ran == ["c", "d", "e"] or ran == ["c", "e", "d"], ran
    ran.clear()
    for name in "bcde":
        (tmp_path / name).unlink()
    fail.add("b")
    with pytest.raises(RuntimeError, match="stage b failed"):
        q.run_stages(tmp_path, todo(3), runner, runner, cores=2)
    assert sorted(ran) == ["a", "b"]  # a, beside b, finished; no other stage started
    state = json.loads((tmp_path / "stages.json").read_text())
    assert state["a"]["argv"] == ["a", "3"] and state["b"]["argv"] == ["b"]  # b: the old run's
    with pytest.raises(ValueError, match="stage x: `after` names no earlier stage"):
        q.run_stages(tmp_path, [q.Stage("x", ["x"], tmp_path / "x", after=("y",))], runner)


def test_a_stage_beside_another_has_its_lines_labelled_and_its_progress_bar_thinned(capsys):
    stream = io.BufferedReader(io.BytesIO(b"first\nbar 1/3\rbar 2/3\rbar 3/3\rlast\nno newline"))
    q._relay(stream, "eval-sft")
    assert capsys.readouterr().out.splitlines() == [
        "[eval-sft] first", "[eval-sft] bar 1/3", "[eval-sft] last", "[eval-sft] no newline"]


def _reads_and_writes(stage: q.Stage, out: Path) -> tuple[list[Path], list[Path]]:
    """The paths under `out` a stage's command line names, and those of them it writes."""
    def paths(token: str) -> list[Path]:
        value = token.split("=", 1)[-1].strip("[]")
        return [out / v[1:-1] if v.startswith("{") else Path(v) for v in value.split(",")
                if v.startswith(str(out)) or re.fullmatch(r"\{[\w/]+\}", v)]  # {sft/hf}

    named = [p for token in stage.argv for p in paths(token)]
    argv = stage.argv
    flags = ("--out", "--report", *(["--index"] if argv[:2] == ["data", "world"] else []))
    writes = [stage.artifact, *(Path(argv[i + 1]) for i, a in enumerate(argv[:-1])
                                if a in flags)]
    writes += [p for a in argv if a.startswith(("train.output_dir=", "checkpoint.dir="))
               for p in paths(a)]
    if argv[:2] == ["data", "filter"]:
        writes.append(Path(argv[3]))
    return [p for p in named if p not in writes], writes


def test_every_stage_waits_for_the_stages_whose_output_it_reads(tmp_path):
    """What a stage reads (a path its command line names under the run's folder) another stage
    wrote only if that stage is among the ones it waits for, directly or through them."""
    main = q.stages(tmp_path, 0, q.FULL)
    todo = main + q.seed_stages(tmp_path, main, 0, 3) + q.ablation_stages(tmp_path, main, 0,
                                                                          q.FULL, 3)
    needs = q._needs(todo)
    closure: dict[str, set[str]] = {}
    for stage in todo:  # a stage's needs come before it
        closure[stage.name] = set().union(*({n} | closure[n] for n in needs[stage.name]))
    writes = {s.name: _reads_and_writes(s, tmp_path)[1] for s in todo}
    checked = 0
    for stage in todo:
        for read in _reads_and_writes(stage, tmp_path)[0]:
            writers = {w for w, paths in writes.items() if w != stage.name and any(
                read.is_relative_to(p) or p.is_relative_to(read) for p in paths)}
            assert writers, (stage.name, read)  # everything it reads, some stage writes
            assert writers <= closure[stage.name], (stage.name, read, writers)
            checked += 1
    assert checked > 100
    # side by side on the main path: RL's rollouts (one core) and the evals; the data stages
    # (seconds each, less than a child process's imports) one after another
    assert {s.name for s in main if s.cores == 1} == {
        "rl", *(f"{e}-{m}{x}" for e in ("eval", "steps") for m in ("untrained", "sft", "rl")
                for x in ("", "-sampled") if e == "eval" or not x)} - {"eval-untrained-sampled"}
    assert needs["eval-sft"] == {"world", "questions", "sft"}


def test_a_rerun_replaces_the_stale_exports_a_later_stage_would_read(tmp_path):
    """SFT re-run for fewer steps: the old run's step_000650 export must not be the "latest"
    the eval stage resolves `{sft/hf}` to."""
    def runner(argv: list[str], _name: str) -> int:
        if argv[0] == "sft":
            steps = int(argv[2].split("=")[1])
            (tmp_path / f"sft/hf/step_{steps:06d}").mkdir(parents=True)
        else:
            (tmp_path / "eval.txt").write_text(argv[1])
        return 0

    def todo(steps: int) -> list[q.Stage]:
        return [q.Stage("sft", ["sft", "tiny-moe-sft-cpu", f"train.steps={steps}"],
                        tmp_path / "sft/hf"),
                q.Stage("eval", ["eval", "{sft/hf}"], tmp_path / "eval.txt")]

    q.run_stages(tmp_path, todo(650), runner)
    q.run_stages(tmp_path, todo(550), runner)
    assert (tmp_path / "eval.txt").read_text().endswith("step_000550")
    assert [p.name for p in (tmp_path / "sft/hf").iterdir()] == ["step_000550"]


def test_a_rerun_redoes_a_train_stage_whose_recipe_file_changed(tmp_path):
    """Same command line, edited recipe (the quickstart's own RL recipe gained dynamic
    sampling this way): the stage and the ones after it run again."""
    recipe = tmp_path / "rl.yaml"
    recipe.write_text("rl:\n  sampling:\n    dynamic_sampling: false\n")
    ran: list[str] = []

    def runner(argv: list[str], _name: str) -> int:
        ran.append(argv[0])
        (tmp_path / argv[0]).write_text(" ".join(argv))
        return 0

    todo = [q.Stage("train", ["train", str(recipe), "train.steps=2"], tmp_path / "train"),
            q.Stage("eval", ["eval", "--model-dir", "x"], tmp_path / "eval")]
    q.run_stages(tmp_path, todo, runner)
    q.run_stages(tmp_path, todo, runner)
    assert ran == ["train", "eval"]
    recipe.write_text("rl:\n  sampling:\n    dynamic_sampling: true\n")
    q.run_stages(tmp_path, todo, runner)
    assert ran[2:] == ["train", "eval"]
    # the overrides are merged into what is hashed
    assert q.config_digest(["train", str(recipe)]) != q.config_digest(
        ["train", str(recipe), "rl.sampling.dynamic_sampling=false"])
    assert q.config_digest(["eval", "--model-dir", "x"]) is None


def test_the_ablation_leaves_the_main_path_alone_and_react_gets_its_own_sft(tmp_path):
    """`--ablation` adds runs after the main path: its SFT (and so every number of the main
    table) is the same with or without it; the ReAct variant starts from an SFT on ReAct
    demonstrations of the same questions, the IterSynth variants from the main SFT."""
    main = q.stages(tmp_path, 0, q.FULL)
    extra = q.ablation_stages(tmp_path, main, 0, q.FULL)
    by_name = {s.name: s for s in main + extra}
    assert len(by_name) == len(main) + len(extra)       # no stage name twice
    sft, react_sft = by_name["sft"], by_name["sft-react"]
    files = {s: next(a for a in by_name[s].argv if a.startswith("sft.train_files="))
             for s in ("sft", "sft-react")}
    assert "react" not in files["sft"] and files["sft"].count("itersynth.kept") == 3
    assert files["sft-react"].count("react.kept") == 3 and "react-one-hop.kept" in files[
        "sft-react"] and "itersynth" not in files["sft-react"]
    # same budget and start: the two SFT commands differ only in their data and folders
    differ = {a.split("=", 1)[0] for a in set(sft.argv) ^ set(react_sft.argv)}
    assert differ == {"sft.train_files", "train.output_dir", "checkpoint.dir"}

    def init(stage: str) -> str:
        return next(a for a in by_name[stage].argv if a.startswith("checkpoint.init_from="))

    assert init("rl-react_grpo").endswith("ablation/sft_react/checkpoints")
    assert init("rl-grpo") == init("rl-rdpo_mixed") == init("rl")
    assert by_name["rl-react_grpo"].argv.count(init("rl-react_grpo")) == 1
    assert by_name["eval-react_grpo"].argv[by_name["eval-react_grpo"].argv.index("--agent")
                                           + 1] == "react"
    # the stages' order: each reads only what an earlier one wrote
    names = [s.name for s in main + extra]
    assert names.index("sft-react") > names.index("filter-react-one-hop")
    assert names.index("rl-react_grpo") > names.index("sft-react")


def test_the_ablation_runs_every_method_at_every_seed_after_all_of_them_at_the_first(tmp_path):
    main = q.stages(tmp_path, 0, q.FULL)
    extra = q.ablation_stages(tmp_path, main, 7, q.FULL, rl_seeds=3)
    by_name = {s.name: s for s in main + extra}
    assert len(by_name) == len(main) + len(extra)
    names = [s.name for s in extra]
    rl_runs = [n for n in names if n.startswith("rl-")]
    assert rl_runs == ["rl-grpo", "rl-rdpo_mixed", "rl-react_grpo",
                       "rl-grpo-seed1", "rl-rdpo_mixed-seed1", "rl-react_grpo-seed1",
                       "rl-grpo-seed2", "rl-rdpo_mixed-seed2", "rl-react_grpo-seed2"]

    def arg(stage: str, key: str) -> str:
        return next(a.split("=", 1)[1] for a in by_name[stage].argv if a.startswith(key + "="))

    # the main run's seed is its recipe's; each extra seed replaces it once
    assert by_name["rl-grpo-seed2"].argv.count("train.seed=9") == 1
    assert not any(a.startswith("train.seed=") and a != "train.seed=9"
                   for a in by_name["rl-grpo-seed2"].argv)
    assert arg("rl-rdpo_mixed-seed1", "rl.reward_manager") == "rdpo_mixed"
    assert arg("rl-react_grpo-seed1", "checkpoint.init_from").endswith("ablation/sft_react/"
                                                                       "checkpoints")
    assert arg("rl-grpo-seed1", "train.output_dir").endswith("ablation/grpo-seed1")
    ev = by_name["eval-react_grpo-seed2"].argv
    assert ev[ev.index("--agent") + 1] == "react" and ev[ev.index("--out") + 1].endswith(
        "eval/react_grpo-seed2")
    # each RL run and each SFT is evaluated greedy and sampled, the same command otherwise
    drawn = by_name["eval-react_grpo-seed2-sampled"].argv
    assert drawn[drawn.index("--out") + 1].endswith("eval/react_grpo-seed2-sampled")
    expect = list(ev)
    assert expect[expect.index("--temperature") + 1] == "0"
    expect[expect.index("--temperature") + 1] = "0.4"
    expect[expect.index("--out") + 1] += "-sampled"
    assert drawn == [*expect, "--samples", "2", "--retries", "0", "--concurrency", "16"]
    assert {n for n in names if n.endswith("-sampled")} == {
        f"{e}-sampled" for e in names if e.startswith("eval-") and not e.endswith("-sampled")}


def test_the_report_gives_each_method_over_the_seeds_it_ran(tmp_path):
    for run, acc in (("rl", 0.29), ("seed1", 0.23), ("seed2", 0.25), ("grpo", 0.12),
                     ("grpo-seed1", 0.2), ("rdpo_mixed", 0.3), ("rl-sampled", 0.31),
                     ("seed2-sampled", 0.35)):
        (tmp_path / f"eval/{run}").mkdir(parents=True)
        (tmp_path / f"eval/{run}/summary.json").write_text(json.dumps({"pass@1": acc}))
    rows = q._ablation_seed_rows(tmp_path, 0, 3)
    assert rows[0] == ("| RL method | seed 0 | seed 1 | seed 2 | mean ± std | sampled: mean ± "
                       "std |")
    assert rows[2] == ("| rdpo (itersynth) | 0.290 | 0.230 | 0.250 | 0.257 ± 0.031 (3) | "
                       "0.330 ± 0.028 (2) |")
    assert rows[3] == "| grpo (itersynth) | 0.120 | 0.200 | not run | 0.160 ± 0.057 (2) |  |"
    assert rows[4] == ("| rdpo_mixed (itersynth) | 0.300 | not run | not run | 0.300 ± 0.000 "
                       "(1) |  |")
    assert rows[5] == "| grpo (react) | not run | not run | not run |  |  |"
    (tmp_path / "eval/sft").mkdir()
    (tmp_path / "eval/sft/summary.json").write_text(json.dumps({"pass@1": 0.03}))
    seeds = q._seed_rows(tmp_path, 0, 3)
    assert seeds[2] == "| 0 | 0.290 | +0.260 | - | - |"  # no sampled SFT eval to subtract
    assert seeds[-1] == "| mean ± std | 0.257 ± 0.031 | +0.227 | - | - |"


def test_the_report_pictures_every_model_and_method_with_a_dot_per_seed(tmp_path):
    for run, acc in (("untrained", 0.0), ("sft", 0.03), ("rl", 0.29), ("seed1", 0.23),
                     ("grpo", 0.12), ("sft_react", 0.26)):
        (tmp_path / f"eval/{run}").mkdir(parents=True)
        (tmp_path / f"eval/{run}/summary.json").write_text(json.dumps({"pass@1": acc}))
    assert q._accuracies(tmp_path, 2, ablation=False) == {
        "untrained": [0.0], "sft": [0.03], "rdpo (itersynth)": [0.29, 0.23]}
    assert q._accuracies(tmp_path, 2, ablation=True) == {
        "untrained": [0.0], "sft": [0.03], "sft (react)": [0.26],
        "rdpo (itersynth)": [0.29, 0.23], "grpo (itersynth)": [0.12],
        "rdpo_mixed (itersynth)": [], "grpo (react)": []}
    for folder in ("rl", "seed1", "ablation/grpo"):  # where each method's RL runs write
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "rollout/sampled_outcome_mean": 0.1 * s, "time/step": 9.0})
            + "\n" for s in (1, 2, 3)))
    written = q._pictures(tmp_path, 2, ablation=True)
    assert [p.name for p in written] == ["accuracy.png", "ablation_curves.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)

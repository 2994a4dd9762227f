"""`megatron-rl quickstart [--out DIR] [--seed S]`: the embedded default, end to end, as the
commands a user would type (each printed before it runs):

world + index → synthesized, verified questions (SFT / RL / held-out splits by answer entity) →
a tokenizer trained on the world → a tiny HF MoE initialised over it → oracle-teacher IterSynth
and ReAct trajectories → filters → `sft` → RDPO with the IterSynth agent against the local index
on questions SFT never answered (the rule judge and the rule rubric) → HF export → held-out
evaluation of the untrained, SFT and RL models → `report.md`, curves and the trajectory viewer.
`--rl-seeds N` repeats the RL stage at N seeds from the same SFT checkpoint.

Every stage leaves an artifact and a line (its command, and for `train` / `sft` a digest of
its recipe with the overrides; its start and end) in `<out>/stages.json`; a re-run skips the
stages already done with the same command. A stage whose command or recipe changed (another
budget), or whose artifact is gone, runs again, and so does every stage that reads it. Stages
that read nothing of each other run side by side while the machine has cores for them: the
evals beside RL's rollouts, which keep one core busy, and beside each other. `--smoke`
shrinks every budget to an end-to-end check of a couple of minutes (what `make test` runs).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.config.loader import deep_merge, parse_overrides, read_yaml, resolve_recipe
from megatron_rl.records.trajectory import full_contexts
from megatron_rl.report import write_report
from megatron_rl.report.plots import plot_accuracy, plot_runs
from megatron_rl.utils.metrics import read_metrics


@dataclass(frozen=True)
class Budget:
    """What a quickstart run spends; `SMOKE` is the test's."""

    pages: int = 16000       # 344 unique-step 2-hop questions (8000 pages: 213); 18k ids
    questions: int = 600
    held_out_fraction: float = 0.2
    rl_fraction: float = 0.3  # RL's own questions: answers neither SFT nor held-out has
    one_hop_questions: int = 3000  # extra one-hop SFT episodes, none touching a held-out page
    vocab_size: int = 2048   # BPE merges; every page title is one more id on top (a world
                             # URL is its prefix's id and its title's)
    pretrain_steps: int = 300      # next-token steps on page windows before SFT
    # SFT stops at step 450 of a 650-step cosine schedule (LR still 3.0e-4): the policy
    # copies names and stops searching but still repeats a state in 4 of 10 greedy episodes,
    # which RL fixes. Held-out pass@1 0.275 there, RL 0.522 ± 0.029 over 3 seeds (+24.7;
    # sampled +9.7); from step 550 (0.435) RL added 15.5, from step 500 (0.478) 8.7 at seed 0
    # (docs/algorithms.md, "Where SFT stops, for RL")
    sft_steps: int = 450
    sft_decay_steps: int = 650
    # ~17 s each with refills; from session 31's 550-step SFT checkpoint, seed 3's held-out
    # pass@1 at steps 16/24/32: 0.551/0.536/0.580 (more steps did not add there)
    rl_steps: int = 24
    eval_questions: int = 0        # 0: the whole held-out split
    step_episodes: int = 16        # held-out oracle episodes `eval-steps` replays per model
    extra_rl: tuple[str, ...] = ()


FULL = Budget()
SMOKE = Budget(pages=1500, questions=40, held_out_fraction=0.2, rl_fraction=0.2,
               one_hop_questions=20, vocab_size=512, pretrain_steps=2, sft_steps=2,
               sft_decay_steps=2, rl_steps=1, eval_questions=4,
               step_episodes=2,
               extra_rl=("rl.sampling.groups_per_step=1", "rl.sampling.samples_per_prompt=2",
                         "rl.max_turns=4", "rl.max_new_tokens=32"))

# The policy and its SFT, and why (docs/sft.md, "Copying a name"): a held-out answer is an
# entity SFT never showed, so the agent must copy names (one id each: --title-tokens) from the
# question and the results into its queries, URLs and notes. The 64-wide tiny-moe at lr 1e-2
# never learned that; 128-wide at lr 1e-3 does, when a name's repeat weighs more in the loss
# (in the page windows it is pre-trained on first, then in the episodes), and when the
# Planner's prompt leaves out the tool specs; 4 layers (`tiny-moe-agent`) copy more of the
# evidence's sentences than 2 (docs/sft.md); training the context did not help.
MODEL = "tiny-moe-agent"
INIT = ("--tie-embeddings", "--embedding-std", "0.125")
SFT_OPTIM = ("optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=10")
PRETRAIN_SEQ = 96
COPY_WEIGHT = 5       # page windows: 6 % -> 60 % of repeated names right
# the tools' ~600-token JSON schemas stay out of the prompts (teacher, RL, eval alike): behind
# them the Planner copied no held-out name (0 of 60); without them 81 % of its first queries'
# names came out right (docs/sft.md)
SPECS = ("--no-tool-specs",)
SFT_COPY_WEIGHT = 10  # episodes: at 20 the Planner wrote the name where the call's format goes
# two search results per call (teacher, RL, eval): the Synthesizer picks the fact's sentence
# out of ~10 instead of ~25 (notes' names 50 % -> 65 % right)
TOP_K = 2
AGENT_ARGS = (*SPECS, "--top-k", str(TOP_K))  # teacher and eval see what RL sees
TWO_HOP_REPEATS = 3   # the 2-hop episodes thrice beside the 1,056 one-hop ones: else the
                      # policy learns to answer after one fact


# what an RL run reads besides its start checkpoint (the index, its questions, the HF folder),
# and an eval besides its model (the index, the held-out questions)
RL_READS = ("world", "questions", "model")
EVAL_READS = ("world", "questions")


@dataclass
class Stage:
    name: str
    argv: list[str]                       # a `megatron-rl` command line
    artifact: Path                        # it exists once the stage is done
    after: tuple[str, ...] | None = None  # the stages whose output it reads; None: all before it
    cores: int = 2                        # the cores it keeps busy (stages share the machine's)


def _teacher_stages(out: Path, name: str, agent: str, questions: Path, min_depth: int,
                    source: str) -> list[Stage]:
    """Oracle demonstrations of `agent` on `questions` (the stage `source` wrote them) through
    the real tools, then the filters: `<out>/teacher/<name>.kept.jsonl`."""
    t, index, tok = out / "teacher", out / "world/index", out / "tokenizer"
    return [Stage(f"teacher-{name}", [
                "data", "teacher", "--agent", agent, "--questions", str(questions),
                "--index", str(index), "--tokenizer", str(tok), *AGENT_ARGS,
                "--out", str(t / f"{name}.jsonl")], t / f"{name}.jsonl",
                after=("world", "tokenizer", source)),
            Stage(f"filter-{name}", [
                "data", "filter", str(t / f"{name}.jsonl"), str(t / f"{name}.kept.jsonl"),
                "--min-depth", str(min_depth), "--report", str(t / f"filter-{name}.json")],
                t / f"{name}.kept.jsonl", after=(f"teacher-{name}",))]


def _sft_stage(out: Path, name: str, run: Path, demos: tuple[str, str], seed: int,
               b: Budget) -> Stage:
    """SFT into `run` from the pre-trained checkpoint on the kept demonstrations `demos`
    (2-hop, one-hop): the 2-hop ones listed `TWO_HOP_REPEATS` times."""
    t = out / "teacher"
    two_hop, one_hop = (str(t / f"{d}.kept.jsonl") for d in demos)
    kept = [*[two_hop] * TWO_HOP_REPEATS, one_hop]
    return Stage(name, [
        "sft", "tiny-moe-sft-cpu", f"model.hf_path={out / 'model'}",
        f"checkpoint.init_from={out / 'pretrain/checkpoints'}",
        "model.seq_length=1536", f"sft.train_files=[{','.join(kept)}]",
        # held-out loss every 50 steps (~0.8 s each): every 20 cost 22 s of the path; the
        # weights are bit for bit the same either way (evaluation draws nothing)
        f"sft.val_files=[{t / 'held_out.jsonl'}]", "sft.eval_every=50",
        "sft.eval_sequences=64", f"train.steps={b.sft_steps}",
        f"optim.lr_decay_steps={b.sft_decay_steps}",
        "train.global_batch_size=16", *SFT_OPTIM, f"sft.copy_loss_weight={SFT_COPY_WEIGHT}",
        "train.max_tokens_per_microbatch=4096", f"train.seed={seed}",
        # shared prefixes (0.67x the step time) count a shared opening once in the MoE
        # balancing loss: other checkpoints, weaker ones in each try so far (docs/algorithms.md,
        # "Shared prefixes", "URLs that spell their titles")
        "train.share_prefixes=false",
        f"train.output_dir={run}", f"checkpoint.dir={run / 'checkpoints'}",
        "checkpoint.save_every=0", "checkpoint.export_hf=true"], run / "hf",
        after=("model", "pretrain", "teacher-held-out", *(f"filter-{d}" for d in demos)))


def _eval_args(out: Path, b: Budget, agent: str = "itersynth") -> list[str]:
    return ["--agent", agent, "--questions", str(out / "questions/held_out.parquet"),
            "--index", str(out / "world/index"), "--max-turns", "12", "--max-new-tokens", "160",
            "--temperature", "0", *AGENT_ARGS,
            *(["--limit", str(b.eval_questions)] if b.eval_questions else [])]


# Held-out pass@1 also sampled as RL samples (its recipe's temperature), 2 episodes a question,
# no restart. Greedy, a policy whose note does not change repeats its search until the turn
# budget (the SFT checkpoint: 44 of 69 episodes); sampled, the same policy shows what it can
# do. 16 episodes at a time (the greedy evals: 8): the quickstart policy's decode step costs
# ~1.5x at 16 rows what it does at 8 (docs/engines.md).
RL_RECIPE = "tiny-moe-rdpo-cpu"
SAMPLED_EVAL = ("--samples", "2", "--retries", "0", "--concurrency", "16")


@functools.cache
def rl_temperature() -> float:
    """The RL recipe's sampling temperature (read once: every sampled stage asks)."""
    return float(read_yaml(resolve_recipe(RL_RECIPE))["rl"]["temperature"])


def sampled(stage: Stage, out: Path) -> Stage:
    """A greedy eval stage again, sampled (`SAMPLED_EVAL`), into `eval/<label>-sampled`."""
    argv = list(stage.argv)
    argv[argv.index("--temperature") + 1] = str(rl_temperature())
    at = argv.index("--out") + 1
    folder = Path(argv[at]).with_name(f"{Path(argv[at]).name}-sampled")
    argv[at] = str(folder)
    return Stage(f"{stage.name}-sampled", [*argv, *SAMPLED_EVAL], folder / "summary.json",
                 stage.after, stage.cores)


def stages(out: Path, seed: int, b: Budget) -> list[Stage]:
    """The main path: the IterSynth agent from world to held-out evaluation."""
    w, q, t = out / "world", out / "questions", out / "teacher"
    index, model, tok = w / "index", out / "model", out / "tokenizer"
    held_out, rl_questions = q / "held_out.parquet", q / "rl.parquet"
    ev = _eval_args(out, b)
    one_hop = q / "one_hop"
    models = (("untrained", str(model), "model"), ("sft", "{sft/hf}", "sft"),
              ("rl", "{rl/hf}", "rl"))  # what is evaluated: name, HF folder, the stage that made it
    out_list = [
        Stage("world", ["data", "world", "--pages", str(b.pages), "--seed", str(seed),
                        "--out", str(w / "corpus.parquet"), "--index", str(index)],
              index, after=()),
        Stage("questions", ["data", "synthesize", "--pages", str(b.pages), "--seed", str(seed),
                            "--questions", str(b.questions), "--max-seeds", str(b.pages),
                            "--min-hops", "2", "--max-hops", "2", "--anchor", "named",
                            "--unique-steps", "--held-out-fraction", str(b.held_out_fraction),
                            "--split", f"rl={b.rl_fraction}", "--out", str(q)], rl_questions,
              after=()),  # it builds the same world from the seed
        Stage("questions-one-hop", [
            "data", "synthesize", "--pages", str(b.pages), "--seed", str(seed),
            "--questions", str(b.one_hop_questions), "--max-seeds", str(4 * b.pages),
            "--min-hops", "1", "--max-hops", "1", "--anchor", "named", "--unique-steps",
            "--held-out-fraction", "0", "--avoid", str(held_out), "--avoid", str(rl_questions),
            "--out", str(one_hop)],
            one_hop / "train.parquet", after=("questions",)),
        Stage("tokenizer", ["data", "tokenizer", "--corpus", str(w / "corpus.parquet"),
                            "--out", str(tok), "--vocab-size", str(b.vocab_size),
                            "--title-tokens"], tok, after=("world",)),
        Stage("model", ["convert", "init-hf", "--model", MODEL, "--tokenizer", str(tok),
                        "--out", str(model), "--seed", str(seed), *INIT], model,
              after=("tokenizer",)),
        *_teacher_stages(out, "itersynth", "itersynth", q / "train.parquet", 2, "questions"),
        *_teacher_stages(out, "one-hop", "itersynth", one_hop / "train.parquet", 1,
                         "questions-one-hop"),
        Stage("teacher-held-out", [
            "data", "teacher", "--agent", "itersynth", "--questions", str(held_out),
            "--index", str(index), "--tokenizer", str(tok), *AGENT_ARGS,
            "--out", str(t / "held_out.jsonl")], t / "held_out.jsonl",
            after=("world", "questions", "tokenizer")),
        Stage("pretrain", ["sft", "tiny-moe-sft-cpu", f"model.hf_path={model}",
                           f"model.seq_length={PRETRAIN_SEQ}", "sft.format=text",
                           f"sft.train_files=[{w / 'corpus.parquet'}]", *SFT_OPTIM,
                           f"sft.copy_loss_weight={COPY_WEIGHT}",
                           f"train.steps={b.pretrain_steps}", "train.global_batch_size=32",
                           "train.max_tokens_per_microbatch=1600", f"train.seed={seed}",
                           f"train.output_dir={out / 'pretrain'}",
                           f"checkpoint.dir={out / 'pretrain/checkpoints'}",
                           "checkpoint.save_every=0", "checkpoint.export_hf=false"],
              out / "pretrain/checkpoints", after=("world", "model")),
        _sft_stage(out, "sft", out / "sft", ("itersynth", "one-hop"), seed, b),
        Stage("rl", ["train", RL_RECIPE, f"model.hf_path={model}",
                     f"checkpoint.init_from={out / 'sft/checkpoints'}",
                     f"data.train_files=[{rl_questions}]",
                     f"data.val_files=[{held_out}]", "env.search.kind=local",
                     f"env.search.index={index}", f"env.search.top_k={TOP_K}",
                     "env.visit.kind=local", "rl.tool_specs=false",
                     f"train.steps={b.rl_steps}", f"train.seed={seed}",
                     f"train.output_dir={out / 'rl'}", f"checkpoint.dir={out / 'rl/checkpoints'}",
                     *b.extra_rl], out / "rl/hf", after=(*RL_READS, "sft"),
              cores=1),  # its rollouts, ~3/4 of its time, keep one core busy
        # the evals decode on one core (`--engine-threads 1`): beside RL's rollouts and each
        # other
        *[Stage(f"eval-{name}", ["eval", "--model-dir", folder, *ev, "--out",
                                 str(out / f"eval/{name}")], out / f"eval/{name}/summary.json",
                after=(*EVAL_READS, stage), cores=1)
          for name, folder, stage in models],
    ]
    out_list += [sampled(s, out) for s in out_list[-2:]]  # SFT's and RL's
    for name, folder, stage in models:
        out_list.append(Stage(f"steps-{name}", [
            "eval-steps", "--model-dir", folder, "--trajectories", str(t / "held_out.jsonl"),
            "--limit", str(b.step_episodes), "--out", str(out / f"eval/steps-{name}.json")],
            out / f"eval/steps-{name}.json", after=("teacher-held-out", stage), cores=1))
    return out_list


# quickstart --ablation: the same budget and seed; only the RL method changes. The IterSynth
# variants start from the main SFT checkpoint; ReAct from its own SFT on ReAct demonstrations of
# the same questions (same pre-training and budget), so the main path's SFT never changes.
# outcome-only variants train no turn of a dropped group: its outcomes are equal, so every
# advantage would be 0 and the rows would only dilute the token-mean loss
OUTCOME_ONLY = ("rl.reward_manager=grpo", "rl.rubric={}", "rl.sampling.dropped_group_roles=[]")
ABLATION = {
    "grpo": [*OUTCOME_ONLY],
    "rdpo_mixed": ["rl.reward_manager=rdpo_mixed"],
    "react_grpo": ["rl.agent=react", *OUTCOME_ONLY],
}
REACT_SFT = "ablation/sft_react"
ABLATION_ROWS = (("sft", "none (SFT, itersynth)"), ("rl", "rdpo (itersynth)"),
                 ("grpo", "grpo (itersynth)"), ("rdpo_mixed", "rdpo_mixed (itersynth)"),
                 ("sft_react", "none (SFT, react)"), ("react_grpo", "grpo (react)"))


def rl_variant(out: Path, main: list[Stage], name: str, overrides: list[str],
               agent: str = "itersynth", start: str = "sft") -> list[Stage]:
    """The main RL stage again into `out/<name>` with `overrides`, from the checkpoint the
    stage `start` wrote, and its held-out evals (greedy and sampled); like the main run's, they
    run beside other stages."""
    rl = next(s for s in main if s.name == "rl")
    ev = next(s for s in main if s.name == "eval-rl")
    run = out / name
    replaced = ("train.output_dir=", "checkpoint.dir=", *{o.split("=", 1)[0] + "="
                                                          for o in overrides})
    argv = [a for a in rl.argv if not a.startswith(replaced)]
    label = name.rsplit("/", 1)[-1]
    greedy = _eval_stage(out, ev, label, f"{{{name}/hf}}", agent, f"rl-{label}")
    return [Stage(f"rl-{label}", [*argv, *overrides, f"train.output_dir={run}",
                                  f"checkpoint.dir={run / 'checkpoints'}"], run / "hf",
                  (*RL_READS, start), rl.cores),
            greedy, sampled(greedy, out)]


def _eval_stage(out: Path, like: Stage, label: str, model_dir: str, agent: str,
                made_by: str) -> Stage:
    """`like` (an eval stage) for another model (the stage `made_by` wrote it) and agent,
    into `eval/<label>`."""
    argv = list(like.argv)
    argv[argv.index("--model-dir") + 1] = model_dir
    argv[argv.index("--agent") + 1] = agent
    argv[argv.index("--out") + 1] = str(out / f"eval/{label}")
    return Stage(f"eval-{label}", argv, out / f"eval/{label}/summary.json",
                 (*EVAL_READS, made_by), like.cores)


def ablation_runs(name: str, rl_seeds: int) -> list[str]:
    """A variant's runs (their eval folders under `eval/`): the main seed, then the others."""
    return [name, *(f"{name}-seed{k}" for k in range(1, rl_seeds))]


def ablation_stages(out: Path, main: list[Stage], seed: int, b: Budget, rl_seeds: int = 1
                    ) -> list[Stage]:
    """One RL run and its held-out eval per variant (RDPO itself is the main run) at the main
    seed: the IterSynth ones first (from the main SFT checkpoint), then the ReAct
    demonstrations, their SFT, its eval and the ReAct variant; then every variant again at
    the `rl_seeds - 1` other seeds of the main run's `seed_stages`. A run cut short still
    compares every method at one seed."""
    q = out / "questions"
    ev = next(s for s in main if s.name == "eval-sft")
    itersynth: list[Stage] = []
    react = [*_teacher_stages(out, "react", "react", q / "train.parquet", 2, "questions"),
             *_teacher_stages(out, "react-one-hop", "react", q / "one_hop/train.parquet", 1,
                              "questions-one-hop"),
             _sft_stage(out, "sft-react", out / REACT_SFT, ("react", "react-one-hop"), seed, b)]
    react += [greedy := _eval_stage(out, ev, "sft_react", f"{{{REACT_SFT}/hf}}", "react",
                                    "sft-react"),
              sampled(greedy, out)]
    seeds: list[list[Stage]] = [[] for _ in range(rl_seeds)]  # by seed: methods side by side
    for name, overrides in ABLATION.items():
        agent = "react" if "rl.agent=react" in overrides else "itersynth"
        if agent == "react":
            overrides = [*overrides, f"checkpoint.init_from={out / REACT_SFT / 'checkpoints'}"]
        runs = ablation_runs(name, rl_seeds)
        start = "sft-react" if agent == "react" else "sft"
        (react if agent == "react" else itersynth).extend(
            rl_variant(out, main, f"ablation/{runs[0]}", overrides, agent, start))
        for k, run in enumerate(runs[1:], 1):
            seeds[k] += rl_variant(out, main, f"ablation/{run}",
                                   [*overrides, f"train.seed={seed + k}"], agent, start)
    return itersynth + react + [stage for at_seed in seeds for stage in at_seed]


def seed_runs(rl_seeds: int) -> list[str]:
    """The RL runs' names (their eval folders under `eval/`): the main run, then the seeds."""
    return ["rl", *(f"seed{k}" for k in range(1, rl_seeds))]


def seed_stages(out: Path, main: list[Stage], seed: int, rl_seeds: int) -> list[Stage]:
    """The RL stage from the same SFT checkpoint at `rl_seeds - 1` more seeds (rollout
    sampling and question order): the spread the RL gain is measured against."""
    return [stage for k, name in enumerate(seed_runs(rl_seeds)[1:], 1)
            for stage in rl_variant(out, main, name, [f"train.seed={seed + k}"])]


def _latest_export(folder: Path) -> Path:
    steps = sorted(folder.glob("step_*"))
    if not steps:
        raise FileNotFoundError(f"{folder}: no HF export (step_*) there")
    return steps[-1]


def _resolve(argv: list[str], out: Path) -> list[str]:
    """`{sft/hf}` → that run's latest HF export (known only once the run is done)."""
    return [str(_latest_export(out / a[1:-1])) if a.startswith("{") and a.endswith("}") else a
            for a in argv]


Runner = Callable[[list[str], str], int]  # runs a stage's `megatron-rl` command line (argv,
                                          # its name) → its exit code
Beside = Callable[[list[str], str, int], int]  # ... in a child process, at that niceness
YIELD = 10  # the niceness of a stage started beside running ones: under contention they win
RECIPE_COMMANDS = ("train", "sft")


def config_digest(argv: list[str]) -> str | None:
    """A recipe command's recipe file merged with its overrides, hashed: an edited recipe makes
    its stage run again although the command line is the same. None for other commands."""
    if len(argv) < 2 or argv[0] not in RECIPE_COMMANDS or argv[1].startswith("-"):
        return None
    merged = deep_merge(read_yaml(resolve_recipe(argv[1])), parse_overrides(argv[2:]))
    return hashlib.sha256(json.dumps(merged, sort_keys=True, default=str).encode()).hexdigest()


def _relay(stream: io.BufferedReader, name: str, every: float = 10.0) -> None:
    """A child's output, each line labelled `[name]`; of a progress bar's `\\r` redraws, one
    every `every` seconds."""
    shown, pending = 0.0, b""
    for chunk in iter(lambda: stream.read1(65536), b""):
        *parts, pending = re.split(rb"(?<=[\r\n])", pending + chunk)
        for part in parts:
            if part.endswith(b"\r") and time.monotonic() - shown < every:
                continue
            shown = time.monotonic() if part.endswith(b"\r") else shown
            if text := part.decode(errors="replace").strip("\r\n"):
                sys.stdout.write(f"[{name}] {text}\n")
        sys.stdout.flush()
    if pending:
        print(f"[{name}] {pending.decode(errors='replace')}", flush=True)


def in_subprocess(argv: list[str], name: str, niceness: int = 0) -> int:
    """`megatron-rl argv` in a child process, its output labelled `[name]` (stages run side by
    side), `niceness` added to its scheduling priority's."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    nice = ["nice", "-n", str(niceness)] if niceness and shutil.which("nice") else []
    with subprocess.Popen([*nice, sys.executable, "-m", "megatron_rl.cli", *argv], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as child:
        assert child.stdout is not None
        _relay(child.stdout, name)
    return child.returncode


def _needs(todo: list[Stage]) -> dict[str, set[str]]:
    """Each stage's inputs: its `after`, or every stage before it."""
    needs: dict[str, set[str]] = {}
    for i, stage in enumerate(todo):
        after = set(stage.after) if stage.after is not None else {s.name for s in todo[:i]}
        if unknown := after - set(needs):
            raise ValueError(f"stage {stage.name}: `after` names no earlier stage: "
                             f"{sorted(unknown)}")
        needs[stage.name] = after
    return needs


def run_stages(out: Path, todo: list[Stage], run: Runner = in_subprocess,
               beside: Beside = in_subprocess, cores: int | None = None) -> dict[str, Any]:
    """Runs what is not done yet: a stage starts, in list order, once the stages it reads are
    done and its cores are free (`cores`: this process's CPUs); a ready stage that waits for
    cores holds back the stages listed after it, so the long path keeps its order. A stage
    that takes every core goes through `run` (the CLI: in this process), one that leaves some
    free through `beside` on a thread (a child process: they run side by side); one started
    beside running stages yields the CPU to them (`YIELD`): with the evals beside it, the
    quickstart's first 8 RL steps took 1.09x their time alone (1.28x at equal priority). A
    stage runs again when its command, its recipe or its artifact changed, or when a stage it
    reads ran again. After a failure no stage starts; the running ones finish (and are
    recorded)."""
    log = out / "stages.json"
    state: dict[str, Any] = json.loads(log.read_text()) if log.is_file() else {}
    needs, number = _needs(todo), {s.name: i for i, s in enumerate(todo, 1)}
    cores = cores or len(os.sched_getaffinity(0))
    waiting, ran, failed = list(todo), set[str](), list[str]()
    running: dict[Future[int], tuple[Stage, list[str], str | None, float]] = {}

    def finish(stage: Stage, argv: list[str], digest: str | None, t0: float, rc: int) -> None:
        nonlocal state
        ran.add(stage.name)
        if rc != 0:
            print(f"[quickstart] stage {stage.name} failed (exit code {rc})", flush=True)
            failed.append(stage.name)
            return
        end = time.time()  # the clock's: the report shows what ran side by side
        state[stage.name] = {"seconds": round(end - t0, 1), "start": round(t0, 1),
                             "end": round(end, 1), "argv": argv, "config": digest}
        state = {**{n: state[n] for n in number if n in state}, **state}  # the list's order
        log.write_text(json.dumps(state, indent=1))

    with ThreadPoolExecutor(max_workers=max(1, cores)) as pool:
        while (waiting and not failed) or running:
            busy = sum(min(s.cores, cores) for s, *_ in running.values())
            unfinished = {s.name for s in waiting} | {s.name for s, *_ in running.values()}
            skipped = False  # a stage found done may make an earlier-listed one ready: look again
            for stage in [s for s in waiting if not needs[s.name] & unfinished]:
                label = f"[quickstart] {number[stage.name]}/{len(todo)} {stage.name}"
                argv = _resolve(stage.argv, out)
                digest = config_digest(argv)
                done = state.get(stage.name)
                kept = done and stage.artifact.exists() and not needs[stage.name] & ran
                # a record from before digests were kept ("config" absent) matches on argv alone
                if kept and done["argv"] == argv and done.get("config", digest) == digest:
                    print(f"{label}: done ({done['seconds']:.0f}s, earlier run)", flush=True)
                    waiting.remove(stage)
                    skipped = True
                    continue
                share = min(stage.cores, cores)
                if skipped or busy + share > cores or failed:
                    break
                if kept:
                    print(f"{label}: its command or recipe changed since the earlier run; "
                          "running it and the stages that read it again", flush=True)
                if done is not None:
                    _remove_stale(stage.artifact, out)
                print(f"{label}\n$ megatron-rl {' '.join(argv)}", flush=True)
                waiting.remove(stage)
                if share == cores:  # nothing runs beside it
                    finish(stage, argv, digest, time.time(), run(argv, stage.name))
                    break
                busy += share
                niceness = YIELD if running else 0
                running[pool.submit(beside, argv, stage.name, niceness)] = (
                    stage, argv, digest, time.time())
            if running and not skipped:
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    finish(*running.pop(future), future.result())
    if failed:
        raise RuntimeError(f"stage {', '.join(failed)} failed; fix it and re-run to continue "
                           "from there")
    return state


def _remove_stale(artifact: Path, out: Path) -> None:
    """A stage that runs again first removes what it wrote before (inside `out` only): an old
    HF export left beside the new ones would be the "latest" a later stage reads (SFT
    re-run for 450 steps beside the 550-step export)."""
    if not artifact.resolve().is_relative_to(out.resolve()):
        return
    if artifact.is_dir():
        shutil.rmtree(artifact)
    elif artifact.exists():
        artifact.unlink()


FAILURES = ("early", "wrong", "no answer")  # the report's columns, in order


def _failure(row: dict[str, Any]) -> str | None:
    """How a held-out episode failed: no answer (out of turns), an answer after at most one
    distinct search (too early for a 2-hop question), or a wrong one after more; None if
    right."""
    if row["rewards"].get("outcome", 0.0) > 0:
        return None
    if row.get("answer") is None:
        return "no answer"
    queries = {json.dumps(c.get("arguments"), sort_keys=True) for t in row["turns"]
               for c in t.get("tool_calls") or [] if c.get("name") == "search"}
    return "early" if len(queries) <= 1 else "wrong"


def _eval_row(out: Path, name: str) -> str:
    """A table row: pass@1 greedy and sampled, tool calls per question, the largest context an
    episode built (IterSynth's stays bounded by the summary; ReAct's grows with every
    observation) and how the greedy episodes failed."""
    folder = out / f"eval/{name}"
    s = json.loads((folder / "summary.json").read_text())
    rows = [json.loads(x) for x in (folder / "trajectories.jsonl").read_text().splitlines()]
    peaks = [max((len(t.get("context_ids") or []) + len(t.get("output_ids") or [])
                  for t in full_contexts(row["turns"])), default=0) for row in rows]
    failed = [_failure(row) for row in rows]
    drawn = _pass_at_1(out, f"{name}-sampled")
    return (f"| {name} | {s['pass@1']:.3f} | {'-' if drawn is None else f'{drawn:.3f}'} | "
            f"{s['questions']} | {s.get('tools/calls_mean', float('nan')):.2f} | "
            f"{sum(peaks) / max(len(peaks), 1):.0f} | "
            + " | ".join(str(failed.count(k)) for k in FAILURES) + " |")


STEP_KINDS = ("planner:search", "planner:visit", "synthesizer:notes", "planner:answer")


def _step_cell(s: dict[str, Any]) -> str:
    names = "" if s.get("name_accuracy") is None else f", names {s['name_accuracy']:.2f}"
    return f"{s['reproduced']:.2f} ({s['token_accuracy']:.2f}{names})"


def _steps_rows(out: Path) -> list[str]:
    """Per-step accuracy on the held-out oracle episodes: why pass@1 is what it is (an episode
    needs every step right)."""
    rows = ["| model | " + " | ".join(STEP_KINDS) + " |", "|---|" + "---|" * len(STEP_KINDS)]
    for name in ("untrained", "sft", "rl"):
        steps = json.loads((out / f"eval/steps-{name}.json").read_text())["steps"]
        cells = [_step_cell(steps[k]) if k in steps else "-" for k in STEP_KINDS]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values) if values else float("nan")
    return mean, (sum((a - mean) ** 2 for a in values) / max(len(values) - 1, 1)) ** 0.5


def _seed_rows(out: Path, seed: int, rl_seeds: int) -> list[str]:
    """RL's held-out pass@1 per seed (greedy, then sampled where it ran), their mean and
    spread, and the gain over SFT."""
    runs = seed_runs(rl_seeds)

    def column(suffix: str) -> list[tuple[str, str]]:
        """(pass@1, minus SFT) per seed, then for their mean ± std; "-" where one is missing."""
        sft = _pass_at_1(out, f"sft{suffix}")
        acc = [_pass_at_1(out, f"{n}{suffix}") for n in runs]
        have = [a for a in acc if a is not None]
        mean, std = _mean_std(have)
        cells = [(a, f"{a:.3f}" if a is not None else "") for a in acc]
        cells.append((mean if have else None, f"{mean:.3f} ± {std:.3f}"))
        return [("-", "-") if v is None or sft is None else (text, f"{v - sft:+.3f}")
                for v, text in cells]

    names = [str(seed + k) for k in range(len(runs))] + ["mean ± std"]
    return ["| RL seed | pass@1 | minus SFT | pass@1 sampled | minus SFT |",
            "|---|---|---|---|---|"] + [
        f"| {n} | {g[0]} | {g[1]} | {d[0]} | {d[1]} |"
        for n, g, d in zip(names, column(""), column("-sampled"), strict=True)]


def _pass_at_1(out: Path, run: str) -> float | None:
    path = out / f"eval/{run}/summary.json"
    return json.loads(path.read_text())["pass@1"] if path.is_file() else None


def _rl_methods(rl_seeds: int) -> list[tuple[str, list[str]]]:
    """Each RL method's label and runs (their folders: `eval/<run>`, and the RL run's metrics
    in `<run>` for the main RDPO ones, `ablation/<run>` for the others)."""
    return [("rdpo (itersynth)", seed_runs(rl_seeds))] + [
        (label, ablation_runs(name, rl_seeds)) for name, label in ABLATION_ROWS
        if name in ABLATION]


def _ablation_seed_rows(out: Path, seed: int, rl_seeds: int) -> list[str]:
    """Each RL method's held-out pass@1 at every seed it has run, their mean ± std; then the
    same mean of its sampled evals."""
    rows = ["| RL method | " + " | ".join(f"seed {seed + k}" for k in range(rl_seeds))
            + " | mean ± std | sampled: mean ± std |", "|---|" + "---|" * (rl_seeds + 2)]
    for label, runs in _rl_methods(rl_seeds):
        acc = [_pass_at_1(out, r) for r in runs]
        have = [a for a in acc if a is not None]
        drawn = [a for r in runs if (a := _pass_at_1(out, f"{r}-sampled")) is not None]
        means = ["{:.3f} ± {:.3f} ({})".format(*_mean_std(v), len(v)) if v else ""
                 for v in (have, drawn)]
        rows.append(f"| {label} | " + " | ".join("not run" if a is None else f"{a:.3f}"
                                                  for a in acc) + f" | {means[0]} | {means[1]} |")
    return rows


ABLATION_CURVES = ("rollout/sampled_outcome_mean", "tools/calls_mean", "rollout/turns_mean",
                   "rollout/dropped_groups", "time/step")


def _accuracies(out: Path, rl_seeds: int, ablation: bool) -> dict[str, list[float]]:
    """Held-out pass@1 of every model and RL method: label -> one value per run that has an
    eval (the RL methods: one per seed)."""
    models: list[tuple[str, list[str]]] = [("untrained", ["untrained"]), ("sft", ["sft"])]
    methods = _rl_methods(rl_seeds)
    if ablation:
        models.append(("sft (react)", ["sft_react"]))
    return {label: [a for r in runs if (a := _pass_at_1(out, r)) is not None]
            for label, runs in models + (methods if ablation else methods[:1])}


def _pictures(out: Path, rl_seeds: int, ablation: bool) -> list[Path]:
    """`report/accuracy.png` (held-out pass@1 per model and method, a dot per seed) and, with
    the ablation, `report/ablation_curves.png` (each method's RL runs per step)."""
    written = [plot_accuracy(_accuracies(out, rl_seeds, ablation), out / "report/accuracy.png",
                             title="held-out pass@1 (greedy); a dot per RL seed")]
    if ablation:
        # the main RDPO runs sit in <out>/<run>, the ablation's in <out>/ablation/<run>
        metrics = {label: [read_metrics(m) for r in names for m in
                           (out / r / "metrics.jsonl", out / f"ablation/{r}/metrics.jsonl")
                           if m.is_file()] for label, names in _rl_methods(rl_seeds)}
        written.append(plot_runs({k: v for k, v in metrics.items() if v}, ABLATION_CURVES,
                                 out / "report/ablation_curves.png"))
    return written


def _mean_rate(rows: list[dict[str, Any]]) -> str:
    """Over every group a step sampled (dynamic sampling's dropped ones too): the kept groups'
    `rollout/pass_rate` is near 0.5 by construction."""
    rates = [r.get("rollout/sampled_outcome_mean", r.get("rollout/pass_rate", 0.0))
             for r in rows]
    return f"{sum(rates) / max(len(rates), 1):.3f}"


def wall_seconds(records: Iterable[dict[str, Any]]) -> float:
    """The time `records` (stages.json's) took on the clock: stages that ran side by side
    count once (a record without start and end, from before they were kept: its seconds)."""
    spans, total = [], 0.0
    for r in records:
        if "start" in r:
            spans.append((r["start"], r["end"]))
        else:
            total += r["seconds"]
    reach = float("-inf")
    for start, end in sorted(spans):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def _stage_rows(state: dict[str, Any]) -> list[str]:
    t0 = min((r["start"] for r in state.values() if "start" in r), default=0.0)
    return [f"| {k} | {r['seconds']:.0f} | " + (f"{(r['start'] - t0) / 60:.1f} | "
            f"{(r['end'] - t0) / 60:.1f} |" if "start" in r else "- | - |")
            for k, r in state.items()]


def report(out: Path, state: dict[str, Any], ablation: bool = False, seed: int = 0,
           rl_seeds: int = 1, extra: frozenset[str] = frozenset()) -> Path:
    """`report.md`: stage timings, held-out accuracy per model, SFT and RL numbers, pictures.
    `extra`: the stages of the extra RL runs (seeds, ablation), timed apart from the path."""
    pictures = {**{p.name: p for p in _pictures(out, rl_seeds, ablation)},
                **write_report(out / "rl", out / "report")}
    rows = [_eval_row(out, name) for name in ("untrained", "sft", "rl")]
    if rl_seeds > 1:
        rows += ["", f"## RL over {rl_seeds} seeds (same SFT start)", "",
                 *_seed_rows(out, seed, rl_seeds)]
    head = [f"| model | pass@1 | pass@1 sampled (T {rl_temperature()}, 2 a question) | "
            "questions | tool calls / question | context tokens / episode | answered after ≤ 1 "
            "search | wrong after 2+ | no answer |", "|---|---|---|---|---|---|---|---|---|"]
    if ablation:
        rows += ["", "## Ablation (same budget and seed; ReAct from its own SFT)", "", *head,
                 *[_eval_row(out, name).replace(f"| {name} |", f"| {label} |")
                   if (out / f"eval/{name}/summary.json").is_file()
                   else f"| {label} | not run | | | | | | | |"
                   for name, label in ABLATION_ROWS]]
        if rl_seeds > 1:
            rows += ["", f"### Ablation over {rl_seeds} seeds (held-out pass@1)", "",
                     *_ablation_seed_rows(out, seed, rl_seeds)]
    sft = [json.loads(x) for x in (out / "sft/metrics.jsonl").read_text().splitlines()]
    rl = [json.loads(x) for x in (out / "rl/metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/loss"] for r in sft if "eval/loss" in r]
    counts = json.loads((out / "questions/counts.json").read_text())
    lines = [
        "# megatron-rl quickstart report", "",
        f"Total time {wall_seconds(state.values()) / 60:.1f} min"
        + (f" ({wall_seconds(v for k, v in state.items() if k in extra) / 60:.1f} of them "
           "the extra RL runs)." if extra else "."), "",
        "## Held-out accuracy (pass@1, IterSynth agent)", "",
        "Greedy, and sampled as RL samples (no restart); the failure columns count the greedy "
        "episodes.", "",
        *head, *rows, "",
        "## Held-out steps (oracle contexts, teacher forcing)", "",
        "Share of steps the model writes exactly as the oracle, greedy from the oracle's "
        "context (token accuracy in brackets).", "",
        *_steps_rows(out), "",
        "## Training", "",
        f"- questions: {json.dumps(counts)}",
        f"- SFT: loss {sft[1]['loss']:.3f} -> {sft[-1]['loss']:.3f} over {len(sft) - 1} steps" +
        (f"; held-out loss {evals[0]:.3f} -> {evals[-1]:.3f}" if evals else ""),
        f"- RL (RDPO): rollout pass rate {_mean_rate(rl[:4])} in steps 1-{min(4, len(rl))}, "
        f"{_mean_rate(rl[-4:])} in the last {min(4, len(rl))} of {len(rl)} (every group sampled, "
        "dropped ones too; one step's rate is noisy)", "",
        "## Stages", "", "Stages that read nothing of each other run side by side while cores "
        "are free (minutes from the first stage's start).", "",
        "| stage | seconds | from | to |", "|---|---|---|---|", *_stage_rows(state), "",
        "## Pictures", "",
        *[f"![{k}]({p.relative_to(out)})" for k, p in pictures.items() if p.suffix == ".png"],
        "", "Trajectories: [report/trajectories.html](report/trajectories.html)", "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def quickstart(out: Path, seed: int = 0, smoke: bool = False, ablation: bool = False,
               rl_seeds: int = 1, run: Runner = in_subprocess) -> Path:
    """`rl_seeds`: the RL stage (and its eval) at that many seeds, from the same SFT start.
    `run`: how a stage that takes every core runs its command (the CLI: in its own process,
    where torch and transformers are imported once); the others run in child processes."""
    if rl_seeds < 1:
        raise ValueError(f"rl_seeds={rl_seeds}: at least 1")
    out.mkdir(parents=True, exist_ok=True)
    budget = SMOKE if smoke else FULL
    main = stages(out, seed, budget)
    extra = seed_stages(out, main, seed, rl_seeds) + (
        ablation_stages(out, main, seed, budget, rl_seeds) if ablation else [])
    state = run_stages(out, main + extra, run)
    path = report(out, state, ablation, seed, rl_seeds, frozenset(s.name for s in extra))
    print(f"[quickstart] report: {path}", flush=True)
    return path

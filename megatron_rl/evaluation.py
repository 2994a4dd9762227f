"""Training-free evaluation: an agent scaffold (IterSynth or ReAct) over any OpenAI-compatible
model on a question set, judged, reported as pass@1 (the IterSynth paper's Claude/DeepSeek
setting). `megatron-rl eval --agent itersynth --model-url URL --questions q.jsonl --index DIR`.

Questions come from JSONL or parquet rows with `question` and `answer` (or `reference`)
columns. Tools: the local index (`--index`, search + visit of its pages) or a search service
(`--search-url`). Judge: the rule judge (normalized exact match) unless `--judge-url` names an
OpenAI-compatible GenRM. Writes `trajectories.jsonl` (every turn) and `summary.json`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.config.schema import SearchConfig


@dataclass
class EvalConfig:
    questions: str
    model_url: str | None = None         # an OpenAI-compatible base URL, ending in /v1
    model_dir: str | None = None         # or an HF folder, served here by the embedded engine
    model: str = "default"
    api_key_env: str | None = None       # the *name* of the variable holding the key
    agent: str = "itersynth"             # itersynth | react
    index: str | None = None             # local search index folder
    search_url: str | None = None        # or a `megatron-rl search serve` URL
    judge_url: str | None = None         # GenRM endpoint; the rule judge when unset
    judge_model: str = "default"
    tokenizer: str | None = None         # token bookkeeping (any ChatML tokenizer)
    out: str = "runs/eval"
    limit: int | None = None
    concurrency: int = 8
    engine_threads: int = 1  # --model-dir: the engine's intra-op threads (tiny models: 1)
    prefix_cache: bool = True  # --model-dir: the engine runs shared prompt prefixes once
    max_turns: int = 8
    max_new_tokens: int = 2048
    tool_specs: bool = True  # the tools' schemas in the system prompt (as the policy trained)
    top_k: int = SearchConfig.top_k      # search results per call that does not ask
    # context management: restart an unanswered episode (sampled decoding only: a greedy
    # restart repeats the same episode; 0 of 29 succeeded in the quickstart's evals)
    retries: int = 1
    temperature: float = 0.0
    unstick_temperature: float = 0.0  # IterSynth, greedy: re-decode notes that did not change
    stop_on_repeat: bool = True       # IterSynth, greedy: end an episode whose state repeats
    seed: int = 0                     # sampled requests' seeds derive from it and the request
    samples: int = 1                  # episodes per question (pass@1 is their mean)


def read_questions(path: str, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows with a question and its reference answer (`question`/`answer` columns, or the verl
    schema: `prompt` and `reward_model.ground_truth`), named by the column that is missing."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"questions file not found: {p}")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(p).to_pylist()
    else:
        rows = []
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{n}: not JSON ({e.msg})") from None
    if rows and "question" not in rows[0] and "prompt" in rows[0]:  # verl schema
        from megatron_rl.data.parquet import read_prompts

        prompts = read_prompts([p])[:limit or None]
        return [{"question": q.question, "answer": q.answer, "messages": q.messages}
                for q in prompts]
    out = []
    for n, row in enumerate(rows[:limit] if limit else rows, 1):
        question, answer = row.get("question"), row.get("answer", row.get("reference"))
        if not isinstance(question, str) or not isinstance(answer, str):
            missing = "question" if not isinstance(question, str) else "answer"
            raise ValueError(f"{p} row {n}: column '{missing}' is missing or not text")
        out.append({"question": question, "answer": answer})
    if not out:
        raise ValueError(f"{p}: no questions")
    return out


def _tools(cfg: EvalConfig) -> list:
    from megatron_rl.env.search import HttpSearch, LocalSearch
    from megatron_rl.env.visit import HttpPages, LocalPages, Visit

    if cfg.index:
        return [LocalSearch(cfg.index, top_k=cfg.top_k), Visit(LocalPages(cfg.index))]
    if cfg.search_url:
        return [HttpSearch(cfg.search_url, top_k=cfg.top_k), Visit(HttpPages(cfg.search_url))]
    raise ValueError("tools: give --index (a local search index) or --search-url")


def _tokenizer(cfg: EvalConfig) -> Any:
    if cfg.tokenizer or cfg.model_dir:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model_dir,
                                             local_files_only=True)
    from megatron_rl.agents.tokenizer import tiny_qwen3_tokenizer

    return tiny_qwen3_tokenizer(vocab_size=2048)  # byte-level: any text round-trips


async def evaluate_prompts(agent: Any, engine: Any, score: Any, prompts: list[Any],
                           prefix: str = "eval") -> dict[str, float]:
    """The agent once on each held-out prompt (as configured, e.g. greedy), scored by
    `score(trajectories)`; the taxonomy metrics under `prefix/` (pass rate, reward, turns,
    lengths, abnormal rates)."""
    from megatron_rl.env.base import row_arguments
    from megatron_rl.rewards.taxonomy import taxonomy_metrics

    async def one(p: Any) -> Any:
        with row_arguments(getattr(p, "metadata", {}).get("tool_arguments")):  # tools_kwargs
            return await agent.run(p.question, p.answer, engine, group_id=p.uid, uid=p.uid, **(
                {"messages": p.messages} if getattr(p, "messages", None) else {}))

    trajs = list(await asyncio.gather(*(one(p) for p in prompts)))
    await score(trajs)
    return {f"{prefix}/{k.split('/', 1)[-1]}": v for k, v in taxonomy_metrics(trajs).items()
            if k.startswith(("rollout/", "reward/"))}


async def run_eval(cfg: EvalConfig, progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    from megatron_rl.agents.base import AgentConfig
    from megatron_rl.agents.context import for_eval
    from megatron_rl.agents.registry import AGENTS
    from megatron_rl.engines.base import SamplingParams
    from megatron_rl.engines.openai_chat import OpenAIChatEngine
    from megatron_rl.rewards.composite import build_judge, judge_trajectory
    from megatron_rl.rewards.taxonomy import taxonomy_metrics
    from megatron_rl.utils.chat_client import ChatClient, ClientConfig

    agent_cls = AGENTS.get(cfg.agent, "--agent")
    rows = read_questions(cfg.questions, cfg.limit)
    if cfg.samples < 1:
        raise ValueError(f"--samples: {cfg.samples}; at least 1 episode per question")
    tokenizer = _tokenizer(cfg)
    agent_cfg = AgentConfig(max_turns=cfg.max_turns, sampling=SamplingParams(
        temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens),
        max_context_tokens=max(32_768, 4 * cfg.max_new_tokens), tool_specs=cfg.tool_specs,
        unstick_temperature=cfg.unstick_temperature, stop_on_repeat=cfg.stop_on_repeat,
        seed=cfg.seed)
    agent = for_eval(agent_cls(tokenizer, _tools(cfg), agent_cfg), discard_all=True,
                     retries=cfg.retries if cfg.temperature > 0 else 0)
    server = None
    if cfg.model_dir:  # token in, token out: the agent's contexts exactly as in training
        import transformers

        from megatron_rl.engines.embedded import EmbeddedServer
        from megatron_rl.engines.http_client import HttpEngine

        model = transformers.AutoModelForCausalLM.from_pretrained(cfg.model_dir,
                                                                  local_files_only=True)
        server = EmbeddedServer(model, tokenizer, max_batch_size=cfg.concurrency,
                                threads=cfg.engine_threads or None,
                                prefix_cache=cfg.prefix_cache).start()
        engine: Any = HttpEngine(server.url)
    elif cfg.model_url:
        engine = OpenAIChatEngine(ChatClient(ClientConfig(
            base_url=cfg.model_url, model=cfg.model, api_key_env=cfg.api_key_env,
            max_concurrency=cfg.concurrency, max_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature)), tokenizer)
    else:
        raise ValueError("give --model-url (an OpenAI-compatible endpoint) or --model-dir "
                         "(an HF folder)")
    judge = build_judge({"kind": "genrm", "base_url": cfg.judge_url, "model": cfg.judge_model}
                        if cfg.judge_url else None)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    slots = asyncio.Semaphore(cfg.concurrency)
    bar = tqdm(total=len(rows) * cfg.samples, desc=f"eval {cfg.agent}", unit="episode",
               disable=not progress, file=sys.stderr)
    t0 = time.time()

    async def one(i: int, k: int, row: dict[str, str]):
        async with slots:
            # the request ids (and so the sampled requests' seeds) follow from the question,
            # the sample and --seed alone: a sampled eval is reproducible
            uid = f"q{i}" if cfg.samples == 1 else f"q{i}.s{k}"
            try:
                traj = await agent.run(row["question"], row["answer"], engine, group_id=f"q{i}",
                                       uid=uid, **({"messages": row["messages"]}
                                                   if row.get("messages") else {}))
            except Exception as e:  # the model endpoint failed for good: count, don't stop
                return None, f"{type(e).__name__}: {e}"
            await judge_trajectory(traj, judge)
            bar.update(1)
            return traj, None

    try:
        results = await asyncio.gather(*(one(i, k, r) for i, r in enumerate(rows)
                                         for k in range(cfg.samples)))
    finally:
        bar.close()
        await engine.close()
        if server is not None:
            server.stop()
    trajectories = [t for t, _ in results if t is not None]
    failures = [why for _, why in results if why is not None]
    with (out / "trajectories.jsonl").open("w") as f:
        for t in trajectories:
            f.write(json.dumps(t.to_dict()) + "\n")
    judged = [t for t in trajectories if "outcome" in t.rewards]
    right = [t for t in judged if t.metadata["judge"]["correct"] is True]
    summary = {
        "agent": cfg.agent, "model": cfg.model_dir or cfg.model, "questions": len(rows),
        "samples": cfg.samples, "temperature": cfg.temperature,
        # an episode that failed for good counts as wrong, as does an unjudged one
        "pass@1": len(right) / (len(rows) * cfg.samples),
        **({f"pass@{cfg.samples}": len({t.group_id for t in right}) / len(rows)}
           if cfg.samples > 1 else {}),
        "mean_score": sum(t.rewards["outcome"] for t in judged) / max(len(judged), 1),
        "engine_failures": len(failures), "judge_failures": len(trajectories) - len(judged),
        "seconds": time.time() - t0, **taxonomy_metrics(trajectories),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    return summary


def step_accuracy(model_dir: str, trajectories: str, limit: int | None = None,
                  progress: bool = True, threads: int = 0) -> dict[str, Any]:
    """Per-step accuracy of an HF model on reference (e.g. oracle-teacher) trajectories: every
    turn's context is fed as recorded and the model's argmax is compared with the recorded
    output, token by token. A turn counts as reproduced when every token matches, which is
    exactly when greedy decoding from that context writes it. Reported per kind of step
    (the role, and for acting turns the tool called or `answer`), so a run whose episodes all
    fail still shows which step it cannot take yet (pass@1 multiplies the steps).
    `name_accuracy`: the same over the output tokens that are single-id names (page titles
    and URLs of a `--title-tokens` tokenizer): the copies a held-out answer depends on.
    `threads`: torch's intra-op threads (0: its default)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.records.trajectory import full_contexts
    from megatron_rl.utils.tokens import added_word_ids

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    try:  # a folder without a tokenizer has no name ids to tell apart
        words = added_word_ids(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
    except (OSError, ValueError):
        words = frozenset()
    lines = Path(trajectories).read_text(encoding="utf-8").splitlines()
    rows = [json.loads(x) for x in lines if x.strip()][:limit]  # dumps: `to_dict` rows
    # kind -> [right tokens, tokens, exact turns, turns, right name tokens, name tokens]
    kinds: dict[str, list[int]] = {}
    for traj in tqdm(rows, desc="step accuracy", unit="episode", disable=not progress):
        for turn in full_contexts(traj["turns"]):
            ctx, out = list(turn.get("context_ids") or ()), list(turn.get("output_ids") or ())
            if not ctx or not out:
                continue
            # logits only where an output token is predicted: over the whole context they
            # were most of the work (34k ids x ~1,000 positions a turn)
            with torch.no_grad():
                logits = model(torch.tensor([ctx + out]),
                               logits_to_keep=len(out) + 1).logits[0, :-1]
            hits = logits.argmax(-1) == torch.tensor(out)
            right = int(hits.sum())
            is_name = torch.tensor([t in words for t in out])
            name_hits, name_count = int(hits[is_name].sum()), int(is_name.sum())
            role = turn.get("role") or "assistant"
            names = sorted({str(c.get("name")) for c in turn.get("tool_calls") or ()})
            kind = ("synthesizer:notes" if role == "synthesizer"
                    else f"{role}:{'+'.join(names) or 'answer'}")
            for key in (kind, "all"):
                k = kinds.setdefault(key, [0] * 6)
                for i, v in enumerate((right, len(out), right == len(out), 1, name_hits,
                                       name_count)):
                    k[i] += v
    return {"model": model_dir, "trajectories": trajectories, "episodes": len(rows),
            "steps": {k: {"token_accuracy": v[0] / v[1], "reproduced": v[2] / v[3],
                          "turns": v[3], "name_accuracy": v[4] / v[5] if v[5] else None,
                          "names": v[5]} for k, v in sorted(kinds.items())}}

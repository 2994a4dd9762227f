"""`megatron-rl` entry point. Commands that do not train import nothing heavy."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from megatron_rl.checkpoint.errors import CheckpointError, HFCheckpointError, WeightMapError
from megatron_rl.config.loader import ConfigError, load_config, to_yaml
from megatron_rl.config.schema import SearchConfig


def _load(recipe: str, overrides: list[str]):
    """The recipe's config, its registry fields checked against every role's registry."""
    import megatron_rl.tasks  # noqa: F401  (creates the registries)

    return load_config(recipe, overrides)


def _config_show(args: argparse.Namespace) -> int:
    cfg = _load(args.recipe, args.overrides)
    print(to_yaml(cfg), end="")
    return 0


def _models(args: argparse.Namespace) -> int:
    from megatron_rl.models.registry import available_models, get_model_spec

    print(f"{'name':20s} {'architecture':12s} {'params':>10s} {'layers':>6s} {'experts':>9s}")
    for name in available_models():
        spec = get_model_spec(name)
        experts = f"{spec.num_experts}/{spec.moe_router_topk}" if spec.is_moe else "dense"
        params = spec.num_parameters()
        shown = f"{params / 1e9:.2f}B" if params > 1e8 else f"{params / 1e6:.3f}M"
        print(f"{name:20s} {spec.architecture:12s} {shown:>10s} {spec.num_layers:6d} "
              f"{experts:>9s}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    """Per-GPU memory of a recipe's layout (or the cheapest layout of a model on N nodes)."""
    from megatron_rl.models import memory_plan as mp
    from megatron_rl.models.registry import get_model_spec

    if (args.recipe is None) == (args.model is None):
        raise ConfigError("plan: give --recipe R or --model M (one of them)")
    if args.recipe is not None:
        cfg = load_config(args.recipe, args.overrides)
        result = mp.plan_config(cfg, args.gpu)
        proposal = None
        if not result.fits and not result.device.shared:
            # the recipe's own layout with the engine share the trainer leaves, else a search
            proposal = mp.fit_engine_fraction(result)
            if not proposal.fits:
                proposal = mp.propose(get_model_spec(cfg.model.name), result.workload,
                                      result.engine, result.device, min_gpus=result.gpus,
                                      recompute=result.layout.recompute)
    else:
        if args.overrides:
            raise ConfigError("plan: overrides go with --recipe")
        spec = get_model_spec(args.model)
        device = mp.get_device(args.gpu)
        wl = mp.Workload(tokens=args.tokens, seq_length=args.tokens)
        engine = mp.Engine(kind="sglang", layout=args.engine, num_engines=max(
            1, args.nodes * device.gpus_per_node // args.engine_gpus), gpus=args.engine_gpus,
            mem_fraction=args.engine_mem_fraction) if args.engine != "none" else mp.Engine()
        world = args.nodes * device.gpus_per_node
        if engine.layout == "disaggregated":
            engine = dataclasses.replace(engine, num_engines=args.engine_nodes * (
                device.gpus_per_node // args.engine_gpus))
            world -= engine.total_gpus
        if world < 1:
            raise ConfigError(f"plan: --nodes {args.nodes} leaves no GPU for the trainer")
        result = mp.propose(spec, wl, engine, device, world=world)
        proposal = None
        if result is None:  # nothing fits on these nodes: say how many would do
            proposal = mp.propose(spec, wl, engine, device, min_gpus=world + 1)
            result = mp.closest(spec, wl, engine, device, world)
            result.notes.append(f"no layout of {spec.name} fits {args.nodes} node(s); shown: "
                                "the one with the smallest trainer peak")
    if args.json:
        out = result.to_dict()
        out["proposal"] = proposal.to_dict() if proposal is not None else None
        print(json.dumps(out, indent=1))
    else:
        print(mp.format_plan(result, proposal))
    return 0 if result.fits else 1


def _lm_train(args: argparse.Namespace) -> int:
    from megatron_rl.distributed.process_groups import min_world_size
    from megatron_rl.trainer.lm_loop import run_lm_training

    cfg = load_config(args.recipe, args.overrides)
    nproc = args.nproc or min_world_size(cfg.parallel)
    print(f"[megatron-rl] {cfg.model.name}: tp={cfg.parallel.tp} pp={cfg.parallel.pp} "
          f"ep={cfg.parallel.ep} on {nproc} rank(s), {cfg.train.steps} steps", flush=True)
    t0 = time.time()
    rows = _launch(run_lm_training, nproc, cfg, backend=cfg.parallel.backend)[0]
    if rows:
        first, last = rows[0]["loss"], rows[-1]["loss"]
        print(f"[megatron-rl] loss {first:.3f} -> {last:.3f} over {len(rows)} steps "
              f"in {time.time() - t0:.0f}s; curves: {cfg.train.output_dir}/lm_curves.png; "
              f"metrics: {cfg.train.output_dir}/metrics.jsonl")
    return 0


def _convert_hf_to_megatron(args: argparse.Namespace) -> int:
    from megatron_rl.checkpoint.convert import import_hf
    from megatron_rl.utils.logs import quiet_libraries

    quiet_libraries()
    r = import_hf(args.hf, args.out, args.model, dtype=args.dtype)
    print(f"[convert] {args.hf} -> {args.out} (torch_dist, loads at any TP/PP/EP layout, "
          f"{r['tensors']} chunks): {r['bytes'] / 1e6:.1f} MB in {r['seconds']:.1f}s "
          f"({r['mb_per_s']:.1f} MB/s), peak RSS {r['peak_rss_mb']:.0f} MB")
    return 0


def _convert_megatron_to_hf(args: argparse.Namespace) -> int:
    from megatron_rl.checkpoint.convert import export_hf
    from megatron_rl.utils.logs import quiet_libraries

    quiet_libraries()
    if args.fp8:  # a bf16 export next to the target, then its FP8 twin in the target's place
        import shutil
        from pathlib import Path

        out = Path(args.out)
        if out.exists() and not args.overwrite:
            raise FileExistsError(f"{out} exists (pass --overwrite to replace it)")
        staged = out.parent / f".bf16-{out.name}"
        try:
            export_hf(args.ckpt, str(staged), args.model, tokenizer_dir=args.tokenizer,
                      dtype="bf16", max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
                      overwrite=True)
            return _quantize_fp8(str(staged), args)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
    r = export_hf(args.ckpt, args.out, args.model, tokenizer_dir=args.tokenizer,
                  dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
                  overwrite=args.overwrite)
    print(f"[convert] {args.ckpt} -> {args.out} (HF, {len(r['files'])} shard(s), "
          f"{r['tensors']} tensors): {r['bytes'] / 1e6:.1f} MB in {r['seconds']:.1f}s "
          f"({r['mb_per_s']:.1f} MB/s), peak RSS {r['peak_rss_mb']:.0f} MB")
    return 0


def _quantize_fp8(src: str, args: argparse.Namespace) -> int:
    """`src` (an HF folder) as blockwise FP8 into `args.out`."""
    from megatron_rl.checkpoint.fp8 import REL_BOUND, quantize_hf_checkpoint

    r = quantize_hf_checkpoint(src, args.out, args.model, backend=args.fp8_backend,
                               max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
                               overwrite=args.overwrite)
    print(f"[convert] {args.out}: blockwise FP8 e4m3 (128x128, {r['backend']} quantizer), "
          f"{r['fp8_tensors']} FP8 tensors, {r['kept_tensors']} kept as stored, "
          f"{r['bytes'] / 1e6:.1f} MB in {r['seconds']:.1f}s; max relative error "
          f"{r['max_normal_relative_error']:.4f} (bound {REL_BOUND:g})")
    return 0


def _convert_fp8(args: argparse.Namespace) -> int:
    from megatron_rl.utils.logs import quiet_libraries

    quiet_libraries()
    return _quantize_fp8(args.hf, args)


def _search_build(args: argparse.Namespace) -> int:
    from megatron_rl.env.index import CorpusError, build_index, folder_bytes

    try:
        m = build_index(args.corpus, args.out, overwrite=args.overwrite,
                        progress=not args.no_progress, heap_mb=args.heap_mb)
    except CorpusError as e:
        print(f"megatron-rl: corpus error: {e}", file=sys.stderr)
        return 2
    print(f"[search] {args.corpus} -> {args.out}: {m['docs']} docs "
          f"({m['duplicates_skipped']} duplicate URLs skipped) in {m['build_seconds']:.1f}s, "
          f"{folder_bytes(args.out) / 1e6:.1f} MB")
    return 0


def _convert_init_hf(args: argparse.Namespace) -> int:
    from megatron_rl.checkpoint.hf_init import init_hf_model
    from megatron_rl.models.registry import get_model_spec

    spec = get_model_spec(args.model)
    if args.tie_embeddings:
        spec = dataclasses.replace(spec, tie_word_embeddings=True)
    out = init_hf_model(spec, args.tokenizer, args.out, seed=args.seed,
                        embedding_std=args.embedding_std)
    print(f"[convert] {args.model} with random weights (seed {args.seed}) -> {out}", flush=True)
    return 0


def _search_serve(args: argparse.Namespace) -> int:
    from megatron_rl.env.index import IndexOpenError, SearchIndex
    from megatron_rl.env.service import serve

    def ready(url: str, index: SearchIndex) -> None:
        # one parseable line: scripts that pass --port 0 read the port from it
        print(f"[search] serving {args.index} ({index.num_docs} docs) on {url}", flush=True)

    try:
        serve(args.index, args.host, args.port, threads=args.threads, on_ready=ready)
    except IndexOpenError as e:
        print(f"megatron-rl: {e}", file=sys.stderr)
        return 2
    return 0


def _train(args: argparse.Namespace) -> int:
    from megatron_rl.data.parquet import DataError
    from megatron_rl.distributed.process_groups import min_world_size
    from megatron_rl.distributed.spmd import trainer_ranks
    from megatron_rl.train import check_inputs, train
    from megatron_rl.utils.logs import quiet_libraries

    quiet_libraries()
    cfg = _load(args.recipe, args.overrides)
    # Ray trainer ranks: one per trainer bundle
    nproc = args.nproc or (cfg.rollout.trainer_ranks if cfg.rollout.trainer_launcher == "ray"
                           else min_world_size(cfg.parallel))
    try:
        check_inputs(cfg)  # a bad row or tokenizer fails here, before any rank or engine
    except (DataError, ValueError) as e:  # a bad data file, row, field or tokenizer
        print(f"megatron-rl: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    # past the checks an error is the run's own: it keeps its traceback
    with trainer_ranks(nproc, cfg.parallel.backend, cfg.rollout) as group:
        if group is None:  # a torchrun rank other than 0: it served rank 0's jobs
            return 0
        print(f"[megatron-rl] RL: {cfg.rl.agent} agent, {cfg.model.hf_path or cfg.model.name} on "
              f"{getattr(group, 'world_size', nproc)} trainer rank(s), {cfg.train.steps} steps",
              flush=True)
        for line in getattr(group, "describe", list)():  # Ray ranks: where each landed
            print(f"[megatron-rl] {line}", flush=True)
        rows = train(cfg, group)
    if rows:
        # over every group sampled: dynamic sampling may keep none in a step
        rate = "rollout/sampled_outcome_mean"
        print(f"[megatron-rl] sampled pass rate {rows[0][rate]:.3f} -> "
              f"{rows[-1][rate]:.3f} over {len(rows)} steps; "
              f"curves and trajectories in {cfg.train.output_dir}/")
    return 0


def _sft(args: argparse.Namespace) -> int:
    from megatron_rl.data.parquet import DataError
    from megatron_rl.distributed.process_groups import min_world_size
    from megatron_rl.distributed.spmd import trainer_ranks
    from megatron_rl.sft import sft
    from megatron_rl.utils.logs import quiet_libraries

    quiet_libraries()
    cfg = _load(args.recipe, args.overrides)
    nproc = args.nproc or min_world_size(cfg.parallel)
    try:
        with trainer_ranks(nproc, cfg.parallel.backend) as group:
            if group is None:  # a torchrun rank other than 0: it served rank 0's jobs
                return 0
            print(f"[megatron-rl] SFT: {cfg.model.hf_path or cfg.model.name} on "
                  f"{getattr(group, 'world_size', nproc)} trainer rank(s)", flush=True)
            rows = sft(cfg, group)
    except DataError as e:
        print(f"megatron-rl: data error: {e}", file=sys.stderr)
        return 2
    trained = [r for r in rows if "loss" in r]
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    if trained:
        print(f"[megatron-rl] loss {trained[0]['loss']:.3f} -> {trained[-1]['loss']:.3f} over "
              f"{len(trained)} steps" + (f"; held-out loss {evals[0]:.3f} -> {evals[-1]:.3f}"
                                        if evals else "") +
              f"; curves: {cfg.train.output_dir}/sft_curves.png", flush=True)
    return 0


def _climb(args: argparse.Namespace) -> int:
    from megatron_rl.climb import climb
    from megatron_rl.data.parquet import DataError
    from megatron_rl.distributed.process_groups import min_world_size
    from megatron_rl.distributed.spmd import trainer_ranks
    from megatron_rl.utils.logs import quiet_libraries

    quiet_libraries()
    extra = [] if args.rounds is None else [f"climb.rounds={args.rounds}"]
    cfg = _load(args.recipe, [*args.overrides, *extra])
    nproc = args.nproc or min_world_size(cfg.parallel)
    try:
        with trainer_ranks(nproc, cfg.parallel.backend) as group:
            if group is None:  # a torchrun rank other than 0: it served rank 0's jobs
                return 0
            records = climb(cfg, group)
    except (DataError, ValueError) as e:
        print(f"megatron-rl: {e}", file=sys.stderr)
        return 2
    for r in records:
        print(f"[climb] round {r['round']}: " + (
            r["stopped"] if "stopped" in r else
            f"RL pass rate {r['rl/pass_rate_first']:.3f} -> {r['rl/pass_rate_last']:.3f}"),
            flush=True)
    print(f"[climb] records in {cfg.train.output_dir}/climb.jsonl", flush=True)
    return 0


def _eval(args: argparse.Namespace) -> int:
    import asyncio

    from megatron_rl.evaluation import EvalConfig, run_eval
    from megatron_rl.utils.logs import quiet_libraries

    quiet_libraries()
    cfg = EvalConfig(**{k: v for k, v in vars(args).items() if k not in ("command", "func")})
    try:
        s = asyncio.run(run_eval(cfg))
    except (FileNotFoundError, ValueError) as e:
        print(f"megatron-rl: {e}", file=sys.stderr)
        return 2
    k = s["samples"]
    several = f" x {k} samples, pass@{k} {s[f'pass@{k}']:.3f}" if k > 1 else ""
    print(f"[eval] {s['agent']} on {s['model']}: pass@1 {s['pass@1']:.3f} over "
          f"{s['questions']} questions{several} (mean score {s['mean_score']:.3f}; engine "
          f"failures {s['engine_failures']}, judge failures {s['judge_failures']}) in "
          f"{s['seconds']:.0f}s; trajectories and summary in {cfg.out}/")
    return 0


def _eval_steps(args: argparse.Namespace) -> int:
    from megatron_rl.evaluation import step_accuracy

    try:
        result = step_accuracy(args.model_dir, args.trajectories, args.limit,
                               threads=args.threads)
    except (OSError, ValueError) as e:
        print(f"megatron-rl: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for kind, s in result["steps"].items():
        names = "" if s["name_accuracy"] is None else \
            f"  names {s['name_accuracy']:.3f} of {s['names']}"
        print(f"[eval-steps] {kind:24s} reproduced {s['reproduced']:.3f}  token accuracy "
              f"{s['token_accuracy']:.3f}{names}  ({s['turns']} turns)", flush=True)
    return 0


def _launch(fn, nproc: int, *args, backend: str = "auto") -> list:
    """Run `fn(*args)` SPMD: in this process under torchrun (one rank), else on `nproc` local
    gloo ranks. Returns the per-rank results (just this rank's under torchrun)."""
    if "RANK" in os.environ:
        from megatron_rl.distributed.process_groups import init_distributed, shutdown_distributed

        init_distributed(backend)
        try:
            return [fn(*args)]
        finally:
            shutdown_distributed()
    from megatron_rl.distributed.worker_pool import WorkerPool

    with WorkerPool(nproc) as pool:
        return pool.run(fn, *args, timeout=24 * 3600)


def _main_in_process(argv: list[str], _stage: str = "") -> int:
    """`megatron-rl ARGV` in this process, with the exit code a separate process would give (a
    quickstart stage that takes every core: torch and transformers are imported once)."""
    import traceback

    try:
        return main(argv)
    except SystemExit as e:  # argparse, or a command that exits
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _quickstart(args: argparse.Namespace) -> int:
    """The embedded default end to end (megatron_rl/quickstart.py)."""
    from megatron_rl.quickstart import quickstart

    try:
        quickstart(Path(args.out), seed=args.seed, smoke=args.smoke, ablation=args.ablation,
                   rl_seeds=args.rl_seeds, run=_main_in_process)
    except (RuntimeError, FileNotFoundError, ValueError) as e:
        print(f"megatron-rl quickstart: {e}", file=sys.stderr)
        return 1
    return 0


def _slurm_submit(args: argparse.Namespace) -> int:
    """Render a recipe's run as slurm/train.sbatch with its resources; print it or submit it."""
    from megatron_rl.slurm import JobSpec, submit

    cfg = _load(args.recipe, args.overrides)  # a bad recipe fails here, not on the cluster
    job = JobSpec(recipe=args.recipe, overrides=list(args.overrides), nodes=args.nodes,
                  time=args.time, partition=args.partition, account=args.account,
                  container=args.container, container_mounts=args.container_mounts,
                  cpus_per_node=args.cpus_per_node, gpus_per_node=args.gpus_per_node,
                  job_name=args.job_name, object_store_mb=args.object_store_mb)
    return submit(cfg, job, dry_run=args.dry_run, wait=args.wait)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-rl", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("config", help="inspect configs")
    csub = c.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="print the resolved config of a recipe")
    show.add_argument("recipe", help="a name under configs/recipes/ or a YAML path")
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-6")
    show.set_defaults(func=_config_show)

    m = sub.add_parser("models", help="list the model registry")
    m.set_defaults(func=_models)

    pl = sub.add_parser("plan", help="memory planner: per-GPU weights, grads, optimizer, "
                        "activations and engine share of a layout; exit 1 if it does not fit "
                        "(docs/planner.md)")
    pl.add_argument("overrides", nargs="*", help="dotted overrides of --recipe")
    pl.add_argument("--recipe", help="a recipe name or YAML path: plan its layout")
    pl.add_argument("--model", help="a registry model: the cheapest layout on --nodes")
    pl.add_argument("--nodes", type=int, default=1)
    pl.add_argument("--gpu", default="h20", help="h20 (96 GB), h100, h800, h200, a100, cpu")
    pl.add_argument("--tokens", type=int, default=32768, help="--model: tokens per micro-batch")
    pl.add_argument("--engine", default="colocated",
                    choices=("colocated", "disaggregated", "none"))
    pl.add_argument("--engine-gpus", type=int, default=8, help="--model: GPUs per engine")
    pl.add_argument("--engine-nodes", type=int, default=1, help="--model, disaggregated: "
                    "nodes of engines")
    pl.add_argument("--engine-mem-fraction", type=float, default=None,
                    help="--model: SGLang's mem_fraction_static; default: colocated, what the "
                    "trainer leaves; disaggregated, SGLang's own")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(func=_plan)

    tr = sub.add_parser("train", help="RL: rollouts with an agent, rewards, Megatron updates")
    tr.add_argument("recipe")
    tr.add_argument("overrides", nargs="*")
    tr.add_argument("--nproc", type=int, default=0, help="trainer ranks (default: from layout)")
    tr.set_defaults(func=_train)

    sf = sub.add_parser("sft", help="SFT: Megatron training on trajectories or chats, loss on "
                        "the assistant's tokens only (docs/sft.md)")
    sf.add_argument("recipe")
    sf.add_argument("overrides", nargs="*")
    sf.add_argument("--nproc", type=int, default=0, help="trainer ranks (default: from layout)")
    sf.set_defaults(func=_sft)

    lm = sub.add_parser("lm-train", help="next-token training of a registry model (Megatron)")
    lm.add_argument("recipe")
    lm.add_argument("overrides", nargs="*")
    lm.add_argument("--nproc", type=int, default=0, help="local ranks (default: from layout)")
    lm.set_defaults(func=_lm_train)

    conv = sub.add_parser("convert", help="HF ⇄ Megatron checkpoints (no GPU needed)")
    csub2 = conv.add_subparsers(dest="direction", required=True)
    h2m = csub2.add_parser("hf-to-megatron", help="HF folder → torch_dist (loads at any layout)")
    h2m.add_argument("--hf", required=True, help="HF checkpoint folder")
    h2m.add_argument("--out", required=True, help="torch_dist folder to create")
    h2m.add_argument("--model", required=True, help="registry entry, e.g. qwen3-30b-a3b, or "
                     "an HF folder with the model's config.json")
    h2m.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    h2m.set_defaults(func=_convert_hf_to_megatron)
    ini = csub2.add_parser("init-hf", help="a new HF folder with random weights, sized to a "
                           "tokenizer folder")
    ini.add_argument("--model", required=True, help="registry entry (architecture), e.g. "
                     "tiny-moe")
    ini.add_argument("--tokenizer", required=True, help="HF tokenizer folder (with a chat "
                     "template)")
    ini.add_argument("--out", required=True, help="HF folder to create")
    ini.add_argument("--seed", type=int, default=0)
    ini.add_argument("--tie-embeddings", dest="tie_embeddings", action="store_true",
                     help="one matrix for the input embedding and the output layer: a copied "
                     "id's logit is its embedding's self-similarity, even for ids never trained")
    ini.add_argument("--embedding-std", dest="embedding_std", type=float, default=None,
                     help="draw the input embedding from N(0, std^2) (default: the "
                     "architecture's 0.02); tied, a copied id's logit starts as its row's "
                     "squared norm")
    ini.set_defaults(func=_convert_init_hf)
    m2h = csub2.add_parser("megatron-to-hf", help="torch_dist → HF safetensors (streaming)")
    m2h.add_argument("--ckpt", required=True, help="a step folder, or a run folder with latest")
    m2h.add_argument("--out", required=True, help="HF folder to create")
    m2h.add_argument("--model", required=True, help="registry entry, or the HF folder the "
                     "run started from (model.hf_path)")
    m2h.add_argument("--tokenizer", help="folder whose tokenizer files are copied")
    m2h.add_argument("--dtype", choices=("fp32", "bf16"), help="default: as stored")
    m2h.add_argument("--max-shard-gb", type=float, default=2.0)
    m2h.add_argument("--overwrite", action="store_true")
    m2h.add_argument("--fp8", action="store_true", help="write a blockwise-128x128 FP8 "
                     "checkpoint (SGLang fp8; docs/fp8.md) instead of bf16/fp32")
    m2h.add_argument("--fp8-backend", dest="fp8_backend", default="auto",
                     choices=("auto", "torch", "modelopt"))
    m2h.set_defaults(func=_convert_megatron_to_hf)
    fp8 = csub2.add_parser("fp8", help="HF folder → blockwise-FP8 HF folder for SGLang "
                           "(docs/fp8.md)")
    fp8.add_argument("--hf", required=True, help="HF checkpoint folder (bf16/fp16/fp32)")
    fp8.add_argument("--out", required=True, help="FP8 HF folder to create")
    fp8.add_argument("--model", help="registry entry or HF folder; default: from the "
                     "folder's config.json")
    fp8.add_argument("--fp8-backend", dest="fp8_backend", default="auto",
                     choices=("auto", "torch", "modelopt"),
                     help="auto: nvidia-modelopt with CUDA, else plain torch (same format)")
    fp8.add_argument("--max-shard-gb", type=float, default=2.0)
    fp8.add_argument("--overwrite", action="store_true")
    fp8.set_defaults(func=_convert_fp8)

    se = sub.add_parser("search", help="the local search index and service")
    ssub = se.add_subparsers(dest="search_command", required=True)
    sb = ssub.add_parser("build", help="index a (url, title, text) corpus (.parquet/.jsonl)")
    sb.add_argument("--corpus", required=True, help="corpus .parquet or .jsonl")
    sb.add_argument("--out", required=True, help="index folder to create")
    sb.add_argument("--overwrite", action="store_true")
    sb.add_argument("--heap-mb", type=int, default=256, help="tantivy writer memory")
    sb.add_argument("--no-progress", action="store_true")
    sb.set_defaults(func=_search_build)
    sv = ssub.add_parser("serve", help="serve an index over HTTP (POST /search, /visit)")
    sv.add_argument("--index", required=True, help="index folder from `search build`")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8090, help="0: any free port (printed)")
    sv.add_argument("--threads", type=int, default=0, help="search threads (0: CPU count)")
    sv.set_defaults(func=_search_serve)

    cl = sub.add_parser("climb", help="SFT-RL climbing (Iris): RL -> select -> SFT -> RL ...")
    cl.add_argument("recipe", help="the RL recipe; its climb section names the SFT recipe")
    cl.add_argument("overrides", nargs="*")
    cl.add_argument("--rounds", type=int, default=None, help="overrides climb.rounds")
    cl.add_argument("--nproc", type=int, default=None)
    cl.set_defaults(func=_climb)

    ev = sub.add_parser("eval", help="training-free: an agent scaffold over any "
                                     "OpenAI-compatible model, judged (pass@1)")
    ev.add_argument("--agent", default="itersynth",
                    help="a registered agent (react, itersynth) or an import path module:attr")
    model = ev.add_mutually_exclusive_group(required=True)
    model.add_argument("--model-url", dest="model_url",
                       help="OpenAI-compatible base URL ending in /v1")
    model.add_argument("--model-dir", dest="model_dir",
                       help="an HF folder (e.g. a run's export), served here by the embedded "
                       "engine token in, token out")
    ev.add_argument("--model", default="default")
    ev.add_argument("--api-key-env", dest="api_key_env", default=None,
                    help="name of the environment variable holding the API key")
    ev.add_argument("--questions", required=True, help=".jsonl/.parquet: question, answer")
    ev.add_argument("--index", default=None, help="local search index folder")
    ev.add_argument("--search-url", dest="search_url", default=None)
    ev.add_argument("--judge-url", dest="judge_url", default=None,
                    help="OpenAI-compatible GenRM judge (default: rule judge, exact match)")
    ev.add_argument("--judge-model", dest="judge_model", default="default")
    ev.add_argument("--tokenizer", default=None, help="HF tokenizer folder for token counts")
    ev.add_argument("--out", default="runs/eval")
    ev.add_argument("--limit", type=int, default=None)
    ev.add_argument("--concurrency", type=int, default=8)
    ev.add_argument("--engine-threads", dest="engine_threads", type=int, default=1,
                    help="--model-dir: intra-op threads of the embedded engine (0: torch's "
                    "default; a tiny model decodes fastest on 1)")
    ev.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                    help="--model-dir: the engine runs every prompt in full")
    ev.add_argument("--max-turns", dest="max_turns", type=int, default=8)
    ev.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=2048)
    ev.add_argument("--retries", type=int, default=1)
    ev.add_argument("--temperature", type=float, default=0.0)
    ev.add_argument("--unstick-temperature", dest="unstick_temperature", type=float,
                    default=0.0, help="IterSynth at temperature 0: notes the Synthesizer left "
                    "unchanged after new evidence are decoded once more at this temperature "
                    "(else the next step repeats the last); 0 = off")
    ev.add_argument("--no-stop-on-repeat", dest="stop_on_repeat", action="store_false",
                    help="IterSynth, greedy: run an episode whose Planner context repeats an "
                    "earlier one on to the turn budget (by default it ends there, labelled "
                    "repeated_state: the same steps would follow; keep it on only with tools "
                    "that answer a repeated call alike)")
    ev.add_argument("--seed", type=int, default=0, help="sampled requests' seeds derive from "
                    "it and the request id (reproducible sampled evals)")
    ev.add_argument("--samples", type=int, default=1, help="episodes per question (sampled "
                    "decoding): pass@1 is their mean, pass@N the share of questions any solved")
    ev.add_argument("--no-tool-specs", dest="tool_specs", action="store_false",
                    help="leave the tools' schemas out of the system prompt (a policy trained "
                         "so: data teacher --no-tool-specs, rl.tool_specs=false)")
    ev.add_argument("--top-k", dest="top_k", type=int, default=SearchConfig.top_k,
                    help="search results per call when the call gives no top_k (as the policy "
                         "trained: data teacher --top-k, env.search.top_k)")
    ev.set_defaults(func=_eval)
    es = sub.add_parser("eval-steps", help="per-step accuracy of an HF model on reference "
                        "trajectories (teacher forcing): which step an agent cannot take yet")
    es.add_argument("--model-dir", dest="model_dir", required=True)
    es.add_argument("--trajectories", required=True, help="trajectory JSONL (e.g. the oracle "
                    "teacher's on the held-out questions)")
    es.add_argument("--out", required=True, help="JSON file to write")
    es.add_argument("--limit", type=int, default=None)
    es.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (0: its "
                    "default); one keeps a core free beside other work")
    es.set_defaults(func=_eval_steps)

    _add_data_commands(sub)

    q = sub.add_parser("quickstart", help="the embedded default on this machine's CPUs: "
                       "world -> questions -> teacher -> SFT -> RDPO -> held-out eval")
    q.add_argument("--out", default="runs/quickstart")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--smoke", action="store_true", help="tiny budgets: an end-to-end check")
    q.add_argument("--rl-seeds", dest="rl_seeds", type=int, default=1, help="the RL stage and "
                   "its eval at this many seeds from the same SFT checkpoint (the report gives "
                   "mean ± std and the gain over SFT)")
    q.add_argument("--ablation", action="store_true", help="also RL with GRPO, mixed-role "
                   "RDPO and ReAct+GRPO from the same SFT start, evaluated alike (at every "
                   "--rl-seeds seed, after all of them at the first)")
    q.set_defaults(func=_quickstart)

    su = sub.add_parser("slurm", help="multi-node runs on Slurm (slurm/, docs/slurm.md)")
    ssub2 = su.add_subparsers(dest="slurm_command", required=True)
    sbm = ssub2.add_parser("submit", help="render slurm/train.sbatch from a recipe and sbatch "
                           "it (Ray head + workers, Ray trainer ranks and engines, the driver)")
    sbm.add_argument("--recipe", required=True)
    sbm.add_argument("--nodes", type=int, required=True)
    sbm.add_argument("--time", default="01:00:00", help="the job's time limit")
    sbm.add_argument("--partition")
    sbm.add_argument("--account")
    sbm.add_argument("--container", help="a container image (pyxis --container-image)")
    sbm.add_argument("--container-mounts", dest="container_mounts",
                     help="pyxis mounts (default: the work dir)")
    sbm.add_argument("--cpus-per-node", dest="cpus_per_node", type=int,
                     help="default: what the recipe's Ray bundles need per node")
    sbm.add_argument("--gpus-per-node", dest="gpus_per_node", type=int,
                     help="default: what the recipe's Ray bundles need per node")
    sbm.add_argument("--job-name", dest="job_name")
    sbm.add_argument("--object-store-mb", dest="object_store_mb", type=int,
                     help="Ray object store per node (default: Ray's 30%% of RAM)")
    sbm.add_argument("--dry-run", dest="dry_run", action="store_true",
                     help="print the script, submit nothing")
    sbm.add_argument("--wait", action="store_true", help="sbatch --wait: return the job's "
                     "exit code when it ends")
    sbm.add_argument("overrides", nargs="*", help="dotted overrides for the run")
    sbm.set_defaults(func=_slurm_submit)
    return p


def _add_data_commands(sub: Any) -> None:
    """`megatron-rl data ...`: the data pipeline (each command's parser lives with its code)."""
    from megatron_rl.data.climb import add_climb_parser
    from megatron_rl.data.filters import add_filter_parser
    from megatron_rl.data.masks import add_mask_parser
    from megatron_rl.data.synthesize import add_synthesize_parser
    from megatron_rl.data.world import add_world_parser
    from megatron_rl.teacher import add_teacher_parser

    d = sub.add_parser("data", help="the data pipeline: world → synthesize → teacher → filter "
                       "→ mask → (sft) → climb")
    dsub = d.add_subparsers(dest="data_command", required=True)
    for add in (add_world_parser, add_synthesize_parser, add_teacher_parser, add_filter_parser,
                add_mask_parser, add_climb_parser):
        add(dsub)
    tk = dsub.add_parser("tokenizer", help="train a ChatML tokenizer folder on a corpus")
    tk.add_argument("--corpus", nargs="+", required=True,
                    help=".parquet/.jsonl with title/text (or question) columns")
    tk.add_argument("--out", required=True, help="HF tokenizer folder to create")
    tk.add_argument("--vocab-size", dest="vocab_size", type=int, default=2048)
    tk.add_argument("--scaffolding-weight", dest="scaffolding_weight", type=int, default=10,
                    help="copies of the agents' system prompts and tool specs in the corpus")
    tk.add_argument("--isolate-spaces", dest="isolate_spaces", action="store_true",
                    help="every space its own token: a name has the same ids after a space "
                    "and after a quote (what copying it into a tool call needs)")
    tk.add_argument("--title-tokens", dest="title_tokens", action="store_true",
                    help="every page title one token, on top of --vocab-size (a tiny model "
                    "copies a name into a call as one id; a URL that spells its title, as the "
                    "generated world's do, holds that id too)")
    tk.add_argument("--url-tokens", dest="url_tokens", action="store_true",
                    help="every page URL one token as well (URLs that do not spell their title)")
    tk.set_defaults(func=_data_tokenizer)
    for action in dsub.choices.values():  # bad input is an error that names it, not a trace
        action.set_defaults(func=_user_errors(action.get_default("func")))


def _data_tokenizer(args: argparse.Namespace) -> int:
    """A ChatML tokenizer folder trained on a corpus's titles and texts."""
    from megatron_rl.agents.scaffolding import agent_scaffolding
    from megatron_rl.agents.tokenizer import train_chat_tokenizer
    from megatron_rl.data.parquet import iter_rows

    def texts():
        for path in args.corpus:
            for _where, row in iter_rows(Path(path)):
                for key in ("title", "text", "question"):
                    if isinstance(row.get(key), str):
                        yield row[key]
        # weighted like a corpus of that many episodes: merges for the system prompts too
        yield from agent_scaffolding() * args.scaffolding_weight

    def pages():
        for path in args.corpus:
            for _where, row in iter_rows(Path(path)):
                yield tuple(row[k] if isinstance(row.get(k), str) else "" for k in ("title", "url"))

    rows = list(pages()) if args.title_tokens or args.url_tokens else []
    words = ([t for t, _ in rows if t] * args.title_tokens +
             [u for _, u in rows if u] * args.url_tokens)
    # a URL that ends in its title (the world's): the part before it one id as well, so the
    # URL is two ids, not the dozen its punctuation splits into
    prefixes = [u[:-len(t)] for t, u in rows
                if args.title_tokens and t and u.endswith(t) and len(u) > len(t)]
    tokenizer = train_chat_tokenizer(texts(), args.vocab_size, args.isolate_spaces,
                                     words=words, prefixes=prefixes)
    out = Path(args.out)
    tmp = out.with_name(f".tmp-{out.name}")
    tokenizer.save_pretrained(tmp)
    tmp.replace(out)
    print(f"[tokenizer] {len(tokenizer)} tokens (ChatML, tool and think tokens; chat template) "
          f"-> {out}", flush=True)
    return 0


def _user_errors(func: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (ValueError, OSError) as e:  # a bad or missing input file, row or field
            print(f"megatron-rl: {e}", file=sys.stderr)
            return 2
    return run


COMPUTE_COMMANDS = ("train", "sft", "lm-train", "climb", "eval", "eval-steps", "quickstart")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_rl.utils.host_memory import tune_host_memory

    # huge pages where tensors are computed on again and again (training, serving, eval); a
    # conversion streams through memory once: its peak RSS first, glibc's defaults
    tune_host_memory(reuse=args.command != "convert",
                     huge_pages=args.command in COMPUTE_COMMANDS)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"megatron-rl: config error: {e}", file=sys.stderr)
        return 2
    except (HFCheckpointError, CheckpointError, WeightMapError, FileExistsError) as e:
        print(f"megatron-rl: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""`megatron-rl` entry point. Commands that do not train import nothing heavy."""

from __future__ import annotations

import argparse
import os
import sys
import time

from megatron_rl.config.loader import ConfigError, load_config, to_yaml


def _config_show(args: argparse.Namespace) -> int:
    cfg = load_config(args.recipe, args.overrides)
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


def _launch(fn, cfg, nproc: int):
    """Run `fn(cfg)` SPMD: in-process under torchrun, else on a local gloo worker pool."""
    if "RANK" in os.environ:  # started by torchrun: this process is one rank
        from megatron_rl.distributed.process_groups import init_distributed

        init_distributed(cfg.parallel.backend)
        return fn(cfg)
    from megatron_rl.distributed.worker_pool import WorkerPool

    with WorkerPool(nproc) as pool:
        return pool.run(fn, cfg, timeout=24 * 3600)[0]


def _lm_train(args: argparse.Namespace) -> int:
    from megatron_rl.distributed.process_groups import min_world_size
    from megatron_rl.trainer.lm_loop import run_lm_training

    cfg = load_config(args.recipe, args.overrides)
    nproc = args.nproc or min_world_size(cfg.parallel)
    print(f"[megatron-rl] {cfg.model.name}: tp={cfg.parallel.tp} pp={cfg.parallel.pp} "
          f"ep={cfg.parallel.ep} on {nproc} rank(s), {cfg.train.steps} steps", flush=True)
    t0 = time.time()
    rows = _launch(run_lm_training, cfg, nproc)
    if rows:
        first, last = rows[0]["loss"], rows[-1]["loss"]
        print(f"[megatron-rl] loss {first:.3f} -> {last:.3f} over {len(rows)} steps "
              f"in {time.time() - t0:.0f}s; curves: {cfg.train.output_dir}/lm_curves.png; "
              f"metrics: {cfg.train.output_dir}/metrics.jsonl")
    return 0


def _quickstart(args: argparse.Namespace) -> int:
    args.recipe = "tiny-moe-cpu"
    return _lm_train(args)


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

    lm = sub.add_parser("lm-train", help="next-token training of a registry model (Megatron)")
    lm.add_argument("recipe")
    lm.add_argument("overrides", nargs="*")
    lm.add_argument("--nproc", type=int, default=0, help="local ranks (default: from layout)")
    lm.set_defaults(func=_lm_train)

    q = sub.add_parser("quickstart", help="the embedded default on this machine's CPUs")
    q.add_argument("overrides", nargs="*")
    q.add_argument("--nproc", type=int, default=2)
    q.set_defaults(func=_quickstart)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"megatron-rl: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

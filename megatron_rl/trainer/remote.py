"""The trainer side of the RL driver: functions every trainer rank runs (SPMD, through the
worker pool or under torchrun), around one `MegatronActor` kept for the life of the process."""

from __future__ import annotations

from typing import Any

_STATE: dict[str, Any] = {}


def init(cfg: Any) -> dict[str, Any]:
    """Build the actor (resuming from `checkpoint.load` if set); returns its layout."""
    from megatron_rl.checkpoint.training_checkpoint import load_checkpoint
    from megatron_rl.trainer.actor import MegatronActor

    actor = MegatronActor(cfg)
    if cfg.rl.kl_coef:  # the run's initial policy, also when resuming (taken before loading)
        from megatron_rl.trainer.reference import ReferencePolicy

        _STATE["reference"] = ReferencePolicy(actor)
    progress: dict[str, Any] = {"step": 0}
    if cfg.checkpoint.load:
        ref = cfg.checkpoint.load
        path = cfg.checkpoint.dir if ref == "latest" else ref
        progress = load_checkpoint(actor, path)
    _STATE.update(actor=actor, cfg=cfg)
    return {"dp": actor.layout.dp, "progress": progress}


def connect(urls: list[str]) -> None:
    """Point weight sync at the engines (they may restart on new ports between runs)."""
    from megatron_rl.rollout.weight_sync import WeightSyncer, gatherer_for

    old = _STATE.pop("syncer", None)
    if old is not None:
        old.close()
    cfg = _STATE["cfg"]
    _STATE["syncer"] = WeightSyncer(gatherer_for(_STATE["actor"]), urls,
                                    transport=cfg.rl.sync_transport,
                                    bucket_bytes=cfg.rollout.bucket_mb << 20)


def sync(version: int) -> dict[str, float]:
    stats = _STATE["syncer"].sync(version)
    return {"sync/seconds": stats.seconds, "sync/gather_s": stats.gather_s,
            "sync/mb": stats.bytes / 1e6}


def update(batch: Any, entropy_coef: float) -> dict[str, float]:
    """One policy update; `entropy_coef` comes from the driver (EntroPIC may move it)."""
    from megatron_rl.algorithms.policy_loss import PolicyLossConfig
    from megatron_rl.algorithms.tis import TISConfig
    from megatron_rl.trainer.policy_update import policy_update

    rl = _STATE["cfg"].rl
    loss = PolicyLossConfig(ratio_level=rl.ratio_level, clip_ratio_low=rl.clip_ratio_low,
                            clip_ratio_high=rl.clip_ratio_high, loss_agg_mode=rl.loss_agg_mode,
                            kl_coef=rl.kl_coef, entropy_coef=entropy_coef)
    tis = TISConfig(level=rl.tis_level, mode=rl.tis_mode, threshold=rl.tis_threshold) \
        if rl.tis_threshold > 0 else None
    return policy_update(_STATE["actor"], batch, loss, tis, _STATE.get("reference"))


def save(progress: dict[str, Any]) -> None:
    from megatron_rl.checkpoint.training_checkpoint import save_checkpoint

    cfg = _STATE["cfg"]
    save_checkpoint(_STATE["actor"], cfg.checkpoint.dir, progress=progress,
                    keep_last=cfg.checkpoint.keep_last)


def close() -> None:
    syncer = _STATE.pop("syncer", None)
    if syncer is not None:
        syncer.close()
    _STATE.clear()

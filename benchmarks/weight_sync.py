"""Weight-sync throughput: a full trainer → engine sync of a CPU-sized MoE vs a plain memcpy.

One process is the trainer (Megatron, world size 1, the local spec); the engine is the embedded
server, run as its own process (`one-copy-held`: a second one in the trainer's process, which
holds it around the writes and commits, as the RL driver does its own engine: no begin or
commit round trips; `one-copy-http`: the engine's process with its window's begin and commit
over HTTP rather than its socket, `engines/write_control.py`). Each transport syncs every
weight (HF names, fp32) and is timed end to end; the same bytes are memcpy'd in one buffer for
the reference. Each transport syncs 1 + `--repeats` times (one-copy, as fast as memcpy, 1 +
10): the first allocates (cold pages); the median of the others is what a later RL step pays;
after each one's first, the transports' syncs alternate (on two ranks too). A memcpy follows
each sync (the median of the transport's own, `Memcpy`). Medians, not the best: this host's
copy bandwidth jumps for moments from ~23 to ~40 GB/s, and a best-of-11 memcpy that caught one
against syncs that did not read 0.51 where the medians read 0.85. The one-copy goal rows are
paired: the median over steady syncs of (the memcpy right after it ÷ the sync), so that a
slow stretch of the host slows both sides of each pair. Prints bytes/s and the ratio
to memcpy, plus the time split: gather (shards → canonical tensors) / convert (HF layout) /
transfer (serialise, send, engine load; for one-copy: the writes into the engine's parameters
and the begin/commit flip).

    python benchmarks/weight_sync.py [--layers 6 --hidden 512 --experts 16 --bucket-mb 512]
        [--two-ranks ep2,pp2,tp2]

`--two-ranks`: the same model on two gloo ranks (a worker pool) at each layout. At PP2 and EP2
each rank sends what it holds (its stage's layers, its experts) and nothing is gathered: a
sender per owner against everything gathered onto rank 0 (`-rank0`). At TP2 rank 1 sends its
half of every split layer to rank 0: the bucketed path with the look-ahead (the next bucket
gathered and converted while the current one is sent) against the same without it
(`-serial`). The syncer turns the look-ahead off where nothing crosses ranks, so a `-serial`
row is compared only where the serial sync gathered.

Goals: one-copy (either window) >= 0.8x memcpy; the look-ahead <= 0.9x the serial sync; a
sender per owner <= 0.9x everything through rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from generated_moe import add_size_args, spec_yaml
from results import emit

MEMCPY_REPEATS = 10
HELD = "one-copy-held"
HTTP = "one-copy-http"


class Memcpy:
    """The reference: the same bytes copied within one buffer pair, timed right after each
    sync of a transport, the median of that transport's window. Interleaved, because a shared
    host's copy speed moves over a run and freshly allocated buffers copy slower for a while
    than ones in use (measured here: 26 ms, then 19 ms, for the same 449 MB); per window,
    because the copies of a fast minute say nothing of a slow one's syncs."""

    def __init__(self) -> None:
        self.nbytes, self.times = 0, {}

    def time(self, nbytes: int, window: str) -> None:
        if nbytes != self.nbytes:
            self.src = torch.ones(nbytes // 4)
            self.dst = torch.empty_like(self.src)
            self.dst.copy_(self.src)  # first touch
            self.nbytes, self.times = nbytes, {}
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        self.times.setdefault(window, []).append(time.perf_counter() - t0)

    def bytes_per_s(self, nbytes: int, window: str) -> float:
        """A window without syncs (the two-rank rows') gets 10 copies of its own."""
        while window not in self.times or nbytes != self.nbytes:
            for _ in range(MEMCPY_REPEATS):
                self.time(nbytes, window)
        return nbytes / statistics.median(self.times[window])


def _median(timed: list[tuple[float, object]]) -> tuple[float, object]:
    """The (seconds, stats) of the median sync (the slower of the middle two)."""
    return sorted(timed, key=lambda r: r[0])[len(timed) // 2]


def _serial(transport: str) -> dict[str, int]:
    """A `-serial` transport: no bucket gathered ahead (the look-ahead's reference)."""
    return {"look_ahead": 0} if transport.endswith("-serial") else {}


def _window_s(stats: Any) -> float:
    """What a one-copy sync waited on its window: the begin beyond the walk, and the flip."""
    return stats.extra["begin_wait_s"] + stats.extra["flip_s"]


def _cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds, all its threads (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _two_rank_job(spec: str, url: str, layout: str, transports: list[str], bucket_mb: int,
                  repeats: int, version: int, engine_pid: int) -> list[tuple[str, float, object]]:
    """Run on each rank of a 2-rank pool: every transport's first and median steady sync
    (rank 0's stats; the wall time is the slowest rank's), the transports' steady syncs
    alternating. `extra["cpu_s"]`: the CPU seconds both ranks and the engine spent in it."""
    import torch.distributed as dist

    from megatron_rl.config.loader import load_config
    from megatron_rl.trainer.actor import MegatronActor
    from megatron_rl.trainer.weight_sync import WeightSyncer, gatherer_for

    actor = MegatronActor(load_config(None, [f"model.name={spec}", "model.seq_length=64",
                                             "train.global_batch_size=2",
                                             "train.micro_batch_size=1",
                                             f"parallel.{layout[:2]}={layout[2:]}"]))
    gatherer, rows = gatherer_for(actor), []
    with contextlib.ExitStack() as stack:
        syncers = {t: stack.enter_context(WeightSyncer(
            gatherer, [url], transport="tensor", bucket_bytes=bucket_mb << 20,
            one_copy=t.startswith("one-copy"), **_serial(t), by_owner=not t.endswith("-rank0")))
            for t in transports}
        timed: dict[str, list] = {t: [] for t in transports}
        for r in range(1 + repeats):  # after each one's first, the transports alternate
            for transport in transports[r % len(transports):] + transports[:r % len(transports)]:
                version += 1
                dist.barrier()
                engine, ours, t0 = _cpu_seconds(engine_pid), time.process_time(), \
                    time.perf_counter()
                stats = syncers[transport].sync(version)
                dist.barrier()  # done when the last rank is
                timed[transport].append((time.perf_counter() - t0, stats))
                cpu = torch.tensor([time.process_time() - ours])
                dist.all_reduce(cpu)
                stats.extra["cpu_s"] = cpu.item() + _cpu_seconds(engine_pid) - engine
    for transport in transports:
        first, *steady = timed[transport]
        rows.append((f"{layout} {transport} (first)", *first))
        secs, stats = _median(steady)
        stats.extra["steady_s"] = [t for t, _ in steady]  # by round, for paired ratios
        rows.append((f"{layout} {transport} (steady)", secs, stats))
    return rows


def _two_rank_rows(a: argparse.Namespace, spec: Path, url: str, version: int,
                   engine_pid: int) -> list:
    from megatron_rl.distributed.worker_pool import WorkerPool

    rows = []
    with WorkerPool(2, threads_per_rank=1) as pool:
        for layout in a.two_ranks.split(","):
            # PP, EP: a sender per owner, nothing gathered; TP: gathered onto rank 0, where
            # the look-ahead overlaps the gathers with the sends
            transports = (["one-copy", "tensor", "tensor-serial"] if layout.startswith("tp")
                          else ["one-copy", "tensor", "one-copy-rank0", "tensor-rank0"])
            rows += pool.run(_two_rank_job, str(spec), url, layout, transports, a.bucket_mb,
                             a.repeats, version, engine_pid, timeout=1800)[0]
            version += 2 * len(transports) * (1 + a.repeats)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(p, layers=6, hidden=512, experts=16)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="steady syncs per transport (median)")
    p.add_argument("--transports", default="one-copy,one-copy-held,tensor,distributed,disk",
                   help="one-copy: the tensor transport writing into the engine's shared "
                        "parameters (the engine's process, its window over the engine's "
                        "socket); one-copy-http: the same with the window over HTTP; "
                        "one-copy-held: the same into an engine in this process, which "
                        "holds it around the writes (the RL driver's own engine); "
                        "tensor: the same transport with shm buckets; a "
                        "'-serial' suffix: without a look-ahead (at one rank nothing is "
                        "gathered, so the syncer uses none anyway: the same path)")
    p.add_argument("--two-ranks", default="", help="layouts to sync from 2 ranks too, e.g. "
                   "ep2,pp2,tp2")
    a = p.parse_args()

    from megatron_rl.checkpoint.convert import export_hf
    from megatron_rl.checkpoint.training_checkpoint import save_checkpoint
    from megatron_rl.config.loader import load_config
    from megatron_rl.distributed.process_groups import init_distributed
    from megatron_rl.engines.embedded import EmbeddedServer
    from megatron_rl.trainer.actor import MegatronActor
    from megatron_rl.trainer.weight_sync import WeightSyncer, gatherer_for

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        spec = tmp / "bench-moe.yaml"
        spec.write_text(spec_yaml(a))
        init_distributed("gloo")
        actor = MegatronActor(load_config(None, [f"model.name={spec}", "model.seq_length=64",
                                                 "train.global_batch_size=1",
                                                 "train.micro_batch_size=1"]))
        save_checkpoint(actor, tmp / "ckpt")
        export_hf(str(tmp / "ckpt"), str(tmp / "hf"), str(spec), progress=False)
        server = subprocess.Popen(
            [sys.executable, "-m", "megatron_rl.engines.embedded", "--model",
             str(tmp / "hf"), "--port", "0"], stdout=subprocess.PIPE, text=True)
        try:
            url = next(line for line in server.stdout if "http://" in line).split()[-1]
            gatherer = gatherer_for(actor)
            rows, memcpy = [], Memcpy()
            version = 0
            transports = a.transports.split(",")
            # the first sync allocates (cold pages); a run then syncs every step: the steady
            # row is the median of the later syncs, as memcpy's is (one-copy's take ~memcpy's
            # 30 ms here, so 10 of them, as of memcpy). After each one's first, the
            # transports alternate
            counts = {t: 1 + (max(a.repeats, MEMCPY_REPEATS) if t.startswith("one-copy")
                              else a.repeats) for t in transports}
            timed: dict[str, list] = {t: [] for t in transports}
            with contextlib.ExitStack() as stack:
                # one-copy-held: an engine in this process, held by it around the writes, as
                # the RL driver holds its own (`EmbeddedCore.weights_held`)
                own = stack.enter_context(EmbeddedServer.from_pretrained(
                    str(tmp / "hf")).start()) if HELD in transports else None
                syncers = {t: stack.enter_context(WeightSyncer(
                    gatherer, [own.url if t == HELD else url],
                    transport="tensor" if t.startswith("one-copy")
                    else t.removesuffix("-serial"), bucket_bytes=a.bucket_mb << 20,
                    one_copy=t.startswith("one-copy"), **_serial(t),
                    disk_dir=str(tmp / "disk"))) for t in transports}
                for e in syncers[HTTP].engines if HTTP in syncers else ():
                    e.use_write_control = False  # the begin and commit over HTTP
                for r in range(max(counts.values())):
                    for t in transports[r % len(transports):] + transports[:r % len(transports)]:
                        if len(timed[t]) == counts[t]:
                            continue
                        version += 1
                        t0 = time.perf_counter()
                        if t == HELD:
                            with own.core.weights_held(version) as segment:
                                stats = syncers[t].sync(version, [segment])
                        else:
                            stats = syncers[t].sync(version)
                        timed[t].append((time.perf_counter() - t0, stats))
                        memcpy.time(stats.bytes, t)
            for t in transports:
                first, *steady = timed[t]
                rows.append((f"{t} (first)", *first))
                rows.append((f"{t} (steady)", *_median(steady)))
            if a.two_ranks:
                rows += _two_rank_rows(a, spec, url, version, server.pid)
        finally:
            server.terminate()
            server.wait()
        nbytes = rows[0][2].bytes
        # each one-rank row against the copies of its own window, the rest against 10 after
        reference = {t.split(" (")[0]: memcpy.bytes_per_s(nbytes, t.split(" (")[0])
                     for t, _, _ in rows if " " not in t.split(" (")[0]}
        after = memcpy.bytes_per_s(nbytes, "after")
    print(f"model: {a.layers} layers, hidden {a.hidden}, {a.experts} experts; "
          f"{nbytes / 1e6:.0f} MB of weights ({rows[0][2].tensors} HF tensors); "
          f"bucket {a.bucket_mb} MB; memcpy " + ", ".join(
              f"{r / 1e9:.2f} GB/s ({t})" for t, r in {**reference, "after": after}.items()))
    print(f"{'transport':28s} {'seconds':>8s} {'MB/s':>8s} {'÷ memcpy':>9s} "
          f"{'gather':>7s} {'convert':>8s} {'transfer':>9s}")
    def copy_rate(row: str) -> float:
        return reference.get(row.split(" (")[0], after)

    for transport, secs, s in rows:
        rate = nbytes / secs
        print(f"{transport:28s} {secs:8.2f} {rate / 1e6:8.0f} {rate / copy_rate(transport):9.3f} "
              f"{s.gather_s:7.2f} {s.convert_s:8.2f} {s.transfer_s:9.2f}"
              + (f"  (walk {1e3 * s.extra['walk_s']:.1f}, begin wait "
                 f"{1e3 * s.extra['begin_wait_s']:.1f}, write {1e3 * s.extra['write_s']:.1f}, "
                 f"flip {1e3 * s.extra['flip_s']:.1f} ms)"
                 if "write_s" in s.extra else "")
              + (f"  (phases overlap: {s.gather_s + s.convert_s + s.transfer_s:.2f} s of "
                 f"work in {s.wall_s:.2f} s)" if s.wall_s is not None else ""))
    # rates of the whole model's bytes (a per-stage sender's stats count its own share)
    stats = {t.removesuffix(" (steady)"): (secs, st) for t, secs, st in rows
             if t.endswith("(steady)")}
    steady = {t: nbytes / secs / copy_rate(t) for t, (secs, _) in stats.items()}
    one_rank = {t: r for t, r in steady.items() if " " not in t}
    shown = [t for t in ("one-copy", HELD) if t in one_rank] or [max(one_rank, key=one_rank.get)]
    for t in shown:
        # paired: each steady sync against the memcpy right after it, the median of those
        # ratios (a minute's speed on this shared host moves both alike; the medians of each
        # side apart, printed above, let a slow stretch of one decide)
        emit(f"weight sync / memcpy, steady ({t})", statistics.median(
            memcpy.times[t][k] / secs for k, (secs, _) in enumerate(timed[t]) if k),
             0.8, note=f"medians apart {one_rank[t]:.3f}")
    if "one-copy" in stats and HTTP in stats:
        (socket_s, st), (http_s, ht) = stats["one-copy"], stats[HTTP]
        print(f"one-copy, the window over the engine's socket / over HTTP, steady sync time: "
              f"{socket_s / http_s:.3f} (begin wait + flip {1e3 * _window_s(st):.1f} ms "
              f"against {1e3 * _window_s(ht):.1f} ms)")
    for t in [t for t in steady if f"{t}-serial" in steady]:
        # the same transport and buckets: wall time with the look-ahead / without, where the
        # gather crosses ranks (elsewhere the syncer turns the look-ahead off: the same path)
        secs, st = stats[f"{t}-serial"]
        if not st.extra.get("gathered_layers"):
            continue
        ahead, cores = st.gather_s + st.convert_s, len(os.sched_getaffinity(0))
        # overlapping wins only where the serial sync leaves cores idle: its CPU seconds
        # (both ranks and the engine) over all cores' time bound how fast any overlap can go
        floor = st.extra["cpu_s"] / cores / secs
        # and an overlap hides at most the shorter of the two phases
        phases = max(ahead, secs - ahead) / secs
        print(f"{t}-serial (steady): {st.extra['cpu_s']:.2f} CPU seconds in {secs:.2f} s on "
              f"{cores} cores: {floor:.2f} of them busy; gather + convert {ahead:.2f} s: the "
              f"fastest overlap {max(floor, phases):.2f}x")
        # paired: each round's two syncs ran back to back (a slow stretch slows both)
        paired = statistics.median(la / se for la, se in zip(
            stats[t][1].extra["steady_s"], st.extra["steady_s"], strict=True))
        emit(f"weight sync with look-ahead / without, steady ({t}, {a.bucket_mb} MB buckets)",
             paired, 0.9, better="lower",
             note=f"medians apart {steady[f'{t}-serial'] / steady[t]:.3f}; serial: gather + "
                  f"convert {ahead:.2f} s of {secs:.2f} s (an overlap hides at most that: >= "
                  f"{phases:.2f}x); its CPU use bounds any overlap at {floor:.2f}x on "
                  f"{cores} cores")
    for t in [t for t in steady if f"{t}-rank0" in steady]:
        emit(f"weight sync by owner / through rank 0, steady ({t})",
             steady[f"{t}-rank0"] / steady[t], 0.9, better="lower")


if __name__ == "__main__":
    main()

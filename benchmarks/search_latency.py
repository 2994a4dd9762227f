"""Local search index: build time, size on disk, query latency (p50/p99) and QPS by corpus size.

For each size a generated world (megatron_rl.data.world) is written to parquet and indexed with
`build_index` (the code behind `megatron-rl search build`); its multi-hop questions are the
queries (natural-language, ~10 words, top-k results with snippets, as the `search` tool asks).
Latency is per query on one thread; QPS is measured on one thread and on `--threads` threads
sharing one searcher. `hit@k` is the share of queries whose first supporting page is in the top
k. Goal: p50 <= 5 ms at 1M docs.

    python benchmarks/search_latency.py                                # 10k and 100k: ~15 s
    python benchmarks/search_latency.py --sizes 10000,100000,1000000   # adds 1M: ~2 min more,
                                                                       # ~1.1 GB peak RSS
    python benchmarks/search_latency.py --workdir /tmp/sb --reuse      # again, without rebuilding

`measure(sizes)` returns the per-size numbers as a dict (for a table of all benchmarks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from results import emit

from megatron_rl.data.world import generate_world, write_corpus
from megatron_rl.env.index import SearchIndex, build_index, folder_bytes

GOAL_MS = 5.0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_size(n: int, work: Path, queries: int, top_k: int, threads: int,
               reuse: bool = False) -> dict[str, float]:
    """Generate, index and query an `n`-doc world in `work`. `reuse`: take the corpus, index and
    questions a previous run left in `work` (build_s is then that run's)."""
    corpus, out = work / f"corpus_{n}.parquet", work / f"index_{n}"
    qfile = work / f"questions_{n}_{queries}.json"
    if reuse and (out / "manifest.json").is_file() and qfile.is_file() and corpus.is_file():
        saved = json.loads(qfile.read_text())
        gen_s, build_s = saved["gen_s"], json.loads((out / "manifest.json").read_text())[
            "build_seconds"]
        qs = [(q, support) for q, support in saved["questions"]]
    else:
        t0 = time.perf_counter()
        world = generate_world(n, seed=0)
        write_corpus(world, corpus)
        gen_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        build_index(corpus, out, progress=False, overwrite=True)
        build_s = time.perf_counter() - t0
        qs = [(q.question, q.support[0]) for q in world.questions(queries, seed=1)]
        del world  # ~1 GB at 1M docs
        qfile.write_text(json.dumps({"gen_s": gen_s, "questions": qs}))
    index = SearchIndex(out)
    texts = [q for q, _ in qs]
    for t in texts[:50]:  # warm the OS page cache and tantivy's readers
        index.search(t, top_k)
    lat, hits = [], 0
    t_all = time.perf_counter()
    for text, support in qs:
        t0 = time.perf_counter()
        res = index.search(text, top_k)
        lat.append(time.perf_counter() - t0)
        hits += support in [h.url for h in res]
    serial_s = time.perf_counter() - t_all
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda t: index.search(t, top_k), texts))
        par_s = time.perf_counter() - t0
    return {"docs": n, "gen_s": gen_s, "build_s": build_s, "mb": folder_bytes(out) / 1e6,
            "corpus_mb": corpus.stat().st_size / 1e6, "p50_ms": _pct(lat, 0.5) * 1e3,
            "p99_ms": _pct(lat, 0.99) * 1e3, "mean_ms": statistics.fmean(lat) * 1e3,
            "qps1": len(qs) / serial_s, "qpsn": len(qs) / par_s, "hit": hits / len(qs)}


def measure(sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000), *, queries: int = 2000,
            top_k: int = 5, threads: int | None = None, workdir: str | Path | None = None,
            reuse: bool = False, log: bool = False) -> dict[int, dict[str, float]]:
    """{docs: {p50_ms, p99_ms, hit, build_s, ...}} for each corpus size."""
    threads = threads or os.cpu_count() or 2
    rows: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="search_bench_") as tmp:
        work = Path(workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for n in sizes:
            r = rows[n] = bench_size(n, work, queries, top_k, threads, reuse=reuse)
            if log:
                print(f"[bench] {n} docs done: build {r['build_s']:.1f}s, p50 {r['p50_ms']:.2f} "
                      f"ms, p99 {r['p99_ms']:.2f} ms, hit@{top_k} {r['hit']:.3f}", flush=True)
    return rows


def _docs(n: int) -> str:
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else (
        f"{n // 1000}k" if n % 1000 == 0 else str(n))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10000,100000", help="comma-separated document counts")
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--workdir", help="keep corpora and indexes here (default: a temp dir)")
    p.add_argument("--reuse", action="store_true",
                   help="with --workdir: query the indexes a previous run left there")
    a = p.parse_args()
    sizes = tuple(int(s) for s in a.sizes.split(",") if s)
    rows = list(measure(sizes, queries=a.queries, top_k=a.top_k, threads=a.threads,
                        workdir=a.workdir, reuse=a.reuse, log=True).values())
    print(f"\nlocal tantivy index, {a.queries} multi-hop questions as queries, top-{a.top_k} with "
          f"snippets, {os.cpu_count()} CPU core(s)\n")
    head = (f"{'docs':>9} {'corpus MB':>9} {'gen s':>6} {'build s':>8} {'index MB':>9} "
            f"{'p50 ms':>7} {'p99 ms':>7} {'QPS 1t':>7} {f'QPS {a.threads}t':>7} "
            f"{f'hit@{a.top_k}':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['docs']:>9,} {r['corpus_mb']:>9.1f} {r['gen_s']:>6.1f} {r['build_s']:>8.1f} "
              f"{r['mb']:>9.1f} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {r['qps1']:>7.0f} "
              f"{r['qpsn']:>7.0f} {r['hit']:>6.2f}")
    big = max(rows, key=lambda r: r["docs"])
    print(f"\nsearch p50 at {_docs(int(big['docs']))} docs: {big['p50_ms']:.2f} ms "
          f"(goal <= {GOAL_MS:g} ms at 1M)")
    emit(f"search p50 at {_docs(int(big['docs']))} docs, top-{a.top_k} + snippets",
         big["p50_ms"], GOAL_MS, better="lower", unit="ms",
         note=f"p99 {big['p99_ms']:.2f} ms, hit@{a.top_k} {big['hit']:.2f}")


if __name__ == "__main__":
    main()

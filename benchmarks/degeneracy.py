"""Throughput of the degeneracy detector (megatron_rl.utils.degeneracy) on 10 MB and 100 MB
of sound text (no finding, so every check scans all of it: the worst case), measured side by
side in one run; the per-MB cost ratio between sizes shows it is O(n). Also timed: each check
alone, the compression check without its screen (every window compressed, as for texts under
`screen_min_bytes`), and plain `zlib.compress(level 1)` of the same bytes, the ceiling of any
check that deflates every byte. Goal: >= 50 MB/s for the whole detector.

    python benchmarks/degeneracy.py                 # 10 MB and 100 MB: ~15 s, ~300 MB RSS
    python benchmarks/degeneracy.py --sizes 1,10
"""

from __future__ import annotations

import argparse
import random
import time
import zlib

from results import emit

from megatron_rl.utils.degeneracy import (
    DegeneracyConfig,
    char_run_finding,
    compression_finding,
    find_degeneracy,
    line_loop_finding,
)

UNSCREENED = DegeneracyConfig(screen_min_bytes=1 << 62)

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from "
         "at which but have an they you were her she there been one all we their search result "
         "capital population river founded century museum city bridge treaty railway station "
         "mountain border census election according page visit answer question evidence").split()


def text(n_bytes: int, seed: int = 0) -> bytes:
    """Sound model-like text: lines of 1-4 random sentences of 5-20 words and numbers, with
    the repetition real outputs have and loops do not: a tool call (the same JSON around new
    arguments) on one line in 8, a quote of one of the last 50 lines on one in 25."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        roll = rng.random()
        if roll < 1 / 8:
            query = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
            line = (f'{{"name": "search", "arguments": {{"query": "{query}", '
                    f'"page": {rng.randint(1, 9)}}}}}')
        elif roll < 1 / 8 + 1 / 25 and parts:
            line = "As noted above: " + rng.choice(parts[-50:])
        else:
            line = " ".join(
                " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 20))).capitalize()
                + f" ({rng.randint(1, 9999)})." for _ in range(rng.randint(1, 4)))
        parts.append(line)
        size += len(line) + 1
    return "\n".join(parts).encode()[:n_bytes]


def mb_per_s(fn, raw: bytes, repeat: int = 2) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        found = fn(raw)
        best = min(best, time.perf_counter() - t)
        assert found is None or isinstance(found, bytes), found  # sound text: no finding
    return len(raw) / best / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="10,100", help="MB, comma-separated")
    p.add_argument("--repeat", type=int, default=2, help="best of this many runs")
    args = p.parse_args()
    base = text(10 * 10**6)
    checks = {"detector": find_degeneracy, "compression": compression_finding,
              "line_loop": line_loop_finding, "char_run": char_run_finding,
              "unscreened": lambda raw: compression_finding(raw, UNSCREENED),
              "zlib_level1": lambda raw: zlib.compress(raw, 1) and None}
    rows = []
    for mb in (int(s) for s in args.sizes.split(",")):
        raw = (base * (mb // 10 + 1))[:mb * 10**6] if mb > 10 else base[:mb * 10**6]
        rows.append((mb, {k: mb_per_s(fn, raw, args.repeat) for k, fn in checks.items()}))
    names = list(checks)
    print(f"{'MB':>5} " + " ".join(f"{n:>12}" for n in names) + "   (MB/s)")
    for mb, r in rows:
        print(f"{mb:>5} " + " ".join(f"{r[n]:>12.1f}" for n in names))
    if len(rows) > 1:
        (mb0, r0), (mb1, r1) = rows[0], rows[-1]
        ratio = r0["detector"] / r1["detector"]
        print(f"detector time per MB at {mb1} MB / at {mb0} MB: {ratio:.2f} (1.0 = linear); "
              f"detector / zlib level 1 at {mb1} MB: "
              f"{r1['detector'] / r1['zlib_level1']:.2f}")
    goal = min(r["detector"] for _, r in rows)
    print(f"slowest detector rate {goal:.1f} MB/s: goal >= 50 MB/s "
          f"{'met' if goal >= 50 else 'NOT met'}")
    emit("degeneracy detector, MB/s (slowest size)", goal, 50.0, unit="MB/s")


if __name__ == "__main__":
    main()

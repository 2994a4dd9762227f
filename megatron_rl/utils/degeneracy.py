"""Degenerate (looping) model text, found in O(n): one detector for the agents' online
`degenerate` label and for the offline trajectory filters (`megatron_rl.data.filters`).

Three checks, each linear in the text's UTF-8 bytes:

- compression: the text is fed through one streaming zlib compressor in fixed windows of
  `window` bytes, with a sync flush after each, so a window's compressed size is measured given
  the 32 KB of text before it (deflate's own sliding window). A window that repeats what came
  before, at any period up to 32 KB and whatever its alignment to the window, compresses to a
  few bytes; natural text and JSON stay at 0.3-0.6. A window below `max_ratio` is a loop. The
  history makes the windows overlap in effect (a loop is compared against the text before the
  window, not only inside it), and each byte is compressed once.
- line loops: a block of 1..`max_line_period` lines repeated `line_repeats` times in a row
  (lines compared stripped; lines shorter than `min_line_chars` never match, so blank lines,
  braces and rulers do not count). Catches short loops the windows are too coarse for.
- character runs: `max_char_run` bytes or more with one period of 1-4 bytes (one character in
  any UTF-8 width, or e.g. "ha"), screened on every (max_char_run // 4)-th byte. Runs of
  closing brackets are exempt: deeply nested JSON or code legitimately ends in hundreds of
  them (a long one still fails the compression check).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

_CLOSERS = frozenset(b")]}")


@dataclass(frozen=True)
class DegeneracyConfig:
    window: int = 2048          # bytes per compressed window
    max_ratio: float = 0.1      # a window compressing below this is a loop
    min_chars: int = 400        # windows (and texts) shorter than this are not ratio-judged
    level: int = 1              # zlib level: 1 finds exact repeats and is the fastest
    max_char_run: int = 256     # bytes of one repeated 1-4 byte unit
    line_repeats: int = 4       # copies in a row of a repeating block of lines
    max_line_period: int = 16   # longest repeating block of lines, in lines
    min_line_chars: int = 4     # shorter (stripped) lines never count as repeats

    def __post_init__(self) -> None:
        if self.window < 64 or self.min_chars < 1 or not 0 < self.max_ratio < 1:
            raise ValueError(f"{self}: window >= 64, min_chars >= 1, 0 < max_ratio < 1")
        if not 0 <= self.level <= 9:
            raise ValueError(f"level={self.level}: zlib levels are 0-9")
        if self.max_char_run < 16 or self.line_repeats < 2 or self.max_line_period < 1:
            raise ValueError(f"{self}: max_char_run >= 16, line_repeats >= 2, "
                             "max_line_period >= 1")


DEFAULT = DegeneracyConfig()


@dataclass(frozen=True)
class Finding:
    kind: str     # "compression" | "line_loop" | "char_run"
    offset: int   # byte offset (line index for line_loop) where it was found
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} at {self.offset}: {self.detail}"


def _as_bytes(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode("utf-8", "replace")


def compression_finding(raw: bytes, cfg: DegeneracyConfig = DEFAULT) -> Finding | None:
    if len(raw) < cfg.min_chars:
        return None
    comp = zlib.compressobj(cfg.level)
    view, w = memoryview(raw), cfg.window
    for start in range(0, len(raw), w):
        chunk = view[start:start + w]
        size = len(comp.compress(chunk)) + len(comp.flush(zlib.Z_SYNC_FLUSH))
        if len(chunk) >= cfg.min_chars and size < cfg.max_ratio * len(chunk):
            return Finding("compression", start, f"{len(chunk)} bytes compress to {size} "
                           f"(ratio {size / len(chunk):.3f} < {cfg.max_ratio:g})")
    return None


def _true_runs(flags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and (exclusive) ends of the runs of True in a 1-D bool array."""
    edges = np.diff(np.concatenate(([False], flags, [False])).view(np.int8))
    return np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)


def _periodic_end(b: np.ndarray, k: int, i: int, step: int = 4096) -> int:
    """The first j >= i with b[j] != b[j + k] (len(b) - k if none), in numpy blocks."""
    last = len(b) - k
    while i < last:
        stop = min(i + step, last)
        miss = np.flatnonzero(b[i:stop] != b[i + k:stop + k])
        if miss.size:
            return i + int(miss[0])
        i, step = stop, step * 2
    return last


def _periodic_start(b: np.ndarray, k: int, i: int, step: int = 4096) -> int:
    """The smallest s <= i with b[j] == b[j + k] for all j in [s, i)."""
    while i > 0:
        lo = max(0, i - step)
        miss = np.flatnonzero(b[lo:i] != b[lo + k:i + k])
        if miss.size:
            return lo + int(miss[-1]) + 1
        i, step = lo, step * 2
    return 0


def char_run_finding(raw: bytes, cfg: DegeneracyConfig = DEFAULT) -> Finding | None:
    """A stretch of >= max_char_run bytes with a period k <= 4. Screened on a sample: with
    m = max_char_run // 4, such a stretch holds 3 consecutive multiples of m at which
    b[i] == b[i + k]; only those candidates (rare in real text) are measured exactly."""
    n, r = len(raw), cfg.max_char_run
    if n < r:
        return None
    b = np.frombuffer(raw, dtype=np.uint8)
    m = r // 4
    for k in range(1, 5):
        sample = b[:n - k:m] == b[k::m]
        candidates = np.flatnonzero(sample[:-2] & sample[1:-1] & sample[2:])
        covered = -1
        for j in candidates:
            i = int(j) * m
            if i < covered:  # inside a stretch already measured
                continue
            s, e = _periodic_start(b, k, i), _periodic_end(b, k, i)
            covered, length = e, e - s + k  # eq holds on [s, e): bytes [s, e + k) repeat
            unit = raw[s:s + k]
            if length >= r and not set(unit) <= _CLOSERS:
                return Finding("char_run", s, f"{length} bytes repeating {unit!r}")
    return None


def line_loop_finding(raw: bytes, cfg: DegeneracyConfig = DEFAULT) -> Finding | None:
    lines = raw.split(b"\n")
    if len(lines) < cfg.line_repeats:
        return None
    stripped = [line.strip() for line in lines]
    ids = np.fromiter(map(hash, stripped), dtype=np.int64, count=len(stripped))
    valid = np.fromiter(map(len, stripped), dtype=np.int64, count=len(stripped)) \
        >= cfg.min_line_chars
    for p in range(1, min(cfg.max_line_period, len(lines) // cfg.line_repeats) + 1):
        # same[i]: line i + p repeats line i; a block of p lines repeated c times in a row is
        # (c - 1) * p consecutive repeats
        same = (ids[p:] == ids[:-p]) & valid[p:] & valid[:-p]
        need = (cfg.line_repeats - 1) * p
        starts, ends = _true_runs(same)
        hit = np.flatnonzero(ends - starts >= need)
        for j in hit:
            s = int(starts[j])
            block = stripped[s:s + p]
            if stripped[s + p:s + 2 * p] == block:  # a hash collision is not a loop
                copies = (int(ends[j]) - s) // p + 1
                return Finding("line_loop", s, f"{p} line(s) repeated {copies} times: "
                               f"{block[0][:60]!r}")
    return None


def find_degeneracy(text: str | bytes, cfg: DegeneracyConfig = DEFAULT) -> Finding | None:
    """The first degeneracy found (cheapest checks first), or None for sound text."""
    raw = _as_bytes(text)
    return (char_run_finding(raw, cfg) or line_loop_finding(raw, cfg)
            or compression_finding(raw, cfg))


def is_degenerate(text: str | bytes, cfg: DegeneracyConfig = DEFAULT) -> bool:
    return find_degeneracy(text, cfg) is not None

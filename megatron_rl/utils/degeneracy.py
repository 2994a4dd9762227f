"""Degenerate (looping) model text, found in O(n): one detector for the agents' online
`degenerate` label and for the offline trajectory filters (`megatron_rl.data.filters`).

Three checks, each linear in the text's UTF-8 bytes:

- compression: the text is fed through one streaming zlib compressor in fixed windows of
  `window` bytes, with a sync flush after each, so a window's compressed size is measured given
  the 32 KB of text before it (deflate's own sliding window). A window that repeats what came
  before, at any period up to 32 KB and whatever its alignment to the window, compresses to a
  few bytes; natural text and JSON stay at 0.3-0.6. A window below `max_ratio` is a loop. The
  history makes the windows overlap in effect (a loop is compared against the text before the
  window, not only inside it). Texts of
  `screen_min_bytes` (64 KB) or more are screened first, at a fraction of deflate's cost: a
  window is judged only if its sampled 16-byte contexts repeat the 32 KB before it all over
  it (`_may_compress`, which drops nearly every window of fluent text) and it compresses well
  at level 9 (`_may_loop`); it is then judged by a level-1 stream that has first compressed
  the 128 KB before it, which in practice reproduces the whole-text stream's sizes. The screen is
  calibrated for level 1 and ratios <= 0.1; other settings compress every window.
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
_HISTORY = 32768           # deflate's window: how far back a repeat can be matched
_MUL = np.uint64(0x9E3779B97F4A7C15)  # odd: hashing 8 bytes by it keeps them distinct
_ANCHOR_SHIFT = 5          # one position in 32 is an anchor
_LAGS = 3                  # earlier equal hashes looked at per anchor
_MAX_NOVEL = 0.8           # a window with more of its anchors unseen is not compressed
_MIN_COVERED = 5           # nor one with seen anchors in fewer of its eighths
_PRIME = 4 * _HISTORY      # text a new stream compresses before its first judged window
_THROUGH = 8               # windows a stream compresses through, about one _may_loop's cost
_SEGMENT = 1 << 20         # bytes screened at a time (memory; an early loop stops early)


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
    screen_min_bytes: int = 1 << 16  # longer texts compress only windows that may repeat

    def __post_init__(self) -> None:
        if self.window < 64 or self.min_chars < 1 or not 0 < self.max_ratio < 1:
            raise ValueError(f"{self}: window >= 64, min_chars >= 1, 0 < max_ratio < 1")
        if not 0 <= self.level <= 9:
            raise ValueError(f"level={self.level}: zlib levels are 0-9")
        if self.screen_min_bytes < 0:
            raise ValueError(f"screen_min_bytes={self.screen_min_bytes}: must be >= 0")
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


class _Windows:
    """One zlib stream over the text in windows of `cfg.window` bytes, each sync-flushed, so
    a window's compressed size is measured given the text before it, as far back as deflate's
    32 KB window reaches."""

    def __init__(self, raw: bytes, cfg: DegeneracyConfig, start: int) -> None:
        self.raw, self.cfg, self.at = raw, cfg, start
        self.view = memoryview(raw)
        self.comp = zlib.compressobj(cfg.level)

    def run_to(self, stop: int, judge: bool = True) -> Finding | None:
        """Compress the windows up to `stop`; the first below `max_ratio` if judged."""
        cfg, w = self.cfg, self.cfg.window
        stop = min(stop, len(self.raw))
        while self.at < stop:
            start = self.at
            chunk = self.view[start:start + w]
            self.at += len(chunk)
            size = len(self.comp.compress(chunk)) + len(self.comp.flush(zlib.Z_SYNC_FLUSH))
            if judge and len(chunk) >= cfg.min_chars and size < cfg.max_ratio * len(chunk):
                return Finding("compression", start, f"{len(chunk)} bytes compress to {size} "
                               f"(ratio {size / len(chunk):.3f} < {cfg.max_ratio:g})")
        return None


def _may_compress(raw: bytes, start: int, stop: int, w: int) -> np.ndarray:
    """Per window of [start, stop): False where the window is mostly text not seen in the
    32 KB before it, which deflate does not bring near a ratio of 0.1.

    Sampled on anchors: positions whose 8 bytes hash into the lowest 1/2**_ANCHOR_SHIFT, so a
    repeat at any distance and alignment repeats its anchors. An anchor is seen when an earlier
    one (up to _LAGS back among equal hashes) has the same 8 bytes, within 32 KB, and the same
    8 bytes before or after it: one changed byte unsees only the anchors within 8 bytes of it
    (a counter in a loop stays cheap for deflate too), while fluent text, which repeats short
    phrases, rarely repeats 16 bytes. A window is kept when at most _MAX_NOVEL of its anchors
    are unseen and seen ones lie in _MIN_COVERED of its eighths (a loop fills the window, a
    quote of an earlier line does not), or when it has under half the expected anchors (a
    short-period loop may hold none: low-variety text is for zlib to judge). Calibrated on
    ~13,000 windows below 0.1 in generated loops (exact, mutated, with counters, mosaics of
    earlier text): two were dropped, in texts caught at the same window anyway. Of sound text
    it keeps ~1% of prose windows and about half of source code's."""
    n, lo = len(raw), max(0, start - _HISTORY)
    limit = np.uint64(1 << (64 - _ANCHOR_SHIFT))
    parts: list[tuple[np.ndarray, ...]] = []
    buf = np.empty((min(n, stop + 16) - lo) // 8, np.uint64)  # reused: no page faults
    flags = np.empty(len(buf), bool)
    for o in range(8):  # one view of whole words per byte offset; a multiply by an odd
        base = lo + o   # constant is a bijection, so the hashes stand in for the bytes
        count = (min(n, stop + 16) - base) // 8
        top = min(count - 1, (stop - base + 7) // 8)  # words with one either side, p < stop
        if top <= 1:
            continue
        h = np.multiply(np.frombuffer(raw, "<u8", count=count, offset=base), _MUL,
                        out=buf[:count])
        j = np.flatnonzero(np.less(h[1:top], limit, out=flags[:top - 1])) + 1
        parts.append((j * 8 + base, h[j], h[j - 1], h[j + 1]))
    nwin = -(-(stop - start) // w)
    keep = np.ones(nwin, bool)
    if not parts:
        return keep
    pos, key, before, after = (np.concatenate(c) for c in zip(*parts, strict=True))
    by_pos = np.argsort(pos, kind="stable")  # merges the 8 sorted runs
    # equal hashes together, each group in text order (a stable radix sort on 16 bits)
    by_key = np.argsort((key[by_pos] >> np.uint64(32)).astype(np.uint16), kind="stable")
    order = by_pos[by_key]
    p, k, b, a = pos[order], key[order], before[order], after[order]
    seen = np.zeros(len(p), bool)
    for g in range(1, _LAGS + 1):
        seen[g:] |= ((k[g:] == k[:-g]) & (p[g:] - p[:-g] <= _HISTORY)
                     & ((b[g:] == b[:-g]) | (a[g:] == a[:-g])))
    novel_by_pos = np.ones(len(p), np.int64)
    novel_by_pos[by_key[seen]] = 0
    # per window, from the anchors in text order
    edges = np.searchsorted(pos[by_pos], start + w * np.arange(nwin + 1))
    total = np.diff(edges)
    novel = np.diff(np.concatenate(([0], np.cumsum(novel_by_pos)))[edges])
    # eighths of each window holding a seen anchor: a loop's are all over it, a quote's in
    # one place
    mine = seen & (p >= start)
    eighths = np.zeros(nwin * 8, bool)
    eighths[(p[mine] - start) * 8 // w] = True
    covered = eighths.reshape(nwin, 8).sum(axis=1)
    expected = np.full(nwin, w)
    expected[-1] = stop - start - (nwin - 1) * w  # a short last window
    keep[:] = ((total < (expected >> _ANCHOR_SHIFT) // 2)
               | ((novel <= _MAX_NOVEL * total) & (covered * w >= _MIN_COVERED * expected)))
    return keep


def _screens(raw: bytes, cfg: DegeneracyConfig) -> bool:
    """The screen is calibrated for deflate level <= 1, ratios <= 0.1 and >= 1 KB windows;
    other settings, and short texts, compress every window."""
    return (len(raw) >= cfg.screen_min_bytes and cfg.level <= 1 and cfg.max_ratio <= 0.1
            and cfg.window >= 1024)


def _may_loop(raw: bytes, start: int, cfg: DegeneracyConfig) -> bool:
    """Whether the window at `start` compresses below 1.5 x `max_ratio` at level 9 given the
    32 KB before it: a check before priming a stream, at a fraction of its cost. Level 9
    finds what the level-1 stream does and more (of ~12,800 windows that stream put below 0.1,
    none measured 0.1 or more here). A dictionary cannot stand in for the level-1 stream
    itself, though: level 1 keeps its hash chains sparse inside matches, so they reach
    further back than those of a dictionary, which holds every position."""
    chunk = raw[start:start + cfg.window]
    comp = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS, 9,
                            **({"zdict": raw[max(0, start - _HISTORY):start]} if start else {}))
    size = len(comp.compress(chunk)) + len(comp.flush(zlib.Z_SYNC_FLUSH))
    return size < 1.5 * cfg.max_ratio * len(chunk)


def _planned_bytes(starts: np.ndarray, at: int | None, w: int) -> int:
    """About the bytes of level-1 work to judge the windows at `starts` (a stream now at
    `at`): each window, plus the gap a stream compresses through or a `_may_loop` check."""
    if not starts.size:
        return 0
    prev = np.concatenate(([-_THROUGH * w if at is None else at], starts[:-1] + w))
    return int(np.minimum(starts - prev, _THROUGH * w).sum()) + w * starts.size


def compression_finding(raw: bytes, cfg: DegeneracyConfig = DEFAULT) -> Finding | None:
    """The first window that compresses below `max_ratio` given the 32 KB before it. Long
    texts are screened: only windows that may repeat earlier text (`_may_compress`) and
    compress well at level 9 (`_may_loop`) are judged, each by a stream that has compressed
    (unjudged) the 128 KB before it, as the stream over the whole text would have. Where that
    would cost about as much as compressing everything (code, logs), everything is. Fluent
    text then costs a hash per byte instead of a deflate."""
    if len(raw) < cfg.min_chars:
        return None
    if not _screens(raw, cfg):
        return _Windows(raw, cfg, 0).run_to(len(raw))
    n, w = len(raw), cfg.window
    reach = -(-_PRIME // w) * w  # in whole windows
    stream: _Windows | None = None

    def primed(start: int) -> _Windows:
        """A live stream at `start`: the current one if close enough, or a new one."""
        if stream is not None and start - stream.at <= reach:
            return stream
        new = _Windows(raw, cfg, max(0, start - reach))
        new.run_to(start, judge=start <= reach)  # judged only if the history is all there
        return new

    seg = max(1, _SEGMENT // w) * w
    for s in range(0, n, seg):
        stop = min(n, s + seg)
        starts = s + w * np.flatnonzero(_may_compress(raw, s, stop, w))
        if starts.size and n - starts[-1] < cfg.min_chars:  # a last window too short to judge
            starts = starts[:-1]
        if 2 * _planned_bytes(starts, None if stream is None else stream.at, w) >= stop - s:
            stream = primed(s)  # as cheap to compress it all
            found = stream.run_to(stop)
            if found is not None:
                return found
            continue
        for start in starts.tolist():
            # a gap of a few windows is cheaper to compress through than to check
            if stream is None or start - stream.at > _THROUGH * w:
                if not _may_loop(raw, start, cfg):
                    continue
                stream = primed(start)
            found = stream.run_to(start + w)
            if found is not None:
                return found
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
    # hashes of the stripped lines; lines are stripped again only where a run is found
    ids = np.fromiter(map(hash, map(bytes.strip, lines)), dtype=np.int64, count=len(lines))
    valid: np.ndarray | None = None  # measured only once some period has a long run
    for p in range(1, min(cfg.max_line_period, len(lines) // cfg.line_repeats) + 1):
        # same[i]: line i + p repeats line i; a block of p lines repeated c times in a row is
        # (c - 1) * p consecutive repeats
        same = ids[p:] == ids[:-p]
        need = (cfg.line_repeats - 1) * p
        if np.count_nonzero(same) < need:  # fluent text: no period gets this far
            continue
        starts, ends = _true_runs(same)
        if not np.any(ends - starts >= need):  # scattered repeats (quotes, blank lines)
            continue
        if valid is None:
            valid = np.fromiter(map(len, map(bytes.strip, lines)), dtype=np.int64,
                                count=len(lines)) >= cfg.min_line_chars
        starts, ends = _true_runs(same & valid[p:] & valid[:-p])
        for j in np.flatnonzero(ends - starts >= need):
            s = int(starts[j])
            block = [line.strip() for line in lines[s:s + p]]
            if [line.strip() for line in lines[s + p:s + 2 * p]] == block:  # not a collision
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

"""Secrets come only from the environment; every log line, error detail and tool result that
might echo one is passed through `redact` first, and foreign text (an error body, a reply) is
shortened only by `excerpt`, which redacts the whole text before it cuts."""

from __future__ import annotations

_SECRETS: set[str] = set()


def register_secret(value: str | None) -> None:
    """Every detail and log line of this package is scrubbed of registered values."""
    if value and len(value) >= 4:  # a 1-3 char "secret" would redact ordinary words
        _SECRETS.add(value)


def redact(text: str) -> str:
    """Every occurrence of a registered secret replaced by `***`. Overlapping occurrences (one
    key inside or across another) are merged first, so no piece of either survives."""
    spans: list[tuple[int, int]] = []
    for s in _SECRETS:
        i = text.find(s)
        while i >= 0:
            spans.append((i, i + len(s)))
            i = text.find(s, i + 1)
    if not spans:
        return text
    spans.sort()
    out, pos = [], 0
    for start, end in spans:
        if end <= pos:
            continue
        if start > pos:
            out += [text[pos:start], "***"]
        elif not out:
            out.append("***")
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _drop_partial_tail(text: str) -> str:
    """`text` without a tail that is the start of a secret (the head of a longer body may end
    inside one, where `redact` cannot see it)."""
    cut = 0
    for s in _SECRETS:
        for k in range(min(len(s) - 1, len(text)), cut, -1):
            if text.endswith(s[:k]):
                cut = k
                break
    return text[:len(text) - cut] if cut else text


def excerpt(text: str, limit: int, *, truncated: bool = False, tail: bool = False) -> str:
    """At most `limit` characters of foreign text, safe to show: redacted whole, then cut (a cut
    first could keep half a key). `tail`: keep the end instead of the start. `truncated`:
    `text` is only the head of a longer body, so its end may hold the start of a secret, which
    is dropped. A cut is marked with "…"."""
    text = redact(text)
    if truncated:
        text = _drop_partial_tail(text)
    if len(text) > limit:
        return "…" + text[-limit:] if tail else text[:limit] + "…"
    return text + "…" if truncated else text

"""Secrets come only from the environment; every log line, error detail and tool result that
might echo one is passed through `redact` first."""

from __future__ import annotations

_SECRETS: set[str] = set()


def register_secret(value: str | None) -> None:
    """Every detail and log line of this package is scrubbed of registered values."""
    if value and len(value) >= 4:  # a 1-3 char "secret" would redact ordinary words
        _SECRETS.add(value)


def redact(text: str) -> str:
    for s in _SECRETS:
        if s in text:
            text = text.replace(s, "***")
    return text

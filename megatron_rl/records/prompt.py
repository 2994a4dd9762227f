"""A task's unit of work: one question with its reference answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Prompt:
    question: str
    answer: str
    uid: str                       # stable id of the prompt (the group id of its samples)
    metadata: dict[str, Any] = field(default_factory=dict)  # copied onto its trajectories
    # the data's own chat (verl `prompt` column); None: the agent writes its own from question
    messages: list[dict[str, str]] | None = None

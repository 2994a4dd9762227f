"""A task's unit of work: one question with its reference answer."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_EPOCH = re.compile(r"\.e\d+$")


def epoch_uid(key: str, epoch: int) -> str:
    """A cycled source's uid for `key` in `epoch` (GRPO group ids must not repeat)."""
    return f"{key}.e{epoch}"


def question_key(uid: str) -> str:
    """The uid without its epoch (`q3.e1` → `q3`): one question across epochs."""
    return _EPOCH.sub("", uid)


@dataclass
class Prompt:
    question: str
    answer: str
    uid: str                       # stable id of the prompt (the group id of its samples)
    metadata: dict[str, Any] = field(default_factory=dict)  # copied onto its trajectories
    # the data's own chat (verl `prompt` column); None: the agent writes its own from question
    messages: list[dict[str, str]] | None = None

    @property
    def question_key(self) -> str:
        return question_key(self.uid)

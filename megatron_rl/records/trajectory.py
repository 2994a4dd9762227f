"""The Trajectory: the one record a rollout produces and the loss consumes.

A trajectory is a list of turns, one per engine call. Each turn keeps the exact token ids the
engine was fed (`context_ids`) and produced (`output_ids`, with the engine's log-probs and the
weight version of every token), so the trainer trains on exactly the tokens that were sampled:
nothing is re-tokenized. `sequences()` turns the turns into training sequences: a turn whose
context is the previous sequence followed by that turn's output and observation (ReAct's growing
conversation) extends it; any other context (IterSynth's Planner and Synthesizer each start from
a fresh prompt) starts a new sequence.

With MoE routing replay (R3) each turn also keeps the engine's routed experts: for every token
it fed the engine (context + output, less the last sampled token), the top-k expert ids of each
MoE layer. A sequence takes each token's routing from the latest turn that fed it.

Labels classify what went wrong (the abnormal-trajectory taxonomy): environment failures are the
environment's fault (the RL loss leaves them out), model failures are the policy's (they keep
their reward). A context that overflows (`overlong`: mostly long observations) is charged to the
environment; a single response longer than any may be (`response_too_long`) to the policy.

In `Trajectory.to_dict()` a turn's context is written as what it shares with the previous
turn's feed (its context, output and observation) plus the rest: `context_shared` N means the
first N tokens of that feed come first, `context_ids` holds the tokens after them. A ReAct
conversation re-feeds its whole history every turn, so full contexts made a dump grow with
the square of the turns (3 turns of the tiny run: 2.5x the ids; 30 turns of 16k tokens:
~15x). `from_dict` and `full_contexts` (for readers of the raw rows) expand them; a row
without the field holds full contexts, as every dump before it did.

`to_dict()` is plain JSON that `json.dumps(..., allow_nan=False)` always writes: the agents'
parser already bounds and checks model-written tool arguments (`agents.tool_parser`), and
`to_dict` passes them through `json_safe` again, so a `ToolCall` built anywhere else cannot
end a run in a dump or a forest commit either. Rewards and metadata go through `json_safe`
too, and a NaN or infinite log-prob or reward is written as its repr ("nan", "inf", "-inf"),
which `from_dict` reads back as the float (metadata keeps the string).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_rl.utils.tokens import shared_prefix_length

# environment's fault: excluded from the loss and from group statistics
ENV_FAILURES = ("search_error", "visit_error", "summarizer_error", "judge_error", "overlong")
# the policy's fault: kept, with their reward
# (`repeated_state`: a greedy IterSynth episode met a state it had been in, so it would repeat
# its steps until the turn budget; agents/itersynth.py)
MODEL_FAILURES = ("degenerate", "tool_parse_error", "max_turns", "excess_tool_calls",
                  "response_too_long", "repeated_state")
LABELS = ENV_FAILURES + MODEL_FAILURES
MAX_JSON_DEPTH = 32  # json_safe: deeper data is cut (the parser already allows only 16 levels)
CONTEXT_SHARED = "context_shared"  # a dumped turn's context: this many of the last feed's ids


def _text(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: no UTF-8 file or tokenizer takes them
        return s.encode("utf-8", "backslashreplace").decode("utf-8")
    return s


def json_safe(value: Any, depth: int = MAX_JSON_DEPTH) -> Any:
    """A copy of plain data that `json.dumps(..., allow_nan=False)` always writes, in at most
    `depth` levels of recursion: containers deeper than that become a marker string,
    NaN/±Infinity their repr, ints past the digit limit and values of other types a marker,
    lone surrogates backslash escapes.
    JSON-safe input comes back equal (tuples as lists)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value.bit_length() > 2_000:  # near sys.get_int_max_str_digits' 640-digit minimum
            try:
                str(value)
            except ValueError:  # json.dumps could not write it either
                return f"<int of {value.bit_length()} bits>"
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, dict | list | tuple):
        if depth <= 0:
            return f"<{type(value).__name__} nested deeper than {MAX_JSON_DEPTH} levels>"
        if isinstance(value, dict):
            return {_text(k) if isinstance(k, str) else _text(repr(k)): json_safe(v, depth - 1)
                    for k, v in value.items()}
        return [json_safe(v, depth - 1) for v in value]
    return f"<{type(value).__name__}>"


_NON_FINITE = ("nan", "inf", "-inf")  # json_safe's spelling of non-finite floats


def _floats_out(values: list[Any]) -> list[Any]:
    """A float list as strict JSON (the common all-finite case without a per-item copy)."""
    try:
        if all(map(math.isfinite, values)):
            return list(values)
    except TypeError:  # a None or a non-number: json_safe marks it
        pass
    return json_safe(list(values))


def _float_in(value: Any) -> Any:
    """`_floats_out`'s inverse for one value: "nan" / "inf" / "-inf" back to the float."""
    return float(value) if isinstance(value, str) and value in _NON_FINITE else value


def _floats_in(values: list[Any]) -> list[Any]:
    """`_float_in` over a list (the common list without a string copied whole)."""
    return [_float_in(x) for x in values] if str in map(type, values) else list(values)


def _rewards_in(rewards: Any) -> Any:
    return ({k: _float_in(v) for k, v in rewards.items()} if isinstance(rewards, dict)
            else rewards)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    error: str | None = None     # a label when the call could not be parsed or failed
    observation: str = ""        # what the agent was shown

    def to_dict(self) -> dict[str, Any]:
        return {"name": _text(self.name), "arguments": json_safe(self.arguments),
                "error": self.error, "observation": _text(self.observation)}


@dataclass
class Turn:
    role: str                            # "agent" (ReAct) | "planner" | "synthesizer"
    context_ids: list[int]               # fed to the engine (not trained)
    output_ids: list[int]                # generated (trained)
    output_logprobs: list[float]         # the engine's log-probs of output_ids
    weight_versions: list[int]           # the weight version of each output token
    observation_ids: list[int] = field(default_factory=list)  # appended after (not trained)
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"          # stop | length | abort
    text: str = ""                       # decoded output, for judges, rubrics and logs
    rewards: dict[str, float] = field(default_factory=dict)  # per-turn (e.g. rubric score)
    labels: list[str] = field(default_factory=list)
    # which output tokens are trained (None: all); e.g. an SFT judge masking a whole turn
    loss_mask: list[int] | None = None
    # MoE routing replay: per fed token (context + output[:-1]), [layers][top_k] expert ids as
    # the engine returned them; None when not asked for, empty when nothing was fed
    routed_experts: list[Any] | None = None

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if len(self.output_logprobs) != n or len(self.weight_versions) != n:
            raise ValueError(f"turn ({self.role}): {n} output ids but "
                             f"{len(self.output_logprobs)} log-probs and "
                             f"{len(self.weight_versions)} weight versions")
        if self.loss_mask is not None and len(self.loss_mask) != n:
            raise ValueError(f"turn ({self.role}): {n} output ids but a loss mask of "
                             f"{len(self.loss_mask)}")
        if self.routed_experts is not None:
            fed = len(self.context_ids) + n - 1
            if len(self.routed_experts) not in (0, fed):
                raise ValueError(f"turn ({self.role}): routed experts for "
                                 f"{len(self.routed_experts)} tokens; it fed {fed}")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what the forest and trajectory dumps hold); tool calls via
        `ToolCall.to_dict`. What `asdict` gives, with the flat per-token lists copied whole
        (`asdict` copies them element by element: most of a step's trajectory dump)."""
        return {"role": self.role, "context_ids": list(self.context_ids),
                "output_ids": list(self.output_ids),
                "output_logprobs": _floats_out(self.output_logprobs),
                "weight_versions": list(self.weight_versions),
                "observation_ids": list(self.observation_ids),
                "tool_calls": [c.to_dict() for c in self.tool_calls],
                "finish_reason": self.finish_reason, "text": self.text,
                "rewards": json_safe(self.rewards), "labels": list(self.labels),
                "loss_mask": None if self.loss_mask is None else list(self.loss_mask),
                "routed_experts": copy.deepcopy(self.routed_experts)}


@dataclass
class TrainingSequence:
    """One sequence for the trainer; per-token arrays are aligned with `tokens`."""

    tokens: list[int]
    loss_mask: list[int]          # 1 on trained generated tokens
    logprobs: list[float]         # the engine's log-probs (0 where masked)
    weight_versions: list[int]    # -1 where masked
    turn_index: list[int]         # which turn generated the token (-1 for context/observations)
    # MoE routing replay: per token, [layers][top_k] expert ids from the latest turn that fed it
    # to the engine (None for a token no turn fed); None unless every turn has its routing
    routed_experts: list[Any] | None = None


@dataclass
class Trajectory:
    uid: str
    group_id: str                 # trajectories of one prompt share it (GRPO groups)
    question: str
    reference: str | None = None
    turns: list[Turn] = field(default_factory=list)
    answer: str | None = None
    labels: list[str] = field(default_factory=list)
    rewards: dict[str, float] = field(default_factory=dict)  # e.g. outcome
    metadata: dict[str, Any] = field(default_factory=dict)

    def add_label(self, label: str, turn: Turn | None = None) -> None:
        if label not in LABELS:
            raise ValueError(f"unknown trajectory label {label!r}; known: {', '.join(LABELS)}")
        if label not in self.labels:
            self.labels.append(label)
        if turn is not None and label not in turn.labels:
            turn.labels.append(label)

    @property
    def env_failure(self) -> bool:
        return any(label in ENV_FAILURES for label in self.labels)

    @property
    def model_failure(self) -> bool:
        return any(label in MODEL_FAILURES for label in self.labels)

    @property
    def status(self) -> str:
        """The first environment failure, else the first model failure, else 'ok'."""
        for group in (ENV_FAILURES, MODEL_FAILURES):
            for label in self.labels:
                if label in group:
                    return label
        return "ok"

    @property
    def roles(self) -> list[str]:
        return [t.role for t in self.turns]

    def sequences(self) -> list[TrainingSequence]:
        out: list[TrainingSequence] = []
        routed = bool(self.turns) and all(t.routed_experts is not None for t in self.turns)
        for i, turn in enumerate(self.turns):
            current = out[-1] if out else None
            if current is None or turn.context_ids != current.tokens:
                c = len(turn.context_ids)
                current = TrainingSequence(list(turn.context_ids), [0] * c, [0.0] * c, [-1] * c,
                                           [-1] * c, [None] * c if routed else None)
                out.append(current)
            n, m = len(turn.output_ids), len(turn.observation_ids)
            current.tokens += turn.output_ids + turn.observation_ids
            trained = turn.loss_mask if turn.loss_mask is not None else [1] * n
            current.loss_mask += list(trained) + [0] * m
            current.logprobs += list(turn.output_logprobs) + [0.0] * m
            current.weight_versions += list(turn.weight_versions) + [-1] * m
            current.turn_index += [i] * n + [-1] * m
            if routed:  # this turn re-fed its whole context: its routing replaces the older
                current.routed_experts += [None] * (n + m)
                current.routed_experts[:len(turn.routed_experts)] = list(turn.routed_experts)
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain data; each turn's context after the first as what it shares with the
        previous turn's feed and the rest (`CONTEXT_SHARED`, the module's docstring)."""
        shallow = copy.copy(self)
        shallow.turns, shallow.rewards, shallow.metadata = [], {}, {}
        turns, fed = [], None
        for turn in self.turns:
            row = turn.to_dict()
            shared = 0 if fed is None else shared_prefix_length(fed, turn.context_ids)
            if shared:
                row["context_ids"] = row["context_ids"][shared:]
                row[CONTEXT_SHARED] = shared
            turns.append(row)
            fed = [*turn.context_ids, *turn.output_ids, *turn.observation_ids]
        return {**asdict(shallow), "rewards": json_safe(self.rewards),
                "metadata": json_safe(self.metadata), "turns": turns}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        """The inverse of `to_dict` (non-finite log-probs and rewards come back as floats)."""
        turns = []
        for t in full_contexts(d.get("turns", [])):
            fields = {**t, "tool_calls": [ToolCall(**c) for c in t.get("tool_calls", [])]}
            if isinstance(t.get("output_logprobs"), list):
                fields["output_logprobs"] = _floats_in(t["output_logprobs"])
            if "rewards" in t:
                fields["rewards"] = _rewards_in(t["rewards"])
            turns.append(Turn(**fields))
        out = {**d, "turns": turns}
        if "rewards" in d:
            out["rewards"] = _rewards_in(d["rewards"])
        return cls(**out)


def full_contexts(turns: Any) -> Any:
    """A dumped trajectory's turn dicts with every `context_ids` whole (`CONTEXT_SHARED`
    expanded; new dicts, the input is left as it is). Anything but a list of dicts comes back
    as it is, for the caller's own checks; a shared count that does not fit the previous
    turn's feed is a ValueError naming the turn."""
    if not isinstance(turns, list) or not any(
            isinstance(t, dict) and CONTEXT_SHARED in t for t in turns):
        return turns
    out, fed = [], []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            return turns
        t = dict(t)
        shared = t.pop(CONTEXT_SHARED, 0)
        if not (isinstance(shared, int) and not isinstance(shared, bool)
                and 0 <= shared <= len(fed)):
            raise ValueError(f"turns[{i}].{CONTEXT_SHARED}: expected an integer from 0 to "
                             f"{len(fed)} (the previous turn's context + output + "
                             f"observation ids), got {str(shared)[:40]}")
        tail = t.get("context_ids")
        if shared and isinstance(tail, list):
            t["context_ids"] = fed[:shared] + tail
        out.append(t)
        fed = [*_ids(t.get("context_ids")), *_ids(t.get("output_ids")),
               *_ids(t.get("observation_ids"))]
    return out


def _ids(value: Any) -> list:
    return value if isinstance(value, list) else []

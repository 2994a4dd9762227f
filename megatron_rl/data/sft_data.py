"""SFT data: files → token sequences with a per-token loss mask → the trainer's batches.

Two row kinds, told apart per file by its first row (`sft.format: auto`) or forced:

- **trajectories** (.jsonl): one `Trajectory.to_dict()` per line, as `megatron-rl train` dumps
  them (its extra `step` key is ignored). `Trajectory.sequences()` gives the exact token ids
  the engine was fed and produced; the loss is on the generated tokens of every turn, times
  the turn's `loss_mask` (None = all, 0 = a masked turn, whose tokens stay in the input).
  Context and observations (system, user, tool responses) are never trained.
- **messages** (.parquet or .jsonl): a `messages` column, a list of {role, content} (roles
  system, user, assistant, tool), and optionally `tools` (a list of function schemas, or its
  JSON text) for the template. The chat is rendered with the tokenizer's chat template; the
  loss is on each assistant message's tokens, from after the generation prompt through its
  end-of-turn token (the template's trailing newline is not trained, as in a rollout). An
  assistant message with `"loss_mask": 0` (or false) is rendered but not trained. Spans come
  from rendering prefixes, so they are token-exact; a template whose rendering of a prefix is
  not a prefix of the whole (e.g. one that rewrites earlier turns) is an error naming the row.

- **text** (.parquet or .jsonl): a `text` column (and optionally `title`, put first), e.g. a
  corpus as `data world` or `search build` read it: continued pre-training, every token trained,
  a text longer than a sequence split into consecutive windows (nothing is cut away).

Every sequence holds at most `seq_length + 1` tokens (inputs + the last target). Longer ones
are cut at that boundary (`overlong="truncate"`, the default: the early turns still teach) or
left out (`"drop"`); a sequence with nothing left to train is left out. All are counted in
`SFTData.stats`. Any unusable file, row or field is a `DataError` naming it.

Order: epoch e visits every sequence once, in a permutation seeded by (seed, e) (file order
without shuffling); a run's position is one integer, the cursor (sequences consumed), which
checkpoints keep, so a resumed run continues the same order.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_rl.data.parquet import DataError, check_messages, iter_rows
from megatron_rl.records.batch import TokenBatch
from megatron_rl.records.trajectory import Trajectory
from megatron_rl.utils.tokens import added_word_ids

FORMATS = ("auto", "trajectories", "messages", "text")
IGNORED_TRAJECTORY_KEYS = ("step",)  # written by `megatron-rl train`'s trajectories.jsonl


@dataclass
class SFTExample:
    tokens: list[int]
    loss_mask: list[float]  # the loss weight of each token (1 trained, 0 not; context weight)
    source: str           # "<file> line N" / "<file> row N": where it came from


@dataclass
class SFTData:
    examples: list[SFTExample]
    stats: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.examples)

    def order(self, epoch: int, seed: int, shuffle: bool) -> list[int]:
        idx = list(range(len(self.examples)))
        if shuffle:
            random.Random(f"sft:{seed}:{epoch}").shuffle(idx)  # str seeds hash stably
        return idx

    def take(self, cursor: int, n: int, *, seed: int, shuffle: bool) -> list[SFTExample]:
        """The `n` examples from position `cursor` of the endless epoch-after-epoch order."""
        out, size = [], len(self.examples)
        orders: dict[int, list[int]] = {}
        for pos in range(cursor, cursor + n):
            epoch = pos // size
            if epoch not in orders:
                orders[epoch] = self.order(epoch, seed, shuffle)
            out.append(self.examples[orders[epoch][pos % size]])
        return out


# -- reading -----------------------------------------------------------------------------------
def row_format(row: Any, where: str) -> str:
    if isinstance(row, dict):
        if "turns" in row:
            return "trajectories"
        if "messages" in row:
            return "messages"
        if isinstance(row.get("text"), str):
            return "text"
    keys = sorted(row)[:8] if isinstance(row, dict) else type(row).__name__
    raise DataError(f"{where}: neither a trajectory (`turns`), a chat (`messages`) nor a "
                    "`text` row "
                    f"(got {keys}); set sft.format to say which")


def _trajectory_parts(row: Any, where: str) -> list[tuple[list[int], list[int], list[bool]]]:
    """(tokens, loss mask, generated): `generated` marks the policy's own tokens, trained or
    masked; the rest (prompt, observations) is context."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a trajectory is a JSON object, got {type(row).__name__}")
    if not isinstance(row.get("turns"), list):
        raise DataError(f"{where}: missing field 'turns' (a list of turns)")
    data = {k: v for k, v in row.items() if k not in IGNORED_TRAJECTORY_KEYS}
    for i, turn in enumerate(data["turns"]):
        if not isinstance(turn, dict):
            raise DataError(f"{where}: turns[{i}] is not an object")
        for name in ("context_ids", "output_ids"):
            ids = turn.get(name)
            if not isinstance(ids, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise DataError(f"{where}: turns[{i}].{name}: a list of token ids")
        turn.setdefault("output_logprobs", [0.0] * len(turn["output_ids"]))
        turn.setdefault("weight_versions", [0] * len(turn["output_ids"]))
    try:
        traj = Trajectory.from_dict(data)
    except (TypeError, ValueError) as e:  # unknown or missing fields, mismatched lengths
        raise DataError(f"{where}: not a trajectory ({e})") from None
    if not traj.turns:
        raise DataError(f"{where}: a trajectory with no turns")
    return [(s.tokens, [int(bool(m)) for m in s.loss_mask], [i >= 0 for i in s.turn_index])
            for s in traj.sequences()]


def _chat(row: Any, where: str) -> tuple[list[dict[str, Any]], list[Any] | None]:
    if not isinstance(row, dict) or row.get("messages") is None:
        raise DataError(f"{where}: missing column 'messages' (a list of {{role, content}})")
    messages = row["messages"]
    if isinstance(messages, str):  # JSON text, as some parquet writers store nested columns
        try:
            messages = json.loads(messages)
        except (json.JSONDecodeError, RecursionError):
            raise DataError(f"{where}.messages: neither a list nor JSON text of one") from None
    messages = check_messages(messages, f"{where}.messages")
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except (json.JSONDecodeError, RecursionError):
            raise DataError(f"{where}.tools: neither a list nor JSON text of one") from None
    if tools is not None and not (isinstance(tools, list) and
                                  all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}.tools: a list of function schemas")
    return messages, tools or None


def _trained(message: dict[str, Any]) -> bool:
    return message["role"] == "assistant" and bool(message.get("loss_mask", 1))


def _render_parts(tokenizer: Any, row: Any, where: str
                  ) -> tuple[list[int], list[int], list[bool]]:
    """(tokens, loss mask, generated): `generated` marks every assistant message's tokens,
    trained or masked; the rest is context."""
    messages, tools = _chat(row, where)
    if not any(_trained(m) for m in messages):
        raise DataError(f"{where}.messages: no assistant message to train on")

    def ids(msgs: list[dict[str, Any]], prompt: bool) -> list[int]:
        try:
            text = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False,
                                                 add_generation_prompt=prompt)
        except Exception as e:  # jinja errors: the template refuses this chat
            raise DataError(f"{where}: the chat template cannot render it "
                            f"({type(e).__name__}: {e})") from None
        return list(tokenizer.encode(text, add_special_tokens=False))

    full = ids(messages, False)
    mask = [0] * len(full)
    generated = [False] * len(full)
    eos = getattr(tokenizer, "eos_token_id", None)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = ids(messages[:i], True), ids(messages[:i + 1], False)
        for prefix, what in ((start, "the chat up to it + the generation prompt"),
                             (end, "the chat through it")):
            if full[:len(prefix)] != prefix:
                raise DataError(f"{where}.messages[{i}]: the chat template is not prefix-stable "
                                f"({what} does not render as a prefix of the whole chat), so "
                                "its assistant tokens cannot be told apart exactly")
        span = range(len(start), len(end))
        if eos is not None and eos in full[len(start):len(end)]:  # stop after end of turn
            last = len(end) - 1 - full[len(start):len(end)][::-1].index(eos)
            span = range(len(start), last + 1)
        for t in span:
            mask[t] = int(_trained(m))
            generated[t] = True
    return full, mask, generated


def _text_parts(tokenizer: Any, row: Any, where: str, width: int
                ) -> list[tuple[list[int], list[int], list[bool]]]:
    """Title and text, then the end-of-text token, in windows of `width` tokens that overlap
    by one (each window's first token is the previous one's last target)."""
    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
        raise DataError(f"{where}: missing column 'text' (a string)")
    title = row.get("title")
    text = f"{title}\n\n{row['text']}" if isinstance(title, str) and title else row["text"]
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    eos = getattr(tokenizer, "eos_token_id", None)
    ids += [eos] if eos is not None else []
    return [(ids[i:i + width], [1] * len(ids[i:i + width]), [True] * len(ids[i:i + width]))
            for i in range(0, max(len(ids) - 1, 1), width - 1)]


# -- files → examples ----------------------------------------------------------------------
def _weigh_copies(tokens: Sequence[int], mask: list[float], words: frozenset[int],
                  weight: float) -> tuple[list[float], int]:
    """`mask` with every trained added word that already occurred earlier in the sequence
    (the context, an earlier turn, earlier in a page) scaled by `weight`; and how many
    there were."""
    seen: set[int] = set()
    out, copies = list(mask), 0
    for i, (t, m) in enumerate(zip(tokens, mask, strict=True)):
        if m == 1.0 and t in words and t in seen:
            out[i], copies = weight, copies + 1
        seen.add(t)
    return out, copies


def _system_prompt_length(tokens: Sequence[int], tokenizer: Any, start: int) -> int:
    """Tokens up to the turn after a leading ChatML system message (0 without one); `start`:
    the id of `<|im_start|>`."""
    if not tokens or tokens[0] != start or \
            not tokenizer.decode(tokens[1:16]).startswith("system"):
        return 0
    return next((i for i in range(1, len(tokens)) if tokens[i] == start), len(tokens))


def load_sft_data(files: Sequence[str | Path], tokenizer: Any, *, seq_length: int,
                  vocab_size: int, fmt: str = "auto", overlong: str = "truncate",
                  context_weight: float = 0.0, system_share: float = 1.0,
                  context_share: float = 1.0, copy_weight: float = 1.0,
                  seed: int = 0) -> SFTData:
    """Every sequence of `files`, in file and row order, cut or dropped to fit `seq_length`.
    `context_weight` > 0 also trains the context tokens (prompts, observations; never a
    masked turn's) with that loss weight; the system prompt only in a `system_share` of the
    sequences, and a `context_share` of the other context positions, each kept at weight
    `context_weight / context_share` (the same expected loss; draws seeded with `seed`).
    `copy_weight` scales the assistant's tokens that copy a name from the context (an added
    word of the tokenizer, `data tokenizer --title-tokens`, seen earlier in the sequence)."""
    if fmt not in FORMATS:
        raise DataError(f"sft.format={fmt!r}: one of {', '.join(FORMATS)}")
    if overlong not in ("truncate", "drop"):
        raise DataError(f"sft.overlong={overlong!r}: 'truncate' or 'drop'")
    if not 0.0 < context_share <= 1.0:
        raise DataError(f"sft.context_loss_share={context_share}: in (0, 1]")
    width = seq_length + 1
    stats = dict.fromkeys(("rows", "sequences", "truncated", "dropped_overlong",
                           "dropped_untrained", "trained_tokens"), 0)
    if context_weight:
        stats["context_tokens"] = 0
    examples: list[SFTExample] = []
    draw = random.Random(seed)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    words = added_word_ids(tokenizer) if copy_weight != 1.0 else frozenset()
    if words:
        stats["copy_tokens"] = 0
    for f in files:
        path, kind = Path(f), None if fmt == "auto" else fmt
        for where, row in iter_rows(path):
            kind = kind or row_format(row, where)
            stats["rows"] += 1
            seqs = (_trajectory_parts(row, where) if kind == "trajectories" else
                    _text_parts(tokenizer, row, where, width) if kind == "text" else
                    [_render_parts(tokenizer, row, where)])
            for tokens, mask, generated in seqs:
                bad = next((t for t in tokens if t >= vocab_size), None)
                if bad is not None:
                    raise DataError(f"{where}: token id {bad} is outside the model's "
                                    f"vocabulary of {vocab_size} (another tokenizer's data?)")
                if len(tokens) > width:
                    if overlong == "drop":
                        stats["dropped_overlong"] += 1
                        continue
                    stats["truncated"] += 1
                    tokens, mask, generated = tokens[:width], mask[:width], generated[:width]
                trained = sum(mask[1:])  # the first token is never a target
                if not trained:
                    stats["dropped_untrained"] += 1
                    continue
                stats["sequences"] += 1
                stats["trained_tokens"] += trained
                trained_mask = mask
                if words:
                    mask, copies = _weigh_copies(tokens, mask, words, copy_weight)
                    stats["copy_tokens"] += copies
                if context_weight:
                    # the system prompt is the same text in every sequence: a share of its
                    # copies teaches as much, and each trained position costs a
                    # vocabulary-wide matmul (most of a small model's cost)
                    skip = 0 if draw.random() < system_share else \
                        _system_prompt_length(tokens, tokenizer, im_start)
                    context = [i >= skip and not m and not g and
                               (context_share == 1.0 or draw.random() < context_share)
                               for i, (m, g) in enumerate(zip(trained_mask, generated,
                                                              strict=True))]
                    stats["context_tokens"] += sum(context[1:])
                    weight = context_weight / context_share
                    mask = [weight if c else float(m) for m, c in zip(mask, context)]
                examples.append(SFTExample(tokens, mask, where))
    if not examples:
        raise DataError(f"no sequence to train on in {', '.join(map(str, files)) or '(none)'} "
                        f"({stats})")
    return SFTData(examples, stats)


def sft_batch(examples: Sequence[SFTExample], *, pad_id: int, rows_multiple: int = 1
              ) -> TokenBatch:
    """Right-padded rows as wide as the longest example; rows padded up to a multiple with
    fully masked rows (they add nothing to the loss sum or its token count)."""
    rows = -(-len(examples) // rows_multiple) * rows_multiple
    width = max(len(e.tokens) for e in examples)
    tokens = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros(rows, width)
    for i, e in enumerate(examples):
        tokens[i, :len(e.tokens)] = torch.tensor(e.tokens)
        mask[i, :len(e.tokens)] = torch.tensor(e.loss_mask, dtype=torch.float)
    return TokenBatch.from_sequences(tokens, mask)

"""A small Qwen3-style tokenizer built on the spot: byte-level BPE (any text round-trips),
Qwen3's special and added tokens and a trimmed Qwen3 chat template with tools. Tests and the
embedded default use it (nothing is downloaded), and so does training-free eval, where it only
keeps the agent's token bookkeeping: a hosted model sees text.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                "</think>")

# Qwen3's template (tokenizer_config.json of Qwen3-*), without the reasoning-history pruning
QWEN3_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)

_CORPUS = [
    "You are a deep-search assistant. Answer the question by searching the web and reading "
    "pages. Think step by step. Call tools whenever you need information.",
    "The Planner decides the next step; the Synthesizer rewrites the notes with the evidence.",
    '{"name": "search", "arguments": {"query": "capital of France"}}',
    '{"name": "visit", "arguments": {"url": "https://en.wikipedia.org/wiki/Paris"}}',
    "Paris is the capital and largest city of France, on the river Seine. The Eiffel Tower was "
    "completed in 1889 for the World's Fair. Question: Notes so far: New evidence: Error:",
    "# Tools You may call one or more functions to assist with the user query. function name "
    "arguments within XML tags <answer>Paris</answer> type object properties string required",
]


def tiny_qwen3_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer (any text round-trips) with Qwen3's special tokens
    (`<|im_start|>`…, special) and tool/think tokens (added, not special), trained here in
    milliseconds; `vocab_size` total ids, so ids fit a tiny model's embedding."""
    return train_chat_tokenizer((), vocab_size)


def train_chat_tokenizer(texts: Iterable[str], vocab_size: int,
                         isolate_spaces: bool = False, words: Iterable[str] = (),
                         prefixes: Iterable[str] = ()) -> Any:
    """A ChatML tokenizer trained on `texts`: byte-level BPE with Qwen3's special, tool and
    think tokens and its chat template, `vocab_size` ids in all (an HF fast tokenizer;
    `save_pretrained` writes a folder transformers loads offline).

    `isolate_spaces`: every whitespace character is its own token, so a word has the same ids
    wherever it stands (`of Sendal` and `"Sendal` share `Sen dal`; GPT-2-style merges would
    give `ĠSen` and `Sen`). Copying a name from the question into a query is then copying ids,
    what an induction head does; ~30 % more tokens per text. (Measured on the quickstart:
    no copying at 200 SFT steps either way, and a worse tool-call format, so it is off there.)"""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s"), behavior="isolated"), byte_level])
        if isolate_spaces else byte_level)
    tok.decoder = decoders.ByteLevel()
    n_added = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    # the agents' own scaffolding (prompts, tool-call JSON) is always part of the corpus
    tok.train_from_iterator(itertools.chain(_CORPUS * 4, texts), trainers.BpeTrainer(
        vocab_size=vocab_size - n_added, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    # whole words (page titles, URLs): one id each wherever they stand, on top of vocab_size;
    # prefixes (a URL's part before its title) one id even when a word follows at once
    tok.add_tokens([AddedToken(w, special=False, normalized=False, single_word=True)
                    for w in dict.fromkeys(words) if w.strip() == w and w])
    tok.add_tokens([AddedToken(p, special=False, normalized=False)
                    for p in dict.fromkeys(prefixes) if p.strip() == p and p])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = QWEN3_TEMPLATE
    return fast


def run_tokenizer(hf_path: str | None, model_name: str, vocab_size: int) -> Any:
    """The tokenizer (and chat template) of a run: the HF folder's, through transformers and
    offline, when the policy comes from one; the built-in tiny one for the tiny registry
    models. Its ids must fit the model's embedding."""
    if hf_path is None:
        if not model_name.startswith("tiny-"):
            raise ValueError(f"model.name={model_name!r}: set model.hf_path (a checkpoint "
                             "folder with its tokenizer); the built-in tokenizer is for the tiny "
                             "registry models only")
        return tiny_qwen3_tokenizer(vocab_size=vocab_size)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"model.hf_path={hf_path!r}: no usable tokenizer there "
                         f"({type(e).__name__}: {str(e)[:200]})") from None
    if len(tokenizer) > vocab_size:
        raise ValueError(f"model.hf_path={hf_path!r}: its tokenizer has {len(tokenizer)} tokens "
                         f"but the model's embedding holds {vocab_size} (a mismatched "
                         "tokenizer?)")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"model.hf_path={hf_path!r}: the tokenizer has no chat template")
    return tokenizer


def pad_id(tokenizer: Any) -> int:
    """The id padding rows use (never trained on): the pad token, else end of text."""
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    return 0

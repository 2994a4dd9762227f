"""Any OpenAI-compatible chat model behind the `RolloutEngine` protocol (training-free eval).

Agents speak token ids; a hosted model (Claude, DeepSeek, an SGLang server's /v1) speaks
messages. This adapter decodes the ChatML context an agent built back into messages, asks the
model for the next assistant message, and returns that text tokenized with the agent's own
tokenizer, ended by `<|im_end|>`. Log-probs are unknown (0.0) and every token carries weight
version 0: such trajectories are for evaluation, never for training.
"""

from __future__ import annotations

import re
from typing import Any

from megatron_rl.engines.base import (
    EngineError,
    GenerateRequest,
    GenerateResult,
    NoServerControl,
)
from megatron_rl.utils.chat_client import ChatClient

_MESSAGE = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)(?:<\|im_end\|>\n?|\Z)",
                      re.DOTALL)
_EMPTY_THINK = re.compile(r"^\s*<think>\s*</think>\s*$")


def chatml_messages(text: str) -> list[dict[str, str]]:
    """ChatML text → messages. The open assistant turn the generation prompt leaves at the end
    (empty, or an empty think block) is dropped: the model writes that message."""
    messages = [{"role": role, "content": body} for role, body in _MESSAGE.findall(text)]
    if messages and messages[-1]["role"] == "assistant" and (
            not messages[-1]["content"].strip() or _EMPTY_THINK.match(messages[-1]["content"])):
        messages.pop()
    if not messages:
        raise EngineError("the context holds no ChatML message", endpoint="/v1/chat/completions")
    return messages


class OpenAIChatEngine(NoServerControl):
    """`generate` through `/v1/chat/completions` (with the client's limits and retries)."""

    weight_version = 0

    def __init__(self, client: ChatClient, tokenizer: Any):
        self.client, self.tokenizer = client, tokenizer
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        messages = chatml_messages(self.tokenizer.decode(req.input_ids,
                                                         skip_special_tokens=False))
        text, why = await self.client.call(messages, parse=str)
        if text is None:
            raise EngineError(f"chat model call failed: {why}", endpoint="/v1/chat/completions")
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.end_id]
        finish = "stop"
        if len(ids) > req.sampling.max_new_tokens:
            ids, finish = ids[: req.sampling.max_new_tokens], "length"
        return GenerateResult(req.rid, ids, [0.0] * len(ids), finish, [0] * len(ids),
                              prompt_tokens=len(req.input_ids), text=text)

    async def update_weights_from_tensors(self, named_tensors: Any, weight_version: int) -> None:
        raise EngineError("a hosted chat model takes no weight updates")

    async def update_weights_from_disk(self, path: str, weight_version: int) -> None:
        raise EngineError("a hosted chat model takes no weight updates")

    async def close(self) -> None:
        await self.client.close()

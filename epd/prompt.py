"""Renders chats into prompt token ids with the model's own chat template: one placeholder per
media item, where the template puts it.

The gateway renders every request here, so that all stages (and the monolithic oracle) start
from the very same token ids; vLLM's processor in each engine expands the placeholders. The
encoder renders a prompt of just its items, so its engine finds one placeholder per item.
"""

from __future__ import annotations

from collections.abc import Sequence

from epd.domain import ChatMessage, Modality, Role, TextPart


class PromptRenderer:
    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def render(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The chat, ready for the assistant's reply."""
        conversation = [
            {
                "role": message.role.value,
                "content": [{"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": part.modality.value} for part in message.parts],
            }
            for message in messages
        ]
        return self._tokens(conversation, add_generation_prompt=True)

    def render_items(self, modalities: Sequence[Modality]) -> list[int]:
        """A prompt holding one placeholder per item, in order, and nothing to generate from."""
        return self._tokens([{"role": Role.USER.value, "content": [{"type": m.value} for m in modalities]}], add_generation_prompt=False)

    def _tokens(self, conversation: list[dict], *, add_generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

"""Renders a chat into engine prompt tokens, with one placeholder per media item.

The gateway owns the chat template so that every stage (and the monolithic oracle) sees the
very same token ids; the engines expand each placeholder from the item's metadata.
"""

from __future__ import annotations

from epd.domain import ChatMessage, TextPart


class PromptRenderer:
    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def render(self, messages: tuple[ChatMessage, ...]) -> list[int]:
        conversation = [
            {
                "role": message.role.value,
                "content": [
                    {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": part.modality.value}
                    for part in message.parts
                ],
            }
            for message in messages
        ]
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

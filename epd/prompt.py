"""Renders chats into prompt token ids with the model's own chat template: one placeholder per
media item, where the template puts it.

The engine that prefills a request renders its chat here: the prefill (E/P/D), the decode or
combined instance (E+PD), the monolithic oracle; the decode of an E/P/D request is given the
token ids its prefill rendered. The gateway sends the chat with a marker where each item goes
and needs no tokenizer. vLLM's processor in each engine expands the placeholders. The encoder
renders a prompt of just its items, so its engine finds one placeholder per item.

A chat renders to exactly the ids vLLM's chat path (``LLM.chat``, ``vllm serve``) gives it: the
template applied to the real text, its output tokenized in one piece, so a template that
rewrites text (Gemma 3 trims it) and a tokenizer that merges across a text's edges give vLLM's
ids. With one exception, on purpose: user text is never control tokens. A ``<|im_start|>``
typed by a user would be the control token in vLLM's ids, letting anyone forge a turn or a
system prompt; so the special tokens of that one-piece tokenization must be exactly those of
the template's own markup (the same chat rendered with a sentinel, private-use characters no
tokenizer merges across, in place of each text part). When they are not, each text part is
tokenized on its own with ``split_special_tokens`` between the markup's pieces: the typed
``<|im_start|>`` becomes the tokens of its characters (and a template that rewrites text sees
the sentinel there: such a chat is the one that differs from vLLM's).

Tokenizing is serialized per renderer: a fast tokenizer's ``encode`` sets
``split_special_tokens`` on the one Rust tokenizer every thread shares, so two renders at once
could tokenize the template's markup as text (or a user's text as markup). Long chats render in
worker threads; this race once made concurrent requests' tokens differ from monolithic.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence

from epd.domain import ChatMessage, Modality, Role, TextPart
from epd.errors import InvalidArgument
from epd.offload import INLINE_TEXT_BYTES, run_sized

_SENTINEL = "\ue000{}\ue001"
_SENTINELS = re.compile("\ue000(\\d+)\ue001")


class PromptRenderer:
    def __init__(self, model_dir: str, *, max_prompt_tokens: int = 0):
        """``max_prompt_tokens``: refuse rendered prompts longer than this (the model's context:
        media only add tokens); 0: unchecked."""
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # The control tokens: what split_special_tokens keeps a text part from becoming.
        self._special_ids = frozenset(self.tokenizer.all_special_ids) | {i for i, token in self.tokenizer.added_tokens_decoder.items() if token.special}
        self._tokenizing = threading.Lock()  # see the module docstring
        self.max_prompt_tokens = max_prompt_tokens

    async def render_on_loop(self, messages: Sequence[ChatMessage], field: str = "messages") -> list[int]:
        """:meth:`render` from an event loop: a short chat in place, a long one in a worker thread."""
        return await run_sized(chat_text_bytes(messages), INLINE_TEXT_BYTES, self.render, messages, field)

    def render(self, messages: Sequence[ChatMessage], field: str = "messages") -> list[int]:
        """The chat, ready for the assistant's reply. Slow for long chats: never on an event loop
        (:meth:`render_on_loop`). Media parts (or their markers) become one placeholder each.

        Raises:
            InvalidArgument: the chat renders to more tokens than the model's context (the
                violation names ``field``, where the caller's request holds the chat).
        """
        texts: list[str] = []

        def conversation(text_part) -> list[dict]:
            def content(part) -> dict:
                return text_part(part) if isinstance(part, TextPart) else {"type": part.modality.value}

            return [{"role": message.role.value, "content": [content(part) for part in message.parts]} for message in messages]

        def sentinel(part: TextPart) -> dict:
            texts.append(part.text)
            return {"type": "text", "text": _SENTINEL.format(len(texts) - 1)}

        rendered = self._template(conversation(lambda part: {"type": "text", "text": part.text}))
        markup = self._template(conversation(sentinel))
        with self._tokenizing:
            ids = self.tokenizer.encode(rendered, add_special_tokens=False)  # vLLM's ids
            if self._specials(ids) != self._specials(self.tokenizer.encode(markup, add_special_tokens=False)):
                ids = self._with_text_as_text(markup, texts)  # a text part holds control tokens
        if self.max_prompt_tokens and len(ids) > self.max_prompt_tokens:
            raise InvalidArgument.for_field(field, f"render to {len(ids)} prompt tokens before any media, over the model's context of {self.max_prompt_tokens}")
        return ids

    def _template(self, conversation: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)

    def _specials(self, ids: list[int]) -> list[int]:
        return [i for i in ids if i in self._special_ids]

    def _with_text_as_text(self, markup: str, texts: list[str]) -> list[int]:
        """The markup's pieces tokenized as markup, each text part as plain text (call under
        ``_tokenizing``)."""
        ids: list[int] = []
        # re.split alternates template markup and the captured text-part indices.
        for position, segment in enumerate(_SENTINELS.split(markup)):
            if position % 2:
                ids += self.tokenizer.encode(texts[int(segment)], add_special_tokens=False, split_special_tokens=True)
            elif segment:
                ids += self.tokenizer.encode(segment, add_special_tokens=False)
        return ids

    def render_items(self, modalities: Sequence[Modality]) -> list[int]:
        """A prompt holding one placeholder per item, in order, and nothing to generate from."""
        conversation = [{"role": Role.USER.value, "content": [{"type": m.value} for m in modalities]}]
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
        with self._tokenizing:
            return self.tokenizer.encode(text, add_special_tokens=False)


def check_chat_size(messages: Sequence[ChatMessage], max_bytes: int) -> None:
    """Refuses a chat whose text is over ``max_bytes`` (0: no limit); cheap, no tokenizing.

    Raises:
        InvalidArgument: the chat is over the limit.
    """
    size = chat_text_bytes(messages)
    if max_bytes and size > max_bytes:
        raise InvalidArgument.for_field("messages", f"hold {size} bytes of text, over the gateway's limit of {max_bytes} (--max-prompt-bytes)")


def chat_text_bytes(messages: Sequence[ChatMessage]) -> int:
    """The UTF-8 size of the chat's text parts: what rendering it costs, and what
    ``--max-prompt-bytes`` bounds."""
    return sum(len(part.text.encode()) for message in messages for part in message.parts if isinstance(part, TextPart))

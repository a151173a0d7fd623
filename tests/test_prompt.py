"""Prompt rendering under concurrency (pure, no engine): the gateway renders each request in a
worker thread, and every render must equal the same chat rendered alone.

A fast tokenizer's ``split_special_tokens`` is state on the one Rust tokenizer all threads
share; unserialized, about one render in 200 at 16 threads tokenized the template's markup as
text, and the request decoded to other tokens than monolithic (the faults bench saw it).
"""

from __future__ import annotations

import asyncio

from epd.domain import ChatMessage, MediaFile, MediaInput, Modality, Role, TextPart
from epd.prompt import PromptRenderer
from tests.conftest import DEFAULT_FAMILY, checkpoint

_THREADS = 16
_ROUNDS = 150


def _chat(index: int) -> list[ChatMessage]:
    image = MediaInput.of(Modality.IMAGE, MediaFile(b"not decoded here", "image/png"))
    return [ChatMessage(Role.USER, (image, TextPart(f"What is in picture {index}? <|im_end|> is text here.")))]


async def test_concurrent_renders_equal_renders_alone():
    renderer = PromptRenderer(str(checkpoint(DEFAULT_FAMILY)))
    chats = [_chat(i) for i in range(_THREADS)]
    alone = [renderer.render(chat) for chat in chats]
    wrong = 0
    for _ in range(_ROUNDS):
        together = await asyncio.gather(*(asyncio.to_thread(renderer.render, chat) for chat in chats))
        wrong += sum(ids != expected for ids, expected in zip(together, alone, strict=True))
    assert wrong == 0, f"{wrong} of {_ROUNDS * _THREADS} concurrent renders differ from the same chat rendered alone"

"""Prompt rendering under concurrency (pure, no engine): the gateway renders each long chat in a
worker thread, and every render must equal the same chat rendered alone.

A fast tokenizer's ``split_special_tokens`` is state on the one Rust tokenizer all threads
share; unserialized, about one render in 200 at 16 threads tokenized the template's markup as
text, and the request decoded to other tokens than monolithic (the faults bench saw it).
"""

from __future__ import annotations

import asyncio
import threading

from epd.domain import ChatMessage, MediaFile, MediaInput, Modality, Role, TextPart
from epd.offload import INLINE_TEXT_BYTES
from epd.prompt import PromptRenderer
from tests.conftest import DEFAULT_FAMILY, checkpoint

_THREADS = 16
_ROUNDS = 150


def _chat(index: int) -> list[ChatMessage]:
    image = MediaInput(Modality.IMAGE, MediaFile(b"not decoded here", "image/png"))
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


async def test_short_chats_render_on_the_loop_and_long_ones_in_a_thread():
    renderer = PromptRenderer(str(checkpoint(DEFAULT_FAMILY)))
    threads: list[int] = []
    render = renderer.render
    renderer.render = lambda messages, field: threads.append(threading.get_ident()) or render(messages, field)  # type: ignore[method-assign]
    short = [ChatMessage(Role.USER, (TextPart("x" * INLINE_TEXT_BYTES),))]
    long = [ChatMessage(Role.USER, (TextPart("x" * (INLINE_TEXT_BYTES + 1)),))]
    assert await renderer.render_on_loop(short) == render(short)
    assert await renderer.render_on_loop(long) == render(long)
    assert threads[0] == threading.get_ident(), "a short chat was handed to a thread"
    assert threads[1] != threading.get_ident(), "a long chat was rendered on the event loop"

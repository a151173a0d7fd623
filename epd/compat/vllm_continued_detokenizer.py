"""Detokenizes a reply continued after tokens its prompt ends with exactly as the reply would have
been detokenized uninterrupted.

EPD's engines run prompts that end with tokens of the reply: a decode after its prefill's first
token, and any stage of a request resumed after some of its reply was streamed. vLLM 0.32 primes a
request's detokenizer with its whole prompt (``FastIncrementalDetokenizer``: tokenizers'
``DecodeStream(ids=prompt)``). A byte-level tokenizer's token can be part of a character, and
when the primed ids decode to text that ends with an incomplete one ("\ufffd"), DecodeStream
keeps no prefix, so its next step returns the whole prompt's text with the new token's: a Qwen
reply whose first token was such a part came back from E/P/D with its system prompt in front.

A request whose sampling ``extra_args[CONTINUED]`` is N gets a detokenizer primed with the prompt
before its last N tokens, which then steps through them as the uninterrupted reply's did: its
state, and so every later token's text, is that reply's. Their text is its output text too, so
a stop string that spans the seam is found as in the uninterrupted reply, and the part of it
that reply's stream had not shown yet (vLLM holds back the last characters of a reply that has
stop strings, as many as the longest but one; :func:`shown_while_streaming` is that rule, by
which a prefill holds back its first token's text alike) is output first. Remove this once vLLM has a way to continue a reply
(then check ``tests/test_models.py``'s text assertions and ``tests/test_equivalence.py``'s
stop strings).
"""

from __future__ import annotations

import functools

CONTINUED = "epd_reply_tokens_in_prompt"


def shown_while_streaming(text: str, stop: tuple[str, ...]) -> str:
    """What vLLM's stream of an unfinished reply shows of ``text``, its output so far: all but
    the last characters a stop string could start in (``stop_buffer_length``)."""
    held = max(map(len, stop), default=1) - 1
    return text[: max(0, len(text) - held)]


@functools.cache
def install() -> None:
    import msgspec
    from vllm.v1.engine.detokenizer import BaseIncrementalDetokenizer, IncrementalDetokenizer

    from_new_request = IncrementalDetokenizer.from_new_request.__func__

    def continuing(cls, tokenizer, request):
        continued = int((request.sampling_params.extra_args or {}).get(CONTINUED, 0))
        if tokenizer is None or not continued or request.prompt_token_ids is None:
            return from_new_request(cls, tokenizer, request)
        before = msgspec.structs.replace(request, prompt_token_ids=request.prompt_token_ids[:-continued])
        detokenizer = from_new_request(cls, tokenizer, before)
        if isinstance(detokenizer, BaseIncrementalDetokenizer):
            for token_id in request.prompt_token_ids[-continued:]:
                detokenizer.output_text += detokenizer.decode_next(token_id)
            detokenizer._last_output_text_offset = max(0, len(detokenizer.output_text) - detokenizer.stop_buffer_length)
        return detokenizer

    IncrementalDetokenizer.from_new_request = classmethod(continuing)

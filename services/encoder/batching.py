"""Which ready Encode calls share one engine request.

Every engine request costs the same fixed work whatever it carries: one call of vLLM's processor
(on its single processing thread), the engine's input and output processing, and the scheduler's
bookkeeping. With one small item per call, that fixed work, not the tower, set the encoder's
throughput (issue 32: 4.4 items per engine step against 16 for an in-process pipeline). vLLM
already batches the items of concurrent requests into one tower pass, so joining calls into one
request changes no output; it only removes per-request work.

vLLM relies on the same independence that makes this sound: its processor cache processes only
the items it has not seen, apart from the prompt they came with, and its encoder cache reuses an
item's output in any other prompt. An item is laid out and encoded the same in any prompt.

The rules, kept here so they can be read (and unit-tested) apart from the engine:

- a call joins the oldest waiting calls in arrival order, and the first call that does not fit
  closes the batch, so no call is overtaken;
- a batch holds at most the engine's per-prompt limit of each modality (vLLM's processor refuses
  more; an encoder's engine takes ``epd.engine.ENCODER_CALLS_PER_REQUEST`` calls' worth of each,
  four of images or video, one of audio), no content hash twice across its calls (each call gets
  leases of its own), and no more
  prompt tokens than the engine's context, as far as the largest item of each modality seen so far
  predicts;
- at most ``batches_in_flight`` batches are in vLLM at once: under light load every call goes at
  once, alone; under load the calls that arrive meanwhile wait and become the next batch, as
  large as the rules allow. (Sharing the waiting calls out among smaller batches, so that vLLM's
  processor prepares one while the tower runs another, was slower here: 115 against 140 images/s
  in a burst of 64; the two compete for the same cores and the GIL, and each request's fixed
  work is paid once more per batch.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter, deque
from collections.abc import Mapping

from epd.domain import MediaInput, PublishedItem


@dataclasses.dataclass(eq=False)
class PendingCall:
    """One Encode call whose media is decoded, waiting for (or in) an engine request."""

    request_id: str
    items: list[MediaInput]
    decoded: list
    paths: list[str]
    published: asyncio.Future[dict[str, PublishedItem]]
    abandoned: bool = False  # its caller is gone: whatever is published for it is released
    ready_at: float = dataclasses.field(default_factory=time.perf_counter)  # decoded, waiting from then on

    @property
    def hashes(self) -> set[str]:
        return {item.content_hash for item in self.items}


class CallQueue:
    """Ready calls in arrival order, taken in batches by the rules above."""

    def __init__(self, per_prompt: Mapping[str, int], max_prompt_tokens: int):
        self._per_prompt = dict(per_prompt)
        self._max_prompt_tokens = max_prompt_tokens
        # The most prompt tokens one item of each modality has taken so far (vLLM's processor
        # decides them): the prediction that keeps batches within the engine's context.
        self._tokens_per_item: dict[str, int] = {}
        self._waiting: deque[PendingCall] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def put(self, call: PendingCall) -> None:
        self._waiting.append(call)

    def withdraw(self, call: PendingCall) -> bool:
        """Takes a call out before it reached the engine; False if it is no longer waiting."""
        try:
            self._waiting.remove(call)
        except ValueError:
            return False
        return True

    def learn(self, placeholders: list[tuple[str, int, int]]) -> None:
        """Takes in the prompt tokens a rendered prompt's items took: (modality, tokens, rows)."""
        for modality, tokens, _ in placeholders:
            self._tokens_per_item[modality] = max(self._tokens_per_item.get(modality, 0), tokens)

    def take_batch(self) -> list[PendingCall]:
        """The oldest waiting call and those after it that fit with it (see the module's rules)."""
        batch = [self._waiting.popleft()]
        counts = Counter(item.modality.value for item in batch[0].items)
        hashes = batch[0].hashes
        tokens = self._predicted_tokens(batch[0])
        while self._waiting:
            call = self._waiting[0]
            joined = counts + Counter(item.modality.value for item in call.items)
            if any(count > self._per_prompt.get(modality, 0) for modality, count in joined.items()):
                break
            if hashes & call.hashes or tokens + self._predicted_tokens(call) > self._max_prompt_tokens:
                break
            batch.append(self._waiting.popleft())
            counts, hashes, tokens = joined, hashes | call.hashes, tokens + self._predicted_tokens(call)
        return batch

    def _predicted_tokens(self, call: PendingCall) -> int:
        return sum(self._tokens_per_item.get(item.modality.value, 0) for item in call.items)

"""The fields of vLLM's ``Request`` and ``SchedulerOutput`` that EPD's EC consumer reads, for
driving :class:`~epd.transport.connector.ec_consumer.ConsumerScheduler` outside an engine (its
tests, and the handoff benchmark's consumer path)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Position:
    """An item's placeholder run in the prompt (vLLM's ``PlaceholderRange``)."""

    embeds: int
    offset: int = 3  # after a few text tokens

    @property
    def length(self) -> int:
        return self.embeds

    def get_num_embeds(self) -> int:
        return self.embeds


@dataclasses.dataclass
class Feature:
    identifier: str
    mm_position: Position


@dataclasses.dataclass
class Request:
    request_id: str
    mm_features: list[Feature]
    ec_transfer_params: Any


@dataclasses.dataclass
class SchedulerOutput:
    free_encoder_mm_hashes: list[str] = dataclasses.field(default_factory=list)

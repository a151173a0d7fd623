"""Consumer side of the embedding handoff, shared by prefill and combined decode: read every
item's embedding (one batched NIXL READ per producer) and check it against its metadata."""

from __future__ import annotations

import time
from collections.abc import Sequence

from epd import telemetry
from epd.domain import EncodedItem, InlineEmbedding
from epd.errors import FailedPrecondition, FieldViolation, InvalidArgument, Unavailable
from epd.transport.nixl import EmbeddingFetcher, NixlRegion, TransferError

_tracer = telemetry.tracer(__name__)
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class EmbeddingSource:
    """Turns encoded items into tensors, failing only the request on any mismatch."""

    def __init__(self, fetcher: EmbeddingFetcher | None, *, allow_inline: bool):
        self.fetcher = fetcher
        self.allow_inline = allow_inline

    async def load(self, items: Sequence[EncodedItem]) -> tuple[list, float]:
        """Reads all embeddings, then checks each against its metadata.

        Reading comes first on purpose: a read consumes the producer's lease, so a request that
        fails validation still frees the encoder's slots.

        Returns:
            (tensors in item order, seconds spent reading)

        Raises:
            InvalidArgument: a handle is missing or an embedding's size disagrees with its shape.
            Unavailable: a NIXL read failed (peer down, lease expired).
        """
        started = time.perf_counter()
        with _tracer.start_as_current_span("embedding_fetch") as span:
            span.set_attribute("epd.items", len(items))
            raw = await self._read_all(items)
        elapsed = time.perf_counter() - started
        telemetry.NIXL_READ_SECONDS.observe(elapsed)
        return [self._to_tensor(item, data, index) for index, (item, data) in enumerate(zip(items, raw, strict=True))], elapsed

    async def _read_all(self, items: Sequence[EncodedItem]) -> list:
        missing = [FieldViolation(f"items[{i}].embedding", "is required") for i, item in enumerate(items) if item.embedding is None]
        if missing:
            raise InvalidArgument("embedding handles are missing", missing)
        regions = [(i, item.embedding) for i, item in enumerate(items) if isinstance(item.embedding, NixlRegion)]
        raw: list = [item.embedding.data if isinstance(item.embedding, InlineEmbedding) else None for item in items]
        if any(isinstance(item.embedding, InlineEmbedding) for item in items) and not self.allow_inline:
            raise FailedPrecondition("inline embeddings are disabled on this service (start it with --allow-inline-embeddings)")
        if regions:
            if self.fetcher is None:
                raise FailedPrecondition("this service has no NIXL agent")
            try:
                fetched = await self.fetcher.fetch([region for _, region in regions])
            except TransferError as exc:
                raise Unavailable(f"reading embeddings over NIXL failed: {exc}") from exc
            except ValueError as exc:
                raise InvalidArgument.for_field("items", f"embeddings do not fit the receive buffer: {exc}") from exc
            for (index, region), data in zip(regions, fetched, strict=True):
                raw[index] = data
                telemetry.NIXL_READ_BYTES.inc(region.nbytes)
        return raw

    @staticmethod
    def _to_tensor(item: EncodedItem, data, index: int):
        import torch

        meta = item.metadata
        field = f"items[{index}].metadata.embedding_shape"
        if meta.embedding_dtype not in _DTYPE_BYTES or len(meta.embedding_shape) != 2:
            raise InvalidArgument.for_field(field, f"must be [rows, width] of a float dtype, got {list(meta.embedding_shape)} {meta.embedding_dtype}")
        rows, width = meta.embedding_shape
        row_bytes = width * _DTYPE_BYTES[meta.embedding_dtype]
        nbytes = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else data.numel() * data.element_size()
        if nbytes != rows * row_bytes:
            actual = f"{nbytes / row_bytes:g} rows" if nbytes % row_bytes == 0 else f"{nbytes} bytes"
            raise InvalidArgument.for_field(field, f"says {rows} rows of width {width} but the embedding holds {actual}")
        if meta.placeholder_count != rows:
            raise InvalidArgument.for_field(
                f"items[{index}].metadata.placeholder_count", f"is {meta.placeholder_count} but the embedding has {rows} rows"
            )
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else data
        return buffer.view(getattr(torch, meta.embedding_dtype)).reshape(rows, width)

"""EncoderService servicer: parse, call the runner, convert back. Nothing else."""

from __future__ import annotations

import asyncio

from epd import wire
from epd.errors import Unavailable
from epd.rpc import rpc_method
from epd.v1 import encoder_pb2, encoder_pb2_grpc
from services.encoder.runner import EncoderRunner


class EncoderServicer(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self) -> None:
        self.runner: EncoderRunner | None = None  # set once the engine has loaded

    def _ready_runner(self) -> EncoderRunner:
        if self.runner is None:
            raise Unavailable("encoder is still loading")
        return self.runner

    @rpc_method("encoder")
    async def Encode(self, request: encoder_pb2.EncodeRequest, context) -> encoder_pb2.EncodeResponse:
        """Encodes the request's media items; vLLM batches them with concurrent requests.

        Args:
            request: media bytes, MIME types and content hashes, in prompt order.
            context: the RPC context.

        Returns:
            Metadata and an embedding handle per item, in request order.
        """
        runner = self._ready_runner()
        release_key = wire.release_key_from_wire(request.release_key)
        # Off the event loop: each item's content hash is recomputed over its bytes (milliseconds
        # for a large one; hashlib releases the GIL).
        items = await asyncio.to_thread(wire.media_items_from_wire, request.items)
        encoded = await runner.encode(request.request_id or "anonymous", items, release_key)
        return encoder_pb2.EncodeResponse(items=[wire.encoded_item_to_wire(e) for e in encoded])

    @rpc_method("encoder")
    async def ReleaseEmbeddings(self, request: encoder_pb2.ReleaseEmbeddingsRequest, context) -> encoder_pb2.ReleaseEmbeddingsResponse:
        """Frees leases no consumer will read; unknown ids and keys are ignored.

        Args:
            request: the lease ids to free, and the release keys of Encode calls whose leases to free.
            context: the RPC context.

        Returns:
            How many lease ids were handed to the arena.
        """
        released = await self._ready_runner().release(list(request.lease_ids), wire.release_keys_from_wire(request.release_keys))
        return encoder_pb2.ReleaseEmbeddingsResponse(released_count=released)

    @rpc_method("encoder")
    async def GetTransferMetadata(self, request: encoder_pb2.GetTransferMetadataRequest, context) -> encoder_pb2.GetTransferMetadataResponse:
        """Hands a consumer the engine's NIXL agent metadata and location key (secrets: only
        over this channel, which TLS protects where configured), and its arena's layout.

        Args:
            request: empty.
            context: the RPC context.

        Returns:
            The agent's name and metadata, the key that authenticates its locations, and the
            arena's address, length and slot size (for the consumer's prepared descriptors).
        """
        return self._ready_runner().transfer_credentials().to_wire()

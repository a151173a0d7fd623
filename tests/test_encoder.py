"""The encoder service under pressure: concurrent requests give the same results as alone, a
full arena holds requests back and then refuses them with RESOURCE_EXHAUSTED and RetryInfo,
explicit release frees leases, a call given up on leaves no lease behind, and an item the arena
can never hold is INVALID_ARGUMENT.
(That the encoder reads only tower shards is in test_data_path.)"""

from __future__ import annotations

import asyncio
import statistics
import time

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from devkit.media import synthetic_image_png, synthetic_video
from epd import wire
from epd.v1 import encoder_pb2, encoder_pb2_grpc, multimodal_pb2
from tests.helpers import read_published_rows, violations, wait_for_metric

SLOTS = 4
SLOT_BYTES = 16384  # a 112x112 image is 16 rows x 128 floats = 8 KiB plus a 64-byte header
CALLS_GIVEN_UP = 120


def _encode_request(seed: int) -> encoder_pb2.EncodeRequest:
    png = synthetic_image_png(112, 112, seed=seed)
    return encoder_pb2.EncodeRequest(request_id=f"r{seed}", items=[multimodal_pb2.MediaItem(image=multimodal_pb2.Media(data=png, mime_type="image/png"))])


@pytest.fixture
def small_encoder(family_stack):
    """An encoder whose arena holds four images, and that waits at most 5 s for room."""
    args = ["encoder", "--model", family_stack.model, "--metrics-port", "0", "--arena-slot-bytes", str(SLOT_BYTES)]
    args += ["--embedding-buffer-bytes", str(4096 + SLOTS * SLOT_BYTES), "--lease-ttl-s", "120", "--queue-timeout-s", "5"]
    with family_stack.stack.temporary("encoder-small-arena", args) as encoder:
        yield encoder


async def test_concurrency_arena_exhaustion_and_release(small_encoder, family_stack):
    async with grpc.aio.insecure_channel(small_encoder.address) as channel, grpc.aio.insecure_channel(family_stack.encoder.address) as reference_channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        # A first request warms the fresh engine up, so that the waits below are the arena's.
        warm = await stub.Encode(_encode_request(100), timeout=60)
        await stub.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=[warm.items[0].embedding.nixl.lease_id]))
        assert await wait_for_metric(small_encoder.metrics_port, "epd_arena_leases", 0.0) == 0.0
        together = await asyncio.gather(*(stub.Encode(_encode_request(seed), timeout=60) for seed in range(SLOTS)))
        # Sharing engine steps changes nothing: the shared encoder, encoding each alone, agrees.
        reference = encoder_pb2_grpc.EncoderServiceStub(reference_channel)
        for seed, response in enumerate(together):
            alone = await reference.Encode(_encode_request(seed), timeout=60)
            assert response.items[0].metadata == alone.items[0].metadata
            assert response.items[0].embedding.WhichOneof("transport") == "nixl"
            await reference.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=[alone.items[0].embedding.nixl.lease_id]))
        assert await wait_for_metric(small_encoder.metrics_port, "epd_arena_leases", float(SLOTS)) == SLOTS

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Encode(_encode_request(99), timeout=60)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        retry = error_details_pb2.RetryInfo()
        assert any(d.Unpack(retry) for d in rpc_status.from_call(info.value).details)

        leases = [r.items[0].embedding.nixl.lease_id for r in together]
        released = await stub.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=[*leases, "0123456789abcdef"]))
        assert released.released_count == SLOTS + 1
        assert await wait_for_metric(small_encoder.metrics_port, "epd_arena_leases", 0.0) == 0.0
        again = await stub.Encode(_encode_request(99), timeout=60)
        assert again.items[0].metadata.placeholder_count == 16
        await stub.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=[again.items[0].embedding.nixl.lease_id]))

        # An item the arena can never hold is refused at once, naming it, not queued.
        clip = synthetic_video(224, 224, 32, fps=8.0, seed=5)  # 4 groups of 64 rows: 128 KiB
        big = multimodal_pb2.MediaItem(video=multimodal_pb2.Video(file=multimodal_pb2.Media(data=clip, mime_type="video/mp4")))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Encode(encoder_pb2.EncodeRequest(items=[big]), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "items[0]" in violations(info.value), info.value.details()


async def test_an_encode_given_up_on_leaves_no_lease_behind(small_encoder):
    """Calls whose deadlines pass at any point of their run leave no lease to its 120 s TTL:

    - while it encodes: the engine request is aborted and frees what it leased;
    - after the engine published, its output on the way to a reply that will not be sent: the
      producer is told, and frees the leases;
    - after the reply was sent, on its way to a client whose deadline passed first (the
      server's starts a transit later): the client frees the leases by the call's release key.

    Deadlines are spread over the whole of a call, so that some fall in the last two windows of
    a few milliseconds each."""
    async with grpc.aio.insecure_channel(small_encoder.address) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)

        async def release(reply: encoder_pb2.EncodeResponse) -> None:
            await stub.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=[reply.items[0].embedding.nixl.lease_id]))

        durations = []
        for seed in range(200, 206):  # the first warms the fresh engine up
            started = time.perf_counter()
            reply = await stub.Encode(_encode_request(seed), timeout=60)
            durations.append(time.perf_counter() - started)
            await release(reply)
        took = statistics.median(durations[1:])
        received = given_up = 0
        for index in range(CALLS_GIVEN_UP):
            request = _encode_request(300 + index)
            request.release_key = f"key-{index}"
            try:
                reply = await stub.Encode(request, timeout=took * (0.4 + 0.8 * index / CALLS_GIVEN_UP))
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc.details()
                await stub.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(release_keys=[request.release_key]))
                given_up += 1
            else:
                await release(reply)
                received += 1
        assert received and given_up, (received, given_up, took)
        assert await wait_for_metric(small_encoder.metrics_port, "epd_arena_leases", 0.0) == 0.0

        # A release key over the bound is refused, naming the field.
        request = _encode_request(1)
        request.release_key = "k" * 65
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Encode(request, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and violations(info.value) == ["release_key"], info.value.details()


def test_the_towers_per_grid_caches_are_bounded_by_bytes_not_grids():
    """epd.compat.vllm_tower_caches: Qwen2.5-VL's and Qwen3-VL's towers build their per-grid
    caches from the name LRUCache in their modules; after the fix it holds at most the budget's
    bytes of tensors (1024 grids of any size before), and a grid larger than the budget is
    computed each time instead of raising."""
    import torch
    from vllm.model_executor.models import qwen2_5_vl, qwen3_vl

    from epd.compat import install_vllm_fixes
    from epd.compat.vllm_tower_caches import BUDGET_BYTES

    install_vllm_fixes()
    mib = 2**20 // 4  # float32 elements
    for module in (qwen2_5_vl, qwen3_vl):
        cache = module.LRUCache(capacity=1024)  # as the towers call it
        for grid in range(100):
            cache[(1, grid, grid)] = (torch.zeros(mib), torch.zeros(mib), torch.zeros(16, dtype=torch.int64))
        assert cache.currsize <= BUDGET_BYTES
        assert len(cache) == BUDGET_BYTES // (2 * 2**20 + 128)
        assert (1, 99, 99) in cache and (1, 0, 0) not in cache  # least recently used first out
        cache[(1, 500, 500)] = torch.zeros(BUDGET_BYTES // 4 + 1)
        assert (1, 500, 500) not in cache and (1, 99, 99) in cache


async def test_callers_that_leave_a_shared_request_leave_no_lease_behind(family_stack):
    """Calls given up while the engine request they joined also serves other calls: the others
    get their items, the request is not aborted for them, and what is published for the callers
    that left is released when it ends (not kept to the lease TTL). The callers release by key
    too, as the gateway does, for replies that were on their way when the deadline passed."""
    from bench.workload import salt_media
    from devkit.media import synthetic_image

    images = [synthetic_image(112 + 28 * (seed % 3), 112, seed=seed, image_format="JPEG") for seed in range(12)]

    def request(index: int, salt: str) -> encoder_pb2.EncodeRequest:
        media = multimodal_pb2.Media(data=salt_media(images[index], "image/jpeg", salt), mime_type="image/jpeg")
        return encoder_pb2.EncodeRequest(request_id=f"{salt}-{index}", items=[multimodal_pb2.MediaItem(image=media)], release_key=f"{salt}-{index}")

    async with grpc.aio.insecure_channel(family_stack.encoder.address) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)

        async def encode(index: int, salt: str, timeout: float) -> tuple[float, encoder_pb2.EncodeResponse | None]:
            started = time.perf_counter()
            try:
                reply = await stub.Encode(request(index, salt), timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc.details()
                # As the gateway does: a reply may have been on its way when the deadline passed.
                await stub.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(release_keys=[f"{salt}-{index}"]))
                return time.perf_counter() - started, None
            await stub.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=[reply.items[0].embedding.nixl.lease_id]))
            return time.perf_counter() - started, reply

        took = statistics.median([seconds for seconds, _ in await asyncio.gather(*(encode(i, "measure", 60) for i in range(12)))])
        given_up = 0
        for attempt in range(5):
            # Every other call's deadline falls somewhere in the burst's run, the others have none.
            outcomes = await asyncio.gather(*(encode(i, f"leave-{attempt}", 60 if i % 2 == 0 else took * (0.1 + 0.15 * (i // 2))) for i in range(12)))
            assert all(reply is not None and reply.items[0].metadata.placeholder_count > 0 for _, reply in outcomes[::2])
            given_up += sum(reply is None for _, reply in outcomes[1::2])
        assert given_up, took
        assert await wait_for_metric(family_stack.encoder.metrics_port, "epd_arena_leases", 0.0) == 0.0


def _pending(index: int, image_hashes: list[str], video_hashes: tuple[str, ...] = ()):
    from epd.domain import MediaFile, MediaInput, Modality
    from services.encoder.batching import PendingCall

    # Equal bytes, equal content hash.
    items = [MediaInput(Modality.IMAGE, MediaFile(h.encode(), "image/png")) for h in image_hashes]
    items += [MediaInput(Modality.VIDEO, MediaFile(h.encode(), "video/mp4")) for h in video_hashes]
    return PendingCall(f"r{index}", items, [None] * len(items), [f"items[{i}]" for i in range(len(items))], asyncio.get_running_loop().create_future())


async def test_call_queue_joins_calls_in_order_within_the_prompt_limits():
    """services.encoder.batching.CallQueue, the rules alone: arrival order with no call
    overtaken, the per-prompt limit of each modality, no content hash in two calls of a batch,
    and the context as the largest item seen so far predicts it."""
    from services.encoder.batching import CallQueue

    queue = CallQueue({"image": 4, "video": 1}, max_prompt_tokens=1000)
    calls = [
        _pending(0, ["a", "b"]),
        _pending(1, ["c"]),
        _pending(2, ["d", "e"]),  # 5 images with the two before: the next batch
        _pending(3, ["f"]),  # fits beside the two before it, yet waits behind call 2
        _pending(4, ["g"], ("v",)),
        _pending(5, [], ("w",)),  # a second video
        _pending(6, ["x", "x"]),  # a repeat inside one call is that call's own
        _pending(7, ["x"]),  # the same content in another call: its own request
    ]
    for call in calls:
        queue.put(call)
    assert queue.withdraw(calls[3]) and not queue.withdraw(calls[3])
    batches = []
    while queue:
        batches.append([call.request_id for call in queue.take_batch()])
    assert batches == [["r0", "r1"], ["r2", "r4"], ["r5", "r6"], ["r7"]]

    # 300 tokens per image seen so far: three images fill the 1000-token context.
    queue.learn([("image", 300, 75), ("image", 120, 30)])
    for index in range(5):
        queue.put(_pending(10 + index, [f"i{index}"]))
    assert [call.request_id for call in queue.take_batch()] == ["r10", "r11", "r12"]
    assert [call.request_id for call in queue.take_batch()] == ["r13", "r14"]
    # A call alone is never held back by the prediction: the engine judges it.
    queue.put(_pending(20, ["j", "k", "l", "m"]))
    assert [call.request_id for call in queue.take_batch()] == ["r20"]


def test_an_encoders_engine_requests_join_no_calls_of_audio():
    """An encoder's engine request carries up to four calls' worth of images or video, and one
    call's worth of audio (epd.engine.ENCODER_CALLS_PER_REQUEST, measured in bench/); other
    engines take one prompt's limit."""
    from epd.engine import EngineConfig, EngineRole

    config = EngineConfig("model", EngineRole.ENCODER, max_images_per_prompt=8, max_videos_per_prompt=2, max_audios_per_prompt=3)
    assert config.engine_mm_per_prompt == {"image": 32, "video": 8, "audio": 3}
    for role in set(EngineRole) - {EngineRole.ENCODER}:
        assert EngineConfig("model", role).engine_mm_per_prompt == EngineConfig("model", role).mm_per_prompt == {"image": 8, "video": 2, "audio": 4}


async def test_more_items_than_one_prompt_takes_are_refused_naming_the_limit(family_stack):
    """The encoder's engine takes several calls' items in one request, so a call's own limit
    (--max-images-per-prompt, 8 by default) is the encoder's to check."""
    item = _encode_request(7).items[0]
    async with grpc.aio.insecure_channel(family_stack.encoder.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await encoder_pb2_grpc.EncoderServiceStub(channel).Encode(encoder_pb2.EncodeRequest(items=[item] * 9), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and violations(info.value) == ["items"], info.value.details()
    assert "9 image items; one prompt takes at most 8 (--max-images-per-prompt)" in info.value.details()


async def test_vllms_cpu_thread_count_warning_is_logged_once(family_stack):
    """epd.compat.vllm_cpu_thread_warning: vLLM's CPU worker warned twice per request with media
    (its renderer's thread-count context meets the worker's skip); the encoder says it once."""
    from epd.compat.vllm_cpu_thread_warning import MESSAGE

    async with grpc.aio.insecure_channel(family_stack.encoder.address) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        reply = await stub.Encode(_encode_request(8), timeout=60)
        await stub.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=[reply.items[0].embedding.nixl.lease_id]))
    assert family_stack.encoder.log_path.read_text().count(MESSAGE) == 1


async def test_calls_that_arrive_together_share_engine_requests(family_stack):
    """Encode calls that are ready while the engine is busy join one engine request: twelve at
    once take fewer than twelve, and each item gets the layout and the rows it gets alone
    (another call of the same pixels with other bytes, so that no cache answers it)."""
    from bench.workload import salt_media
    from devkit.media import synthetic_image
    from epd.telemetry import scrape

    images = [synthetic_image(112 + 28 * (seed % 3), 112, seed=seed, image_format="JPEG") for seed in range(12)]

    def request(index: int, salt: str) -> encoder_pb2.EncodeRequest:
        media = multimodal_pb2.Media(data=salt_media(images[index], "image/jpeg", salt), mime_type="image/jpeg")
        return encoder_pb2.EncodeRequest(request_id=f"{salt}-{index}", items=[multimodal_pb2.MediaItem(image=media)])

    async with grpc.aio.insecure_channel(family_stack.encoder.address) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        before = scrape(family_stack.encoder.metrics_port)
        together = await asyncio.gather(*(stub.Encode(request(index, "together"), timeout=60) for index in range(12)))
        after = scrape(family_stack.encoder.metrics_port)
        calls = after["epd_encoder_request_calls_sum"] - before.get("epd_encoder_request_calls_sum", 0.0)
        requests = after["epd_encoder_request_calls_count"] - before.get("epd_encoder_request_calls_count", 0.0)
        assert calls == 12 and requests < 12, (calls, requests)
        for index, joined in enumerate(together):
            alone = await stub.Encode(request(index, "alone"), timeout=60)
            (item,), (reference,) = joined.items, alone.items
            assert item.metadata.content_hash != reference.metadata.content_hash
            reference.metadata.content_hash = item.metadata.content_hash
            assert item.metadata == reference.metadata
            rows, width = item.metadata.embedding_shape
            assert torch.equal(*(read_published_rows(wire.embedding_location_from_wire(i.embedding), rows, width, torch.float32) for i in (item, reference))), index
            await stub.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=[item.embedding.nixl.lease_id, reference.embedding.nixl.lease_id]))


async def test_each_encode_phase_is_timed_once_per_call_or_engine_request(family_stack):
    """epd_encoder_phase_seconds: decode and queue once per call, render and engine once per
    engine request (calls that arrive together share one), so an operator can tell which phase
    an encoder is short of."""
    from bench.workload import salt_media
    from devkit.media import synthetic_image
    from epd.telemetry import scrape

    image = synthetic_image(112, 112, seed=21, image_format="JPEG")

    def request(index: int) -> encoder_pb2.EncodeRequest:
        media = multimodal_pb2.Media(data=salt_media(image, "image/jpeg", f"phases-{index}"), mime_type="image/jpeg")
        return encoder_pb2.EncodeRequest(request_id=f"phases-{index}", items=[multimodal_pb2.MediaItem(image=media)])

    def counts(samples: dict[str, float]) -> dict[str, float]:
        phases = {phase: samples.get(f"epd_encoder_phase_seconds_count{{phase={phase}}}", 0.0) for phase in ("decode", "queue", "render", "engine")}
        return phases | {"requests": samples.get("epd_encoder_request_calls_count", 0.0)}

    async with grpc.aio.insecure_channel(family_stack.encoder.address) as channel:
        stub = encoder_pb2_grpc.EncoderServiceStub(channel)
        before = counts(scrape(family_stack.encoder.metrics_port))
        replies = await asyncio.gather(*(stub.Encode(request(index), timeout=60) for index in range(5)))
        after = counts(scrape(family_stack.encoder.metrics_port))
        await stub.ReleaseEmbeddings(encoder_pb2.ReleaseEmbeddingsRequest(lease_ids=[reply.items[0].embedding.nixl.lease_id for reply in replies]))
    spent = {name: after[name] - before[name] for name in after}
    assert spent["decode"] == spent["queue"] == 5, spent
    assert 1 <= spent["requests"] == spent["render"] == spent["engine"] <= 5, spent

"""Deterministic request sets and open-loop load, measured the way ``vllm bench serve`` does.

A workload is generated from a seed, so every arm of a comparison replays the very same
requests in the very same order at the very same arrival times. Each pass gets its own
:func:`salted` copy: the same decoded media under new bytes, so no engine's caches (vLLM's encoder
cache is keyed by the item's content hash and outlives requests) can serve one pass from another.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import struct
import time
from collections.abc import Sequence

import grpc

from bench import compiled
from bench.common import summarize
from epd.client import chat_request
from epd.v1 import gateway_pb2

STAGES = ("encode", "prefill", "decode")


MODALITIES = ("image", "video", "audio")


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """Media-heavy chat requests of one modality, plus a question each:

    - image: camera-sized JPEGs, ``image_edge_px`` on each side;
    - video: MP4 clips at 10 fps, ``clip_seconds`` long, ``video_edge_px`` on each side;
    - audio: WAV clips at 16 kHz, ``clip_seconds`` long.
    """

    modality: str = "image"
    num_requests: int = 16
    items_per_request: tuple[int, int] = (2, 4)  # inclusive range
    image_edge_px: tuple[int, int] = (448, 1344)  # inclusive range, multiples of 28
    video_edge_px: tuple[int, int] = (224, 448)
    clip_seconds: tuple[float, float] = (1.0, 4.0)
    max_tokens: int = 16
    seed: int = 0


_QUESTIONS = {"image": "what do these pictures have in common?", "video": "what happens in these clips?", "audio": "what do you hear?"}


def _item(spec: WorkloadSpec, rng: random.Random, seed: int) -> tuple[bytes, str]:
    from devkit.media import sine_samples, synthetic_image, synthetic_video, wav_int16

    def edge(bounds: tuple[int, int]) -> int:
        return 28 * rng.randint(bounds[0] // 28, bounds[1] // 28)

    if spec.modality == "image":
        return synthetic_image(edge(spec.image_edge_px), edge(spec.image_edge_px), seed=seed, image_format="JPEG"), "image/jpeg"
    seconds = round(rng.uniform(*spec.clip_seconds), 2)
    if spec.modality == "video":
        return synthetic_video(edge(spec.video_edge_px), edge(spec.video_edge_px), max(2, int(seconds * 10)), fps=10.0, seed=seed), "video/mp4"
    return wav_int16(sine_samples(seconds, freq=rng.uniform(200.0, 2000.0), seed=seed), 16000), "audio/wav"


def build_requests(spec: WorkloadSpec) -> list[gateway_pb2.GenerateRequest]:
    if spec.modality not in MODALITIES:
        raise ValueError(f"unknown workload modality {spec.modality!r}; choose from {', '.join(MODALITIES)}")
    rng = random.Random(spec.seed)
    requests = []
    for index in range(spec.num_requests):
        parts: list = [_item(spec, rng, seed=spec.seed * 100_003 + index * 101 + k) for k in range(rng.randint(*spec.items_per_request))]
        parts.append(f"Request {index}: {_QUESTIONS[spec.modality]}")
        # min_tokens = max_tokens: every request decodes the same number of tokens in every arm.
        requests.append(chat_request(parts, max_tokens=spec.max_tokens, min_tokens=spec.max_tokens, request_id=f"bench-{spec.seed}-{index}"))
    return requests


def salted(requests: Sequence[gateway_pb2.GenerateRequest], salt: str) -> list[gateway_pb2.GenerateRequest]:
    """Copies of ``requests`` whose media bytes carry ``salt`` where decoders ignore it (a JPEG
    comment segment, a WAV ``JUNK`` chunk, an MP4 ``free`` box): the same pixels and samples, a
    different content hash, so caches keyed by it cannot serve one pass from another."""
    copies = []
    for request in requests:
        copy = gateway_pb2.GenerateRequest()
        copy.CopyFrom(request)
        for message in copy.messages:
            for part in message.parts:
                kind = part.WhichOneof("content")
                media = {"image": lambda p: p.image, "video": lambda p: p.video.file, "audio": lambda p: p.audio.file}.get(kind)
                if media is not None:
                    media(part).data = salt_media(media(part).data, media(part).mime_type, salt)
        copies.append(copy)
    return copies


def salt_media(data: bytes, mime_type: str, salt: str) -> bytes:
    """``data`` with ``salt`` in a place its decoder skips (see :func:`salted`)."""
    tag = salt.encode()
    if mime_type == "image/jpeg":
        if data[:2] != b"\xff\xd8":
            raise ValueError("not a JPEG")
        return data[:2] + b"\xff\xfe" + struct.pack(">H", len(tag) + 2) + tag + data[2:]  # COM segment after SOI
    if mime_type in ("audio/wav", "audio/x-wav"):
        if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
            raise ValueError("not a RIFF WAVE file")
        chunk = b"JUNK" + struct.pack("<I", len(tag)) + tag + b"\0" * (len(tag) % 2)
        body = data[8:] + chunk
        return b"RIFF" + struct.pack("<I", len(body)) + body
    if mime_type == "video/mp4":
        return data + struct.pack(">I", len(tag) + 8) + b"free" + tag  # a top-level free box
    raise ValueError(f"cannot salt {mime_type} media")


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Offsets in seconds of ``count`` arrivals at ``rate`` per second (inf: all at once)."""
    if rate == float("inf"):
        return [0.0] * count
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


@dataclasses.dataclass
class RequestRecord:
    """One request as the client saw it, plus the gateway's own stage timings."""

    ok: bool
    error: str = ""
    token_ids: tuple[int, ...] = ()
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: tuple[float, ...] = ()
    stages_s: dict[str, float] = dataclasses.field(default_factory=dict)  # as the gateway timed each stage call
    gateway_total_s: float = 0.0  # the gateway's own count, from the call's arrival to its last message
    resumed_after: tuple[int, ...] = ()  # where the gateway resumed the reply on other instances

    @property
    def stage_s(self) -> float:
        return sum(self.stages_s.values())


async def _send(stub, request) -> RequestRecord:
    sent = time.perf_counter()
    tokens: list[int] = []
    stamps: list[float] = []
    stages: dict[str, float] = {}
    gateway_total = 0.0
    resumed_after: tuple[int, ...] = ()
    try:
        async for response in stub.Generate(request, timeout=600):
            now = time.perf_counter()
            if response.HasField("delta"):
                tokens += response.delta.token_ids
                stamps.append(now)
            else:
                t = response.finished.timings
                stages = {name: getattr(t, name).ToNanoseconds() / 1e9 for name in STAGES}
                gateway_total = t.total.ToNanoseconds() / 1e9
                resumed_after = tuple(response.finished.resumed_after_tokens)
    except grpc.aio.AioRpcError as exc:
        return RequestRecord(False, f"{exc.code().name}: {exc.details()}")
    done = time.perf_counter()
    if not stamps:
        return RequestRecord(False, "no tokens")
    itl = tuple(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    return RequestRecord(True, "", tuple(tokens), stamps[0] - sent, done - sent, itl, stages, gateway_total, resumed_after)


async def run_load(address: str, requests: Sequence[gateway_pb2.GenerateRequest], rate: float, seed: int, max_concurrency: int | None = None) -> dict:
    """Sends the requests open-loop at Poisson ``rate`` (inf: all at once), at most
    ``max_concurrency`` in flight, and reports ``vllm bench serve``-style metrics plus the
    per-request outputs and the gateway's overhead. Latencies count from the send, so time
    spent waiting for a concurrency slot is not in them.

    The client is compiled (``bench/go_stages -role load``): a grpc.aio client spent about 3 %
    of each request's latency here in Python, sending media and reading the stream, and that
    share fell on the server under test (the gateway's overhead counted it)."""
    offsets = poisson_arrivals(len(requests), rate, seed)
    # All at once means in order (a workload's order is part of it).
    sent = await asyncio.to_thread(
        compiled.run_load, address, [r.SerializeToString() for r in requests], None if rate == float("inf") else offsets, max_concurrency
    )
    records = [RequestRecord(**{**record, "token_ids": tuple(record["token_ids"] or ()), "itl_s": tuple(record["itl_s"] or ())}) for record in sent]
    duration = max(r.e2el_s + o for r, o in zip(records, offsets, strict=True) if r.ok) if any(r.ok for r in records) else float("nan")
    ok = [r for r in records if r.ok]
    output_tokens = sum(len(r.token_ids) for r in ok)
    tpot = [(r.e2el_s - r.ttft_s) / (len(r.token_ids) - 1) for r in ok if len(r.token_ids) > 1]
    return {
        "rate": "inf" if rate == float("inf") else rate,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if not r.ok}),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "ttft_ms": _ms(summarize([r.ttft_s for r in ok])),
        "tpot_ms": _ms(summarize(tpot)),
        "itl_ms": _ms(summarize([x for r in ok for x in r.itl_s])),
        "e2el_ms": _ms(summarize([r.e2el_s for r in ok])),
        "gateway_overhead_ms": _ms(summarize([r.e2el_s - r.stage_s for r in ok])),
        # Of that, what the gateway counted inside itself; the rest is the hop from the client
        # (sending it the media) and the client's own reading.
        "gateway_own_ms": _ms(summarize([r.gateway_total_s - r.stage_s for r in ok])),
        "stage_ms": {name: _ms(summarize([r.stages_s[name] for r in ok])) for name in STAGES},
        "outputs": [list(r.token_ids) for r in records],
        "ttft_s_each": [r.ttft_s if r.ok else None for r in records],  # in request order
    }


def _ms(summary: dict) -> dict:
    return {k: (v * 1000 if k != "count" else v) for k, v in summary.items()}


@dataclasses.dataclass(frozen=True)
class Sent:
    """One request of a closed loop: which one, when it started and ended (perf_counter), how."""

    index: int
    started: float
    ended: float
    record: RequestRecord


async def closed_loop(stub, requests: Sequence[gateway_pb2.GenerateRequest], concurrency: int, log: list[Sent], *, until=None, total: int | None = None) -> None:
    """``concurrency`` workers each send the next request (cycling through ``requests``) as soon
    as their last one ends, until ``until()`` is true or ``total`` requests were sent; every
    request is appended to ``log`` when it ends."""
    counter = iter(range(total if total is not None else 1 << 62))

    async def worker() -> None:
        while until is None or not until():
            sequence = next(counter, None)
            if sequence is None:
                return
            started = time.perf_counter()
            record = await _send(stub, requests[sequence % len(requests)])
            log.append(Sent(sequence % len(requests), started, time.perf_counter(), record))

    await asyncio.gather(*(worker() for _ in range(concurrency)))

"""Tracing and metrics setup, in one place.

Traces: OpenTelemetry, with W3C ``traceparent`` carried in gRPC metadata, so a request is one
trace across gateway, encoder, prefill and decode: every handler runs in a SERVER span that
continues the caller's trace (:func:`server_span`, applied by ``epd.rpc.rpc_method``), and every
stage call carries the current span's context (:func:`trace_metadata`). Spans are exported over
OTLP when an endpoint is configured; otherwise they are still created (context still
propagates) and dropped.

Not the OTel gRPC interceptors: on server streams their context detaches in another Context
("Failed to detach context" on every streamed call), and wrapping every streamed message cost
the gateway milliseconds per request (``python -m bench --only gateway_overhead``).

Metrics: Prometheus, all named ``epd_*`` (no colons), latencies in vLLM's vocabulary: TTFT,
TPOT, ITL, E2EL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from opentelemetry import propagate, trace
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REQUESTS = Counter("epd_requests_total", "RPCs handled, by service, method and status code", ["service", "method", "code"])
STAGE_SECONDS = Histogram("epd_stage_seconds", "Time spent in each pipeline stage", ["stage"], buckets=_LATENCY_BUCKETS)
TTFT_SECONDS = Histogram("epd_ttft_seconds", "Time to first token, seen by the gateway", buckets=_LATENCY_BUCKETS)
TPOT_SECONDS = Histogram("epd_tpot_seconds", "Mean time per output token after the first, per request", buckets=_LATENCY_BUCKETS)
ITL_SECONDS = Histogram("epd_itl_seconds", "Inter-token latency between streamed deltas", buckets=_LATENCY_BUCKETS)
E2EL_SECONDS = Histogram("epd_e2el_seconds", "End-to-end request latency, seen by the gateway", buckets=_LATENCY_BUCKETS)
GATEWAY_OWN_SECONDS = Histogram(
    "epd_gateway_own_seconds",
    "Per request, the gateway's time outside its stage calls (parsing, hashing, rendering, routing, retry back-off)",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
)
IN_FLIGHT = Gauge("epd_requests_in_flight", "Requests being served", ["service"])
STAGE_INSTANCE_UP = Gauge(
    "epd_stage_instance_up", "1 while the gateway routes to a stage instance, 0 while it is down or ejected", ["stage", "address"]
)
STAGE_EJECTIONS = Counter("epd_stage_ejections_total", "Stage instances taken out of the gateway's rotation after a failed call", ["stage"])
RETRIES = Counter("epd_gateway_retries_total", "Requests retried on other instances after a stage failed before the first token", ["stage"])
RESUMES = Counter(
    "epd_gateway_resumes_total", "Streams resumed on other instances after a stage failed mid-reply (from the prompt and the tokens already sent)", ["stage"]
)
LOCAL_PREFILLS = Counter("epd_gateway_local_prefills_total", "E/P/D requests a decode instance prefilled itself, no prefill instance being live (--local-prefill-fallback)")
ENCODER_ITEMS = Counter("epd_encoder_items_total", "Media items encoded, by modality", ["modality"])
ENCODER_SECONDS = Histogram(
    "epd_encoder_seconds", "Encode call time (decode, vLLM processor and tower), per item, by modality", ["modality"], buckets=_LATENCY_BUCKETS
)
# Where an Encode call's time goes, so an operator can tell what an encoder is short of: "decode"
# (its media, per call), "queue" (decoded, waiting for an engine request: services.encoder.batching,
# per call), "render" (vLLM's processor on one engine request's items, and on a joint request that
# failed, after which each call goes alone), "engine" (that request in vLLM's engine: the
# scheduler, the tower, the arena write). Calls the encoder-output cache answers pass through none.
ENCODER_PHASE_SECONDS = Histogram(
    "epd_encoder_phase_seconds",
    "Encode time by phase: decode and queue per call, render (vLLM's processor) and engine (the tower) per engine request",
    ["phase"],
    buckets=_LATENCY_BUCKETS,
)
ENCODER_REQUEST_CALLS = Histogram(
    "epd_encoder_request_calls",
    "Encode calls per encoder engine request (concurrent calls share one; services.encoder.batching)",
    buckets=(1, 2, 4, 8, 16, 32),
)
# Read at scrape time from the EC connector's shared buffer (the engine process keeps them).
ARENA_LEASES = Gauge("epd_arena_leases", "Live embedding leases in the encoder's arena")
ARENA_FREE_SLOTS = Gauge("epd_arena_free_slots", "Arena slots not held by a lease")
ENCODER_BATCHES = Gauge("epd_encoder_batches", "Encoder engine steps that encoded items of the modality (cumulative)", ["modality"])
ENCODER_BATCH_ITEMS = Gauge("epd_encoder_batch_items", "Items those steps encoded, across requests (cumulative)", ["modality"])
RECEIVE_ITEMS = Gauge("epd_receive_buffer_items", "Encoder outputs held in this engine's receive buffer")
RECEIVE_FREE_PAGES = Gauge("epd_receive_buffer_free_pages", "Free pages of this engine's embedding receive buffer")
EMBEDDING_LOAD_FAILURES = Gauge("epd_embedding_load_failures", "Embedding loads that failed since the engine started")
ENCODER_CACHE_BYTES = Gauge("epd_encoder_cache_bytes", "Arena bytes held by published encoder outputs kept only for reuse (no lease holds them)")
EMBEDDING_BYTES_LOADED = Gauge("epd_embedding_bytes_loaded", "Embedding bytes loaded into this engine since it started, by transport", ["transport"])


_ENCODER_CACHE_COUNTERS = {
    "cache_hits": "Items whose encoder output the arena already held (published, or being written) or the shared tier had: the tower did not run for them",
    "cache_misses": "Items that needed a tower run",
    "cache_evictions": "Cached encoder outputs dropped for room or over --encoder-cache-bytes",
    "cache_shared_hits": "Hits served from the shared tier (another encoder's output, read into this arena)",
    "cache_shared_puts": "Encoder outputs of this encoder the shared tier took",
}


class EncoderCacheCollector:
    """``epd_encoder_cache_{hits,misses,evictions,shared_hits,shared_puts}_total``, read at scrape time from the arena's
    shared counters (the engine process counts them; a Counter cannot be set from outside)."""

    def __init__(self, read: dict[str, Callable[[], int]]) -> None:
        self._read = read

    def collect(self):
        for name, documentation in _ENCODER_CACHE_COUNTERS.items():
            family = CounterMetricFamily(f"epd_encoder_{name}", documentation)
            family.add_metric([], self._read[name]())
            yield family

    @classmethod
    def register(cls, read: dict[str, Callable[[], int]]) -> None:
        REGISTRY.register(cls(read))


def configure_tracing(service_name: str, otlp_endpoint: str | None) -> None:
    """Installs the global tracer provider for this process, when there is an endpoint to export
    to. Without one, OpenTelemetry's default no-op tracer stays: it records nothing, yet still
    carries the caller's trace context on to the next hop, so a trace stays whole through a
    service that does not export."""
    if not otlp_endpoint:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)))
    logger.info("exporting traces to %s", otlp_endpoint)
    trace.set_tracer_provider(provider)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def server_span(full_method: str, invocation_metadata) -> trace.Span:
    """The SERVER span of one RPC (``/package.Service/Method``), a child of the caller's span
    when its metadata carries one. Started, not made current: the caller makes it current
    (``trace.use_span``) around each step of the handler and ends it."""
    parent = propagate.extract({key: value for key, value in invocation_metadata or ()})
    return trace.get_tracer(__name__).start_span(full_method, context=parent, kind=trace.SpanKind.SERVER)


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the current span's context to the next hop."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def start_metrics_server(port: int | None, host: str) -> int | None:
    """Serves /metrics over HTTP; returns the bound port (None when disabled)."""
    if port is None:
        return None
    from prometheus_client import start_http_server

    server, _ = start_http_server(port, addr=host)
    return server.server_port


def scrape(metrics_port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """A service's Prometheus samples, by name with labels dropped (samples summed), and by
    ``name{label=value,...}`` too. For tests, benchmarks and quick looks; production scrapes
    with Prometheus itself."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=5).read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
            if sample.labels:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples

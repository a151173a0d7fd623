"""The consumer half of the EPD EC connector, beside vLLM's scheduler (prefill, or E+PD decode).

A request arrives with metadata-only items plus, in its ``ec_transfer_params``, where each
item's encoder output was published. Before vLLM may schedule the request, every item must be
in this engine's receive buffer: the first time the request is seen, each item not already here
gets pages of the buffer and a READ (all of one producer's items in one batched READ); the
request waits in vLLM's queue until they land. A request whose items cannot be had (malformed
handle, unreachable producer, expired lease, a slot that no longer holds the promised item) is
reported to vLLM as unavailable and fails alone, before anything runs; the connector's desk
(``connector_desk``) tells the service why, since vLLM reports only that it failed.

Loaded items stay in the buffer while any live request refers to them or vLLM's encoder cache
holds them: the worker hands vLLM views of the buffer, never copies (see ``ec_connector``).
Items are keyed by content hash, so a second request for the same item reuses the loaded rows
and only releases its own, unread lease.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from epd.domain import EmbeddingLocation, InlineEmbedding, NixlLocation
from epd.transport.connector.ec_params import ExpectedItem, expected_from_params
from epd.transport.desk import EMBEDDING_REFUSED, open_desk
from epd.transport.memory.arena import SharedCounters
from epd.transport.memory.shared_buffer import SharedBuffer
from epd.transport.memory.slot_header import DTYPES, HEADER_BYTES, SlotHeader, header_fields, ready_fields, slot_bytes
from epd.transport.memory.slots import PAGE_BYTES, SlotAllocator
from epd.transport.wire.base import Read, Reader

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from epd.transport.connector.ec_config import ConnectorConfig

logger = logging.getLogger(__name__)

# A request that waits this long for pages while vLLM's encoder cache pins others is worth a loud
# log line: the buffer is probably smaller than what that cache may hold.
_STALL_REPORT_S = 5.0
RECEIVE_COUNTERS = ("items", "free_pages", "num_pages", "failed_loads", "nixl_bytes", "inline_bytes")


@dataclasses.dataclass(frozen=True)
class Install:
    """Give vLLM's encoder cache a view of rows at ``offset`` for ``mm_hash``."""

    mm_hash: str
    offset: int  # of the rows (the header is in front of them)
    rows: int
    width: int
    dtype: str


@dataclasses.dataclass
class _Item:
    expected: ExpectedItem
    first_page: int | None = None
    num_pages: int = 0
    state: str = "waiting"  # waiting (for pages) -> loading -> ready | failed
    error: str = ""
    requests: set[str] = dataclasses.field(default_factory=set)
    in_encoder_cache: bool = False

    @property
    def offset(self) -> int:
        assert self.first_page is not None
        return SharedCounters.BYTES + self.first_page * PAGE_BYTES


@dataclasses.dataclass
class _RequestState:
    items: list[str]
    satisfied: bool = False


class ConsumerScheduler:
    def __init__(self, config: ConnectorConfig) -> None:
        self._config = config
        self._buffer = SharedBuffer.create(config.buffer_name("receive"), config.buffer_bytes)
        self._view = memoryview(self._buffer.tensor.numpy())
        self._pages = SlotAllocator((config.buffer_bytes - SharedCounters.BYTES) // PAGE_BYTES)
        self.counters = SharedCounters(self._buffer.tensor, RECEIVE_COUNTERS)
        self.counters.set("num_pages", self._pages.num_slots)
        self._readers: dict[type, Reader] = {}  # by location kind, made on first use: inline-only hosts need no NIXL
        self._items: dict[str, _Item] = {}
        self._requests: dict[str, _RequestState] = {}
        self._waiting: dict[str, None] = {}  # ids of requests with items still waiting for pages, oldest first
        self._unavailable: set[str] = set()
        self._desk = open_desk(config.buffer_name("desk"))  # tells the service why a request failed
        self._installs: list[Install] = []
        self._freeing: list[tuple[int, int]] = []  # freed one step late: a worker may still read them
        self._stalled_since: float | None = None
        self._update_counters()
        logger.info("EPD EC consumer: receive buffer of %d MiB, shared buffer %s", config.buffer_bytes >> 20, self._buffer.path)

    # ---- vLLM scheduler hooks -----------------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """True once every item of the request is here; starts what is missing.

        A request with no handles whose items all lie in tokens it has computed needs nothing:
        a decode engine's request with a KV handoff, whose prompt KV came from the prefill."""
        state = self._requests.get(request.request_id)
        if state is None:
            if request.ec_transfer_params is None and all(f.mm_position.offset + f.mm_position.length <= num_computed_tokens for f in request.mm_features):
                return True
            state = self._admit(request)
        if state is None or request.request_id in self._unavailable:
            return False
        if state.satisfied:
            return True
        self._progress()
        items = [self._items[h] for h in state.items]
        if any(item.state == "failed" for item in items):
            self._mark_unavailable(request.request_id, next(i.error for i in items if i.state == "failed"))
            return False
        state.satisfied = all(item.state == "ready" for item in items)
        return state.satisfied

    def has_cache_item(self, mm_hash: str) -> bool:
        item = self._items.get(mm_hash)
        return item is not None and item.state == "ready"

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        item = self._items.get(mm_hash)
        if item is None or item.state != "ready":
            return
        item.in_encoder_cache = True
        rows = item.expected
        self._installs.append(Install(mm_hash, item.offset + HEADER_BYTES, rows.rows, rows.width, rows.dtype))

    def build_installs(self, scheduler_output: SchedulerOutput) -> list[Install]:
        for first_page, num_pages in self._freeing:
            self._pages.free(first_page, num_pages)
        self._freeing.clear()
        for mm_hash in scheduler_output.free_encoder_mm_hashes:
            item = self._items.get(mm_hash)
            if item is not None:
                item.in_encoder_cache = False
                self._maybe_drop(mm_hash, item)
        self._update_counters()
        installs, self._installs = self._installs, []
        return installs

    def request_finished(self, request: Request) -> None:
        state = self._requests.pop(request.request_id, None)
        self._waiting.pop(request.request_id, None)
        self._unavailable.discard(request.request_id)
        for mm_hash in state.items if state else ():
            item = self._items.get(mm_hash)
            if item is not None:
                item.requests.discard(request.request_id)
                self._maybe_drop(mm_hash, item)

    def take_unavailable_requests(self) -> set[str]:
        unavailable = {r for r in self._unavailable if r in self._requests}
        self._unavailable.clear()
        return unavailable

    def close(self) -> None:
        self._desk.release()
        for reader in self._readers.values():
            reader.close()
        self._buffer.close()

    # ---- internals ----------------------------------------------------------------------

    def _admit(self, request: Request) -> _RequestState | None:
        """Records a new request and starts loading its items; None if it cannot be served."""
        request_id = request.request_id
        try:
            expected = self._handles(request)
        except ValueError as exc:
            self._requests[request_id] = _RequestState([])  # remembered, so it is refused only once
            self._mark_unavailable(request_id, str(exc))
            return None
        hashes = list(dict.fromkeys(f.identifier for f in request.mm_features))
        state = self._requests[request_id] = _RequestState(hashes)
        self._waiting[request_id] = None
        for mm_hash in hashes:
            item = self._items.get(mm_hash)
            if item is not None and item.state == "failed":
                # Retry with this request's handle; the requests that saw it fail are told so.
                self._discard(item)
                item = self._items[mm_hash] = _Item(expected[mm_hash], requests=item.requests)
            elif item is None:
                item = self._items[mm_hash] = _Item(expected[mm_hash])
            elif item.expected.location != expected[mm_hash].location:
                self._release_unread(expected[mm_hash])  # the rows are here already
            item.requests.add(request_id)
        return state

    @staticmethod
    def _handles(request: Request) -> dict[str, ExpectedItem]:
        """The request's handles, checked against the layout vLLM gave its items.

        Raises:
            ValueError: a handle is missing, malformed, or disagrees with its item.
        """
        if request.ec_transfer_params is None:
            raise ValueError("the request carries no embedding handles (ec_transfer_params), and its items are not in its KV")
        expected = expected_from_params(request.ec_transfer_params)
        for index, feature in enumerate(request.mm_features):
            handle = expected.get(feature.identifier)
            if handle is None:
                raise ValueError(f"item {index} has no handle in ec_transfer_params")
            rows = feature.mm_position.get_num_embeds()
            if handle.rows != rows or handle.dtype not in DTYPES:
                raise ValueError(f"item {index} takes {rows} embedding rows; its handle promises {handle.rows} of {handle.dtype}")
            payload = handle.rows * handle.width * DTYPES[handle.dtype].itemsize
            if isinstance(handle.location, InlineEmbedding) and len(handle.location.data) != payload:
                raise ValueError(f"item {index}'s inline embedding holds {len(handle.location.data)} bytes, not the {payload} its shape needs")
            if isinstance(handle.location, NixlLocation) and handle.location.nbytes != HEADER_BYTES + payload:
                # The READ lands in pages sized from the shape: a larger location would overrun them.
                raise ValueError(f"item {index}'s location holds {handle.location.nbytes} bytes, not the {HEADER_BYTES + payload} its shape needs")
        return expected

    def _progress(self) -> None:
        """Starts loads for waiting requests, oldest first, and collects finished NIXL reads.

        A request gets pages for all its missing items at once or for none, and a request
        that does not fit stops the ones behind it: two requests each holding half of what
        they need would otherwise wait for each other forever.
        """
        for request_id in list(self._waiting):
            state = self._requests.get(request_id)
            waiting = [(h, self._items[h]) for h in state.items if self._items[h].state == "waiting"] if state else []
            if waiting and not self._allocate(waiting):
                self._report_stall()
                break
            self._stalled_since = None
            del self._waiting[request_id]
            for mm_hash, item in waiting:
                if item.state == "waiting":  # else it failed: it can never fit
                    item.state = "loading"
                    self._reader(item.expected.location).submit([Read(mm_hash, item.expected.location, item.offset)])
        for reader in self._readers.values():
            if not reader.busy:
                continue
            for mm_hash, error in reader.poll():
                item = self._items.get(mm_hash)
                if item is not None and item.state == "loading":
                    self._check_loaded(mm_hash, item, error)
                    self._maybe_drop(mm_hash, item)

    def _allocate(self, items: list[tuple[str, _Item]]) -> bool:
        """Pages for every item, or (returning False) for none of them."""
        taken = []
        for _, item in items:
            expected = item.expected
            nbytes = slot_bytes(expected.rows, expected.width, expected.dtype)
            num_pages = -(-nbytes // PAGE_BYTES)
            if num_pages > self._pages.num_slots:
                self._fail(item, f"{nbytes} bytes can never fit the {self._config.buffer_bytes}-byte receive buffer")
                continue
            first_page = self._pages.alloc(num_pages)
            if first_page is None:
                for taken_item in taken:
                    self._pages.free(taken_item.first_page, taken_item.num_pages)
                    taken_item.first_page, taken_item.num_pages = None, 0
                return False
            item.first_page, item.num_pages = first_page, num_pages
            taken.append(item)
        return True

    def _check_loaded(self, mm_hash: str, item: _Item, error: str | None) -> None:
        """A read ended: over NIXL, the slot header must show the promised item, fully written,
        and name the item it will be cached as (the encoder vouches for the content hash)."""
        expected = item.expected
        if error is None and isinstance(expected.location, NixlLocation):
            promised = ready_fields(expected.dtype, expected.location.slot_generation, expected.rows, expected.width, mm_hash)
            found = header_fields(self._view, item.offset)
            if found[:-1] == promised[:-1] and found != promised:
                # The very fill the handle was issued for, of another item: a caller's genuine
                # handle sent under this content hash (no slot turnover produces that).
                error = f"{EMBEDDING_REFUSED}: the encoder wrote lease {expected.location.lease_id} for another item than {mm_hash[:16]}..."
            elif found != promised:
                error = (
                    f"the producer's slot does not hold item {mm_hash[:16]}... of lease {expected.location.lease_id} as promised "
                    f"({self._describe_slot(mm_hash, item.offset)})"
                )
        if error is None:
            item.state = "ready"
            if isinstance(expected.location, NixlLocation):
                self._add("nixl_bytes", expected.location.nbytes)
            else:
                self._add("inline_bytes", len(expected.location.data))
        else:
            self._fail(item, error)

    def _report_stall(self) -> None:
        now = time.monotonic()
        if self._stalled_since is None:
            self._stalled_since = now
        elif now - self._stalled_since > _STALL_REPORT_S:
            pinned = sum(i.num_pages for i in self._items.values() if i.in_encoder_cache and not i.requests) * PAGE_BYTES
            logger.error(
                "EPD EC consumer: requests have waited %.0f s for receive-buffer pages; %d bytes are held only by vLLM's encoder "
                "cache, which frees them when it needs room itself. Raise --embedding-buffer-bytes above that cache's size.",
                now - self._stalled_since,
                pinned,
            )
            self._stalled_since = now  # once per period, not on every scheduler step

    def _describe_slot(self, mm_hash: str, offset: int) -> str:
        try:
            header = SlotHeader.unpack_from(self._buffer.tensor, offset)
        except ValueError as exc:
            return f"found no item: {exc}"
        named = "that item" if header.names(mm_hash) else "another item (its encoder never vouched for this content hash)"
        return f"found {header.status.name} generation {header.generation}, {header.rows}x{header.width} {header.dtype}, naming {named}"

    def _fail(self, item: _Item, error: str) -> None:
        logger.warning("EPD EC consumer: loading an item failed: %s", error)
        item.state, item.error = "failed", error
        self._add("failed_loads", 1)

    def _add(self, counter: str, amount: int) -> None:
        self.counters.set(counter, self.counters.get(counter) + amount)

    def _mark_unavailable(self, request_id: str, reason: str) -> None:
        logger.warning("EPD EC consumer: request %s cannot get its encoder outputs: %s", request_id, reason)
        self._unavailable.add(request_id)
        self._desk.failures.record(request_id, f"its encoder outputs could not be had: {reason}")

    def _maybe_drop(self, mm_hash: str, item: _Item) -> None:
        if item.requests or item.in_encoder_cache or item.state == "loading":
            return  # a loading item's pages are the READ's target until it ends
        del self._items[mm_hash]
        self._discard(item)

    def _discard(self, item: _Item) -> None:
        if item.first_page is not None:
            self._freeing.append((item.first_page, item.num_pages))
            item.first_page = None

    def _release_unread(self, expected: ExpectedItem) -> None:
        self._reader(expected.location).release(expected.location)

    def _reader(self, location: EmbeddingLocation) -> Reader:
        kind = type(location)
        if kind not in self._readers:
            if kind is InlineEmbedding:
                from epd.transport.wire.inline import InlineReader

                self._readers[kind] = InlineReader(self._buffer.tensor)
            else:
                from epd.transport.wire.nixl import NixlReader

                self._readers[kind] = NixlReader(
                    self._buffer.tensor,
                    agent_name=self._config.agent_name,
                    bind_host=self._config.listen_host,
                    timeout_s=self._config.read_timeout_s,
                    channel_credentials=self._config.channel_credentials(),
                )
        return self._readers[kind]

    def _update_counters(self) -> None:
        self.counters.set("items", len(self._items))
        self.counters.set("free_pages", self._pages.free_slots)

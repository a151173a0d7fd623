"""EPD's EC connector for vLLM: encoder outputs from an encoder-only engine into the encoder
cache of a prefill (or E+PD) engine, over NIXL or inline.

vLLM loads this module by ``ec_connector_module_path`` in the scheduler process and in every
worker. The scheduler side does all the work that can fail or wait: leasing arena slots and
publishing (producer), or resolving handles and running the READs (consumer), asynchronously,
before vLLM schedules the request. The worker side only moves bytes between vLLM's encoder cache
and a shared-memory buffer that both sides map (:mod:`epd.transport.memory.shared_buffer`): a producer
worker copies each encoder output into its slot; a consumer worker gives the encoder cache views
of the rows that landed, without a copy.

Configured through ``ec_connector_extra_config`` (see :class:`ConnectorConfig`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorMetadata, ECConnectorRole

from epd.compat import install_vllm_fixes
from epd.transport.connector.ec_config import ConnectorConfig
from epd.transport.connector.ec_consumer import ConsumerScheduler, Install
from epd.transport.connector.ec_producer import ProducerScheduler, Restore, Save
from epd.transport.memory.shared_buffer import SharedBuffer
from epd.transport.memory.slot_header import DTYPES, HEADER_BYTES, SlotHeader, SlotStatus, item_digest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# This module is what vLLM imports in its engine processes; the producer's published fields, the
# consumer's parsing and the tower's caches need vLLM's fixes there too.
install_vllm_fixes()


class _ShardSkipRecorder(logging.Handler):
    """Keeps vLLM's own account of the shards an encoder-only engine skipped.

    vLLM decides per model class which safetensors shards hold only language-model weights and
    logs ``mm-encoder-only: skipped %d/%d safetensors shard(s)``. The worker-side connector
    exists before the weights load, so it listens for that record; the scheduler side (the same
    process with one worker) publishes it for the encoder service to log and export.
    """

    skipped_of: tuple[int, int] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("mm-encoder-only: skipped") and len(record.args or ()) >= 2:
            _ShardSkipRecorder.skipped_of = (int(record.args[0]), int(record.args[1]))


@dataclasses.dataclass
class EpdConnectorMetadata(ECConnectorMetadata):
    """Scheduler -> worker, per step: slots to fill and cached outputs to restore (producer),
    views to install (consumer)."""

    saves: list[Save] = dataclasses.field(default_factory=list)
    restores: list[Restore] = dataclasses.field(default_factory=list)
    installs: list[Install] = dataclasses.field(default_factory=list)


class EpdECConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        if self.is_producer and self.is_consumer:
            raise ValueError("EpdECConnector is either a producer or a consumer, not both (ec_both)")
        config = ConnectorConfig.from_vllm(vllm_config)
        self._producer: ProducerScheduler | None = None
        self._consumer: ConsumerScheduler | None = None
        self._worker: _WorkerSide | None = None
        if role == ECConnectorRole.SCHEDULER:
            if self.is_producer:
                self._producer = ProducerScheduler(vllm_config, config)
                self._producer.record_shards(_shards_read(vllm_config))
            else:
                self._consumer = ConsumerScheduler(config)
        else:
            device = torch.device(vllm_config.ec_transfer_config.ec_buffer_device or "cpu")
            self._worker = _WorkerSide(config.buffer_name("arena" if self.is_producer else "receive"), device)
            if self.is_producer:
                logging.getLogger("vllm.model_executor.model_loader.weight_utils").addHandler(_ShardSkipRecorder())

    # ---- scheduler side -----------------------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if self._producer is not None:
            return self._producer.ensure_cache_available(request)
        return self._consumer.ensure_cache_available(request, num_computed_tokens)

    def has_cache_item(self, identifier: str) -> bool:
        return (self._producer or self._consumer).has_cache_item(identifier)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        (self._producer or self._consumer).update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        if self._producer is not None:
            return EpdConnectorMetadata(saves=self._producer.saves_for(scheduler_output), restores=self._producer.take_restores())
        return EpdConnectorMetadata(installs=self._consumer.build_installs(scheduler_output))

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self._producer is not None:
            return False, self._producer.request_finished(request)
        self._consumer.request_finished(request)
        return False, None

    def take_unavailable_requests(self) -> set[str]:
        return (self._producer or self._consumer).take_unavailable_requests()

    # ---- worker side --------------------------------------------------------------------

    def start_save_caches(self, encoder_cache: dict[str, torch.Tensor] | None = None, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, EpdConnectorMetadata) and self._worker is not None
        if encoder_cache is not None:
            self._worker.restore(metadata.restores, encoder_cache)
        self._worker.start_saves(metadata.saves, encoder_cache or {})

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        if self._worker is not None and self.is_producer:
            self._worker.save(encoder_cache, mm_hash)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, EpdConnectorMetadata) and self._worker is not None
        self._worker.install(metadata.installs, encoder_cache)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is not None:
            self._worker.forget(finished_req_ids)
        return None, None

    def shutdown(self) -> None:
        for part in (self._producer, self._consumer):
            if part is not None:
                part.close()


class _WorkerSide:
    """Moves bytes between vLLM's encoder cache and the shared buffer; decides nothing."""

    def __init__(self, buffer_name: str, device: torch.device) -> None:
        self._buffer_name = buffer_name
        self._device = device
        self._buffer: SharedBuffer | None = None  # the scheduler side creates it after the workers start
        self._pending: dict[str, list[Save]] = {}  # this step's saves whose output is not computed yet
        self._written: dict[str, set[int]] = {}  # request id -> generations already filled

    @property
    def buffer(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = SharedBuffer.attach(self._buffer_name)
        return self._buffer.tensor

    def start_saves(self, saves: list[Save], encoder_cache: dict[str, torch.Tensor]) -> None:
        """Fills the slots whose outputs are cached already; the rest as they are computed."""
        self._pending = {}
        for save in saves:
            if save.generation in self._written.get(save.request_id, ()):
                continue
            if save.mm_hash in encoder_cache:
                self._write(save, encoder_cache[save.mm_hash])
            else:
                self._pending.setdefault(save.mm_hash, []).append(save)

    def restore(self, restores: list[Restore], encoder_cache: dict[str, torch.Tensor]) -> None:
        """Copies (the slot may be evicted later; vLLM's entry must outlive it) cached outputs
        into the encoder cache, where vLLM now counts them as present."""
        for restore in restores:
            if restore.mm_hash not in encoder_cache:
                start = restore.offset + HEADER_BYTES
                nbytes = restore.rows * restore.width * DTYPES[restore.dtype].itemsize
                rows = self.buffer[start : start + nbytes].view(DTYPES[restore.dtype]).view(restore.rows, restore.width)
                encoder_cache[restore.mm_hash] = rows.to(self._device, copy=True)

    def save(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        for save in self._pending.pop(mm_hash, ()):
            self._write(save, encoder_cache[mm_hash])

    def _write(self, save: Save, output: torch.Tensor) -> None:
        buffer = self.buffer
        status = SlotStatus.FAILED
        if tuple(output.shape) == (save.rows, save.width) and output.dtype == DTYPES[save.dtype]:
            start = save.offset + HEADER_BYTES
            rows = output.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[start : start + rows.numel()].copy_(rows)
            status = SlotStatus.READY
        else:
            logger.error(
                "encoder output for %s is %s %s; its slot was sized for [%d, %d] %s",
                save.mm_hash,
                list(output.shape),
                output.dtype,
                save.rows,
                save.width,
                save.dtype,
            )
        SlotHeader(status, save.dtype, save.generation, save.rows, save.width, item_digest(save.mm_hash)).pack_into(buffer, save.offset)
        self._written.setdefault(save.request_id, set()).add(save.generation)

    def install(self, installs: list[Install], encoder_cache: dict[str, torch.Tensor]) -> None:
        for install in installs:
            if install.mm_hash in encoder_cache:
                continue
            dtype = DTYPES[install.dtype]
            nbytes = install.rows * install.width * dtype.itemsize
            view = self.buffer[install.offset : install.offset + nbytes].view(dtype).view(install.rows, install.width)
            encoder_cache[install.mm_hash] = view if self._device.type == "cpu" else view.to(self._device)

    def forget(self, finished_req_ids: set[str]) -> None:
        for request_id in finished_req_ids:
            self._written.pop(request_id, None)


def _shards_read(vllm_config: VllmConfig) -> tuple[int, int] | None:
    """(read, total) weight shards of this engine, or None when its worker is another process."""
    if vllm_config.parallel_config.distributed_executor_backend != "uni":
        return None
    import pathlib

    if _ShardSkipRecorder.skipped_of is not None:
        skipped, total = _ShardSkipRecorder.skipped_of
        return total - skipped, total
    total = len(list(pathlib.Path(vllm_config.model_config.model).glob("*.safetensors")))
    return total, total  # vLLM skipped nothing

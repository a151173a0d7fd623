"""The EPD EC connector's configuration, carried in vLLM's ``ec_connector_extra_config``."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc
    from vllm.config import VllmConfig


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    """Everything the connector needs, carried in ``ec_connector_extra_config``."""

    engine_id: str
    transport: str = "nixl"  # "nixl", or "inline" (bytes in the request: benchmarks, hosts without NIXL)
    buffer_bytes: int = 64 * 1024 * 1024  # producer arena / consumer receive buffer
    slot_bytes: int = 64 * 1024  # producer arena slot
    lease_ttl_s: float = 60.0  # how long a published item waits for its consumer
    cache_bytes: int = 32 * 1024 * 1024  # producer: arena bytes kept as an encoder-output cache (0: off)
    # Producer: the shared tier of the encoder-output cache (a Mooncake master's host:port and
    # its metadata server's URL); empty: this encoder's arena only.
    shared_cache_master: str = ""
    shared_cache_metadata: str = ""
    listen_host: str = "127.0.0.1"  # the service's host: NIXL's UCX endpoints listen only there
    read_timeout_s: float = 10.0  # consumer: limit on one encoder's GetTransferMetadata or READ
    # Consumer: TLS for GetTransferMetadata calls to encoders (PEM file paths; all empty is
    # plaintext). Paths, not credential objects: this config travels in vLLM's engine config.
    tls_ca_file: str = ""
    tls_cert_file: str = ""  # with tls_key_file: the client certificate, where encoders require one
    tls_key_file: str = ""

    @property
    def agent_name(self) -> str:
        return f"epd-{self.engine_id}"

    def buffer_name(self, kind: str) -> str:
        return f"{self.engine_id}-{kind}"

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials for the consumer's calls to encoders; None for plaintext."""
        if not (self.tls_ca_file or self.tls_cert_file or self.tls_key_file):
            return None
        import grpc

        def read(path: str) -> bytes | None:
            return pathlib.Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(read(self.tls_ca_file), read(self.tls_key_file), read(self.tls_cert_file))

    def extra_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> ConnectorConfig:
        transfer = vllm_config.ec_transfer_config
        fields = {f.name for f in dataclasses.fields(cls)}
        extra = {k: v for k, v in transfer.ec_connector_extra_config.items() if k in fields}
        return cls(**{**extra, "engine_id": extra.get("engine_id") or transfer.engine_id})

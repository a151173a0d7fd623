"""Moving encoder outputs from an encoder engine into consumer engines' encoder caches.

The rest of EPD imports what it uses from here, and only from here; the sub-packages are the
transport's own:

- :mod:`epd.transport.connector`: the vLLM plugins, loaded by module path in every engine
  process: the EC connector (producer and consumer roles) and the KV connector;
- :mod:`epd.transport.memory`: the producer's memory: a shared buffer split into leased slots,
  each behind a header that names its item, and the encoder's claims on them;
- :mod:`epd.transport.wire`: how a consumer reaches them: NIXL one-sided READs (or inline bytes),
  locations with their tags, and the credentials that open them;
- :mod:`epd.transport.desk`: the engine core's desk, through which its service reaches the
  connector's cache and leases;
- :mod:`epd.transport.shared_tier`: the encoder-output cache's tier shared between encoders.

Names are resolved on first use (PEP 562): the gateway reads location checks from here without
loading torch, NIXL or vLLM, which the engines' modules import.
"""

from __future__ import annotations

import importlib
from typing import Any

# The vLLM plugins, as engines name them in their transfer configs.
EC_CONNECTOR_MODULE = "epd.transport.connector.ec_connector"
KV_CONNECTOR_MODULE = "epd.transport.connector.kv_connector"

_EXPORTS = {
    "ARENA_COUNTERS": "epd.transport.memory.arena",
    "SharedCounters": "epd.transport.memory.arena",
    "SharedBuffer": "epd.transport.memory.shared_buffer",
    "HEADER_BYTES": "epd.transport.memory.slot_header",
    "ClaimLedger": "epd.transport.memory.claims",
    "ConnectorConfig": "epd.transport.connector.ec_config",
    "ExpectedItem": "epd.transport.connector.ec_params",
    "expected_to_params": "epd.transport.connector.ec_params",
    "published_from_params": "epd.transport.connector.ec_params",
    "RECEIVE_COUNTERS": "epd.transport.connector.ec_consumer",
    "DESK_KEY": "epd.transport.connector.kv_connector",
    "ConnectorDeskClient": "epd.transport.desk",
    "CALLER_FAULTS": "epd.transport.desk",
    "configure_ucx": "epd.transport.wire.agent",
    "TransferCredentials": "epd.transport.wire.credentials",
    "LeaseReleaser": "epd.transport.wire.nixl",
    "location_problems": "epd.transport.wire.location",
}

__all__ = ["EC_CONNECTOR_MODULE", "KV_CONNECTOR_MODULE", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once resolved, a plain module attribute
    return value

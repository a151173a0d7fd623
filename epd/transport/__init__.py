"""Moving encoder outputs from an encoder engine into consumer engines' encoder caches.

- :mod:`epd.transport.ec_connector`: the vLLM EC connector (producer and consumer roles).
- :mod:`epd.transport.arena`: leased slots where a producer keeps published outputs.
- :mod:`epd.transport.nixl`: the NIXL publisher and reader; inline bytes need neither.
- :mod:`epd.transport.location`: a NIXL location's descriptors, tag and form checks (no NIXL).
- :mod:`epd.transport.ec_params`: the handle format carried in ``ec_transfer_params``.
"""

"""Decode service: KV over NIXL plus metadata in, tokens out; or, for E+PD, the whole generation."""

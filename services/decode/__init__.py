"""Decode service: KV over NIXL plus metadata in, tokens out; or, combined (E+PD), the whole generation."""

"""Workarounds for third-party packaging problems, each confined to the install path that needs it."""

"""EPD core: what the encoder, prefill, decode and gateway services share.

Kept import-light on purpose: the gateway and the CLI must not pay for torch or vLLM.
"""

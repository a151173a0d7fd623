"""Prefill service: embeddings over NIXL in, KV cache out (vLLM NixlConnector producer)."""

"""Encoder service: media bytes in, embeddings (in a NIXL arena) and metadata out."""

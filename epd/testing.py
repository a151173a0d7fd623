"""Deterministic synthetic media for the demo, tests and benchmarks."""

from __future__ import annotations

import io


def synthetic_image_png(width: int, height: int, *, seed: int) -> bytes:
    """A PNG with smooth gradients plus seeded noise, so different seeds encode differently."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), ((x + y) * 127 // max(width + height - 2, 1))], axis=-1)
    noise = rng.integers(0, 64, size=(height, width, 3))
    pixels = ((base + noise) % 256).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()

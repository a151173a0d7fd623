"""Image decoding (Pillow)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from epd.errors import DESCRIPTION_BYTES, client_text
from epd.media import MediaError

if TYPE_CHECKING:
    from PIL import Image


def decode_image(data: bytes, *, max_pixels: int, field: str = "image.data") -> Image.Image:
    """Decodes image bytes fully, so that truncated files fail here and not in the tower.

    Raises:
        MediaError: the bytes are not a decodable image, or it has too many pixels.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        # Checked before the pixels are decoded: a decompression bomb is refused cheaply.
        if image.width * image.height > max_pixels:
            raise MediaError(field, f"is {image.width}x{image.height} pixels, over the limit of {max_pixels}")
        image.load()
    except UnidentifiedImageError as exc:
        # Pillow's own words name the BytesIO it was given ("cannot identify image file
        # <_io.BytesIO object at 0x...>"): a new text on every call, and nothing for a human.
        raise MediaError(field, "is not a decodable image (no image format recognized in its bytes)") from exc
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        if isinstance(exc, MediaError):
            raise
        raise MediaError(field, f"is not a decodable image ({client_text(str(exc), DESCRIPTION_BYTES)})") from exc
    return image.convert("RGB")

"""Image decoding: vLLM's own image loading, behind EPD's limits and error messages."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from epd.errors import DESCRIPTION_BYTES, client_text
from epd.media import MediaError

if TYPE_CHECKING:
    from PIL import Image
    from vllm.multimodal.media import MediaWithBytes


def decode_image(data: bytes, *, max_pixels: int, field: str = "image.data") -> MediaWithBytes[Image.Image]:
    """Decodes image bytes fully, so that truncated files fail here and not in the tower.

    The pixels are what ``vllm serve`` makes of the same bytes (vLLM's ``ImageMediaIO``): the
    formats it serves, EXIF orientation applied, transparency composited on white, an RGB image
    kept as it is (not copied). Anything else would give the tower other pixels than vLLM's.

    Returned as the loader returns it, the image (``.media``; attributes reach it too) with the
    bytes it came from, which is how ``vllm serve`` hands it to vLLM's processor. Handed a bare
    PIL image instead, vLLM's parser normalizes its orientation once more, which copies every
    image (Pillow's ``exif_transpose`` copies even when it has nothing to turn): a fifth of
    the processor's time, and 6% of the encoder's images/s here (issue 32).

    Raises:
        MediaError: the bytes are not a decodable image, or it has too many pixels.
    """
    from PIL import Image, UnidentifiedImageError
    from vllm.multimodal.media.image import ImageMediaIO

    try:
        # Only the header is read here: a decompression bomb is refused before any pixel is decoded.
        with Image.open(io.BytesIO(data)) as header:
            if header.width * header.height > max_pixels:
                raise MediaError(field, f"is {header.width}x{header.height} pixels, over the limit of {max_pixels}")
        return ImageMediaIO().load_bytes(data)
    except MediaError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        cause = exc.__cause__ if isinstance(exc, ValueError) and exc.__cause__ is not None else exc  # vLLM wraps Pillow's error
        if isinstance(cause, UnidentifiedImageError):
            # Pillow's own words name the BytesIO it was given ("cannot identify image file
            # <_io.BytesIO object at 0x...>"): a new text on every call, and nothing for a human.
            raise MediaError(field, "is not a decodable image (no image format recognized in its bytes)") from exc
        raise MediaError(field, f"is not a decodable image ({client_text(str(cause), DESCRIPTION_BYTES)})") from exc

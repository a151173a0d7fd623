"""Which media formats each modality accepts. The gateway checks MIME types before any work;
the encoder is the only stage that decodes the bytes."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from epd.domain import Modality

if TYPE_CHECKING:
    from PIL import Image

SUPPORTED_MIME_TYPES: dict[Modality, frozenset[str]] = {
    Modality.IMAGE: frozenset({"image/png", "image/jpeg", "image/jpg", "image/webp", "image/bmp", "image/gif"}),
    Modality.VIDEO: frozenset(),
    Modality.AUDIO: frozenset(),
}


def mime_problem(modality: Modality, mime_type: str) -> str | None:
    """Returns why a MIME type is refused for a modality, or None when it is accepted."""
    accepted = SUPPORTED_MIME_TYPES[modality]
    if mime_type in accepted:
        return None
    if not accepted:
        return f"{modality.value} input is not implemented yet"
    return f"unsupported MIME type {mime_type!r} for {modality.value}; accepted: {', '.join(sorted(accepted))}"


def decode_image(data: bytes) -> Image.Image:
    """Decodes image bytes fully, so that truncated files fail here and not in the tower.

    Raises:
        ValueError: the bytes are not a decodable image.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise ValueError(f"not a decodable image ({exc})") from exc
    return image.convert("RGB")

"""Images in a request: OpenAI content parts and Ollama's ``images``, checked and decoded from
base64 into typed ImageInput values (docs/protocol.md#images). No I/O, and no pixel decoding
here: the image's format is told from its first bytes; its pixels are the vision adapter's.

A request may carry images two ways, as the clients users already have send them:

- ``message`` as a list of content parts (OpenAI's chat API): ``{"type": "text", "text": ...}``
  and ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``. Only
  ``data:`` URLs: the worker never fetches a URL (a request must not make it reach a host the
  client chose, inside the network it runs in).
- ``images``, a list of base64 strings (Ollama's chat API), placed before the message's text.

Every check runs before the image's bytes are decoded, and base64 is decoded strictly: the
payload's size bounds the work (max_request_bytes).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from ..config.models import VisionConfig

# The raster formats a vision processor reads, by the bytes every file of the format starts
# with (no SVG: a document, not an image; no TIFF or ICO: rarely sent, large parsers).
MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp", "image/bmp")
# "image/jpg" is not registered, but browsers and tools write it.
MEDIA_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg", "image/x-ms-bmp": "image/bmp"}
FORMATS = "JPEG, PNG, GIF, WebP or BMP"

Source = Literal["content_part", "images", "topic", "tool"]


@dataclass(frozen=True)
class ImageInput:
    """One image of a request, decoded from base64 and not yet from its format.

    ``offset``: where it stands in the request's text (``ChatRequest.message``), in characters:
    a content part's image stands between the text parts around it (they are joined with
    "\\n"); Ollama's ``images`` stand before the text (offset 0). ``index``: its place in the
    request, as error messages name it (``message.2``, ``images.0``, ``imageTopics.0``)."""

    data: bytes
    media_type: str  # one of MEDIA_TYPES, told from the bytes (a data URL's declared type is checked against it)
    source: Source
    index: str  # "message.2", "images.0": what an error about it names
    offset: int = 0
    topic: str | None = None  # source "topic": the MQTT topic it came from

    @functools.cached_property
    def sha256(self) -> str:
        """The content hash: the store's and the engine's identifier. Computed when first
        asked (10 ms for 3 MB): where the core asks off the event loop, it costs the loop nothing."""
        return hashlib.sha256(self.data).hexdigest()

    def __repr__(self) -> str:  # never the bytes (logs, test failures)
        return f"ImageInput({self.index}, {self.media_type}, {len(self.data)} bytes)"


@dataclass(frozen=True)
class ImageLimits:
    """What a request's images may be, from the configuration's [vision] section (the core
    builds it). ``max_request_bytes``: the largest payload of a request that carries images
    (max_payload_bytes stays the limit of every other payload); ``max_images``: images per
    request, the topics' included."""

    max_request_bytes: int
    max_images: int

    @classmethod
    def of(cls, vision: VisionConfig) -> ImageLimits:
        """The limits of the configuration's [vision] section."""
        return cls(max_request_bytes=vision.max_request_bytes, max_images=vision.max_images_per_request)


class ImageError(ValueError):
    """An image the request cannot carry; the message names it (``message.1``, ``images.0``)."""


class _Part(BaseModel):
    # OpenAI's names as they are (snake_case: "image_url"), types strict like every request's.
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ImageUrl(_Part):
    url: str = Field(description="A data: URL (data:image/png;base64,...); the worker never fetches http(s) URLs.")
    detail: Literal["auto", "low", "high"] | None = Field(
        None, description="Accepted for OpenAI compatibility; the worker's max_pixels applies."
    )


class ImageUrlPart(_Part):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]
CONTENT_PARTS: TypeAdapter[list[ContentPart]] = TypeAdapter(list[ContentPart])

_DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*),", re.ASCII)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


def sniff_media_type(data: bytes) -> str | None:
    """The image format the bytes start with; None when they start like none of MEDIA_TYPES."""
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[:2] == b"BM" and len(data) >= 26:
        return "image/bmp"
    return None


def decode_base64(text: str, where: str) -> bytes:
    """Standard base64 (RFC 4648, with its padding), strictly: anything else, whitespace
    included, is an ImageError, never bytes silently dropped."""
    if not text:
        raise ImageError(f"'{where}' is empty")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError):
        raise ImageError(f"'{where}' is not valid base64") from None


def image_from_bytes(data: bytes, source: Source, where: str, *, declared: str | None = None, **kw: Any) -> ImageInput:
    """Raw image bytes (decoded base64, an MQTT payload) as an ImageInput, if they start like
    an image of MEDIA_TYPES (and like ``declared``, a data URL's or a message's content type)."""
    if not data:
        raise ImageError(f"'{where}' is empty")
    media_type = sniff_media_type(data)
    if media_type is None:
        raise ImageError(f"'{where}' is not a {FORMATS} image")
    if declared is not None and MEDIA_ALIASES.get(declared, declared) != media_type:
        raise ImageError(f"'{where}' says {declared[:60]!r} but holds {media_type}")
    return ImageInput(data, media_type, source, where, **kw)


def parse_data_url(url: str, where: str, **kw: Any) -> ImageInput:
    """An image_url part's URL: ``data:image/<type>;base64,<data>`` of a MEDIA_TYPES type."""
    match = _DATA_URL.match(url)
    if match is None:
        scheme = _SCHEME.match(url)
        if scheme is not None and scheme.group().lower() in ("http:", "https:"):
            raise ImageError(
                f"'{where}' is an {scheme.group()[:-1].lower()} URL: images are sent as data: URLs "
                "(data:image/jpeg;base64,...); the worker never fetches a URL"
            )
        raise ImageError(f"'{where}' must be a data: URL (data:image/jpeg;base64,...); the worker never fetches a URL")
    declared = match.group("type").strip().lower()
    params = [p.strip().lower() for p in match.group("params").split(";") if p.strip()]
    if MEDIA_ALIASES.get(declared, declared) not in MEDIA_TYPES:
        raise ImageError(f"'{where}' is a data: URL of {declared[:60] or 'no type'!r}, not an image of type {FORMATS}")
    if "base64" not in params:
        raise ImageError(f"'{where}' must be base64 (data:{declared};base64,...)")
    data = decode_base64(url[match.end() :], where)
    return image_from_bytes(data, "content_part", where, declared=declared, **kw)


def parse_content_parts(value: Any) -> tuple[str, list[ImageInput]]:
    """``message`` given as content parts: the text parts joined with "\\n" (as vLLM joins
    them for a template that takes text), and the images with their offsets in it. Raises
    ImageError, or pydantic's ValidationError for a part of the wrong shape."""
    parts = CONTENT_PARTS.validate_python(value)
    if not parts:
        raise ImageError("'message' is an empty list of content parts")
    texts: list[str] = []
    images: list[ImageInput] = []
    length = 0
    for index, part in enumerate(parts):
        if isinstance(part, TextPart):
            length += (1 if texts else 0) + len(part.text)
            texts.append(part.text)
        else:
            where = f"message.{index}.image_url.url"
            images.append(parse_data_url(part.image_url.url, where, offset=length + (1 if texts else 0)))
    return "\n".join(texts), images


def parse_images(values: Sequence[str]) -> list[ImageInput]:
    """Ollama's ``images``: base64 strings, before the message's text. A data URL is taken too
    (what a client that also speaks OpenAI may send)."""
    images = []
    for index, value in enumerate(values):
        where = f"images.{index}"
        if value.startswith("data:"):
            image = parse_data_url(value, where)
            images.append(ImageInput(image.data, image.media_type, "images", where))
        else:
            images.append(image_from_bytes(decode_base64(value, where), "images", where))
    return images


def may_carry_images(payload: bytes) -> bool:
    """Whether a payload may hold images, without parsing it: only such a payload may be over
    max_payload_bytes (a text request over it is refused before its JSON is read)."""
    return b'"images"' in payload or b'"image_url"' in payload

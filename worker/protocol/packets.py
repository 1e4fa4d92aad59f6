"""Answers that fit the broker's Maximum Packet Size. No I/O.

A broker may announce a Maximum Packet Size in its CONNACK and disconnects a client that
sends a larger packet; paho ignores the limit and, after reconnecting, sends the same packet
again, forever. So the worker never publishes a packet over it: a reply is cut down to fit
(``finishReason: "truncated"``), or replaced by a ``too_large`` error when not even an empty
reply fits; stream deltas are split over several messages.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable

from pydantic import ValidationError

from .messages import ChatReply, ErrorBody, ErrorCode, ErrorReply

TRUNCATED = "truncated"


def longest_fitting_prefix(text: str, build: Callable[[str], bytes], limit: int) -> int:
    """The most characters of text whose payload ``build(text[:n])`` is at most limit bytes;
    -1 when not even ``build("")`` fits. Cutting a str by characters always cuts the UTF-8
    encoding on a character boundary; the encoded length grows with n, so a binary search
    finds it in log2(len(text)) encodings."""
    if len(build("")) > limit:
        return -1
    low, high = 0, len(text)
    while low < high:
        middle = (low + high + 1) // 2
        if len(build(text[:middle])) <= limit:
            low = middle
        else:
            high = middle - 1
    return low


def fit_answer(payload: bytes, limit: int | None) -> bytes | None:
    """The answer payload to publish within limit bytes (None: no limit): payload itself when
    it fits, else a truncated reply, else a too_large error, else None (nothing fits)."""
    if limit is None or len(payload) <= limit:
        return payload
    try:
        data = json.loads(payload)
    except ValueError:
        return None
    session_id, request_id = data.get("sessionId", ""), data.get("requestId")
    if "reply" in data:
        try:
            reply = ChatReply.model_validate(data)
        except ValidationError:
            return None

        def build(text: str) -> bytes:
            return reply.model_copy(update={"reply": text, "finish_reason": TRUNCATED}).to_json()

        kept = longest_fitting_prefix(reply.reply, build, limit)
        if kept >= 0:
            return build(reply.reply[:kept])
    error = ErrorReply(
        session_id=session_id,
        request_id=request_id,
        error=ErrorBody(
            code=ErrorCode.TOO_LARGE,
            message=f"the answer of {len(payload)} bytes does not fit the broker's maximum packet size",
        ),
    ).to_json()
    return error if len(error) <= limit else None


def split_to_fit(text: str, build: Callable[[int, str], bytes], first_seq: int, limit: int | None) -> list[bytes]:
    """Payloads ``build(seq, piece)`` for consecutive pieces of text, numbered from first_seq,
    each within limit bytes (one payload when it fits or there is no limit). Pieces that
    cannot fit at all (limit too small for even one character) are left out."""
    payloads: list[bytes] = []
    seq = first_seq
    while True:
        whole = build(seq, text)
        if limit is None or len(whole) <= limit:
            return [*payloads, whole]
        kept = longest_fitting_prefix(text, functools.partial(build, seq), limit)
        if kept <= 0:
            return payloads
        payloads.append(build(seq, text[:kept]))
        text = text[kept:]
        seq += 1

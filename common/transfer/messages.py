"""Wire messages of the KV transfer: control (ZMQ) and data-plane frame headers (msgspec).

Control messages travel as one msgpack frame each. Data-plane headers are framed as a
4-byte big-endian length followed by the msgpack header; a region's payload (raw page bytes)
follows its header on the tcp stream, or travels as its own tagged message over ucx.
"""

from __future__ import annotations

import struct
from typing import Annotated

import msgspec

from baton.common.state import Traceparent

MAX_CONTROL_BYTES = 64 << 20  # an init for a very long prompt at page_size 1 fits easily
MAX_HEADER_BYTES = 64 << 10  # a header is a few dozen bytes; a ucx batch, up to ~20 KiB
_LENGTH = struct.Struct(">I")
BackendName = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9_]{1,32}$")]


class KVInit(msgspec.Struct, tag="init", frozen=True):
    """D -> P: where to write the room's pages."""

    room: int
    token: str
    transfer_address: str  # D's data-plane address, in its backend's format
    dst_page_ids: list[int]  # D's pages for request pages [prefix_pages:]
    prefix_pages: int  # leading request pages D already holds
    page_bytes: int  # a layout mismatch between P and D fails the room, not the data
    checksum: bool  # D verifies a crc32 per region: P must attach one
    bell: int = -1  # D's doorbell slot for the room (see doorbell); -1: none
    traceparent: Traceparent | None = None  # D's traced request: its span (W3C)


class KVDone(msgspec.Struct, tag="done", frozen=True):
    """P -> D: every page is written (D checks); ``aux`` rides along (the first token).
    Sent early (``landed`` False) where P rings the room's doorbell once the writes landed:
    D then waits for the bell, or for ``KVLanded``."""

    room: int
    token: str
    pages: int
    aux: bytes | None = None
    # Written straight into D's memory (ipc), so D saw no region frames: the regions P
    # wrote, as (dst_offset, length, crc32 or None), for D to check and count.
    direct: list[tuple[int, int, int | None]] | None = None
    landed: bool = True
    traceparent: Traceparent | None = None  # P's traced request: its span (W3C)
    backend: BackendName | None = None  # what P wrote the pages through (None: no page)


class KVLanded(msgspec.Struct, tag="landed", frozen=True):
    """P -> D after an early final status: the writes landed (if the bell did not say so)."""

    room: int
    token: str


class KVAbort(msgspec.Struct, tag="abort", frozen=True):
    """Either way: the sending side failed or abandoned the room."""

    room: int
    token: str
    reason: str


class KVReleased(msgspec.Struct, tag="released", frozen=True):
    """P -> D after a room failed: P will never write into the room's pages again (D may
    reuse pages a one-sided backend could still have been writing)."""

    room: int
    token: str


class KVHeld(msgspec.Struct, tag="held", frozen=True):
    """Either way, every second: the live rooms this side holds with the receiving peer.
    A room the peer still holds is waiting, not lost: its deadline starts over."""

    token: str
    peer: str  # the sender's control address (rooms bound to another peer are ignored)
    rooms: list[int]


RoomMessage = KVInit | KVDone | KVLanded | KVAbort | KVReleased  # about one room
ControlMessage = RoomMessage | KVHeld


class DataHello(msgspec.Struct, tag="hello", frozen=True):
    """First frame of every data connection: who is writing, with which token."""

    token: str
    peer: str  # the sender's control address: a broken connection fails that peer's rooms
    conn: int = 0  # ucx: a random connection id that later frames repeat; tcp: unused


class RegionFrame(msgspec.Struct, tag="region", frozen=True):
    """Header of one contiguous region write into D's buffer."""

    room: int
    dst_offset: int
    length: int
    crc: int | None = None  # zlib.crc32 of the payload, when the receiver asked for it
    tag: int = 0  # ucx: the tag the payload message carries; tcp: unused


class RegionBatch(msgspec.Struct, tag="batch", frozen=True):
    """ucx: the headers of several regions in one message (their payloads follow, tagged)."""

    conn: int  # the hello's connection id
    regions: list[RegionFrame]


DataFrame = DataHello | RegionFrame | RegionBatch

_control_encoder = msgspec.msgpack.Encoder()
_control_decoder = msgspec.msgpack.Decoder(ControlMessage)
_data_decoder = msgspec.msgpack.Decoder(DataFrame)


def encode_control(message: ControlMessage) -> bytes:
    return _control_encoder.encode(message)


def decode_control(data: bytes) -> ControlMessage:
    """Raises msgspec.DecodeError (or ValidationError) on anything malformed."""
    if len(data) > MAX_CONTROL_BYTES:
        raise msgspec.DecodeError(f"control message of {len(data)} bytes")
    return _control_decoder.decode(data)


def encode_frame(frame: DataFrame) -> bytes:
    """Length-prefixed header bytes."""
    body = _control_encoder.encode(frame)
    return _LENGTH.pack(len(body)) + body


def frame_length(prefix: bytes | bytearray | memoryview) -> int:
    """The header length announced by a 4-byte prefix; raises ValueError when oversized."""
    (length,) = _LENGTH.unpack(prefix)
    if not 0 < length <= MAX_HEADER_BYTES - _LENGTH.size:
        raise ValueError(f"header length {length} out of range")
    return int(length)


def decode_frame(body: bytes | memoryview) -> DataFrame:
    """Decode a header body (without its length prefix); raises msgspec errors."""
    return _data_decoder.decode(body)


def decode_prefixed_frame(data: bytes | memoryview) -> DataFrame:
    """Decode ``length + header`` from a fixed-size buffer (ucx), ignoring trailing bytes."""
    length = frame_length(data[: _LENGTH.size])
    return decode_frame(data[_LENGTH.size : _LENGTH.size + length])


PREFIX_BYTES = _LENGTH.size

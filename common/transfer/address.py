"""Transfer addresses that carry a struct: ``"<scheme>:" + base64url(msgpack(struct))``.

A decode worker advertises its address in its registration and in the init message; a
prefill worker decodes it on a transfer thread. `auto` (an ``Offer``) and `ipc` (an
``IpcExport``) use this form; `tcp` and `ucx` addresses are plain strings of their own.
"""

from __future__ import annotations

import base64
import binascii
from typing import Generic, TypeVar

import msgspec

from baton.common.transfer.base import TransferError

S = TypeVar("S", bound=msgspec.Struct)


class AddressCodec(Generic[S]):
    """One backend's addresses, both directions. Build it once, at import: msgspec resolves
    a Struct's annotations on its first typed decode, and transfer threads doing that at the
    same time crash the process (msgspec 0.22)."""

    def __init__(self, scheme: str, struct: type[S]) -> None:
        self.scheme = scheme
        self._prefix = scheme + ":"
        self._decoder = msgspec.msgpack.Decoder(struct)

    def encode(self, value: S) -> str:
        return self._prefix + base64.urlsafe_b64encode(msgspec.msgpack.encode(value)).decode()

    def decode(self, address: str) -> S:
        """Raises TransferError for another scheme's address or a malformed one."""
        if not address.startswith(self._prefix):
            raise TransferError(f"not an {self.scheme} transfer address: {address[:40]!r}")
        try:
            raw = base64.urlsafe_b64decode(address[len(self._prefix) :])
            return self._decoder.decode(raw)
        except (ValueError, binascii.Error, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TransferError(f"malformed {self.scheme} transfer address: {exc}") from None

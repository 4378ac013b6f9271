"""The one check of an `Authorization: Bearer <key>` header, for the API key and the admin
key alike."""

from __future__ import annotations

import hmac


def bearer_matches(authorization: bytes, key: bytes) -> bool:
    """Whether the header presents `key`. The scheme is case-insensitive (RFC 9110 §11.1:
    `bearer <key>` is as good); the key is compared in constant time."""
    scheme, _, presented = authorization.partition(b" ")
    return hmac.compare_digest(presented, key) and scheme.lower() == b"bearer"

"""KV layout compatibility: can a prefill worker write into a decode worker's pages?

Shared by the registries (refuse a mismatched worker at registration), the router (pairs
only compatible workers) and the workers (check their peer before a transfer).
"""

from __future__ import annotations

from collections.abc import Iterable

from baton.common.rpc import baton_pb2

# Heterogeneous tensor parallelism is allowed: P and D may shard the KV heads differently.
_IGNORED_FIELDS = frozenset({"tp_size"})


def layout_mismatch(a: baton_pb2.KVLayout, b: baton_pb2.KVLayout) -> str | None:
    """None when `a` and `b` agree; else one clause per differing field, in field order,
    e.g. "page_size 16 != 1; dtype float32 != bfloat16"."""
    clauses = []
    for field in baton_pb2.KVLayout.DESCRIPTOR.fields:
        if field.name in _IGNORED_FIELDS:
            continue
        left, right = getattr(a, field.name), getattr(b, field.name)
        if left != right:
            clauses.append(f"{field.name} {left} != {right}")
    return "; ".join(clauses) or None


# Roles whose KV pages flow between each other and so must share a layout.
_KV_PEER_ROLE = {baton_pb2.PREFILL: baton_pb2.DECODE, baton_pb2.DECODE: baton_pb2.PREFILL}


def layout_conflict(
    info: baton_pb2.WorkerInfo, members: Iterable[baton_pb2.WorkerInfo]
) -> str | None:
    """Why `info` may not join `members`: a member it would exchange KV pages with (a decode
    worker for a prefill one and back) has another layout. None when nothing conflicts; a
    member with the same worker_id is the worker itself and is skipped."""
    peer_role = _KV_PEER_ROLE.get(info.role)
    if peer_role is None:
        return None
    for member in members:
        if member.role != peer_role or member.worker_id == info.worker_id:
            continue
        mismatch = layout_mismatch(info.layout, member.layout)
        if mismatch:
            return (
                f"worker {info.worker_id}: KV layout differs from "
                f"{baton_pb2.Role.Name(peer_role)} worker {member.worker_id}: {mismatch}"
            )
    return None

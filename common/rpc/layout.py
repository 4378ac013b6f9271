"""KV layout compatibility: can a prefill worker write into a decode worker's pages?

Shared by the bootstrap registry (refuses a mismatched worker at registration), the router
(pairs only compatible workers) and the workers (check their peer before a transfer).
"""

from __future__ import annotations

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

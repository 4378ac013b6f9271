"""Fault plans of the `fake` backend (`--transfer-fault`), parsed without torch so a worker's
configuration is checked before anything starts.

Grammar (whitespace ignored, an empty plan injects nothing)::

    plan  := fault (";" fault)*
    fault := kind [":" param ("," param)*]
    param := name "=" integer

    fail:every=N     every Nth room fails on the sender with "fake fault: fail" (D is told)
    drop:every=N     every Nth room's final status is silently never sent: P reports
                     Success, D waits until its deadline
    delay:ms=M       sleep M ms before each push of regions and before each final status
    corrupt:every=N  every Nth room's payload bytes are flipped on the wire (the source stays
                     intact): a receiver with verify_checksum fails it, "checksum mismatch"

``every`` defaults to 1. Rooms are numbered 1, 2, … in the order they first reach the
backend (their first push, or their final status when there is nothing to push), so
``fail:every=2`` fails the 2nd, 4th, … room. Example: ``"fail:every=3; delay:ms=50"``.
"""

from __future__ import annotations

from dataclasses import dataclass

_KINDS = {"fail": "every", "drop": "every", "delay": "ms", "corrupt": "every"}


@dataclass(frozen=True)
class FaultPlan:
    fail_every: int = 0  # 0: never
    drop_every: int = 0
    corrupt_every: int = 0
    delay_ms: int = 0

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        fields: dict[str, int] = {}
        for fault in filter(None, (part.strip() for part in text.split(";"))):
            kind, _, params = (s.strip() for s in fault.partition(":"))
            if kind not in _KINDS:
                raise ValueError(f"fault plan {text!r}: unknown fault {kind!r}")
            values = {_KINDS[kind]: 1} if kind != "delay" else {}
            for param in filter(None, (p.strip() for p in params.split(","))):
                name, eq, value = (s.strip() for s in param.partition("="))
                if name != _KINDS[kind] or not eq or not value.isdigit():
                    raise ValueError(f"fault plan {text!r}: bad parameter {param!r} of {kind}")
                values[name] = int(value)
            if _KINDS[kind] not in values:
                raise ValueError(f"fault plan {text!r}: {kind} needs {_KINDS[kind]}=")
            fields[f"{kind}_{_KINDS[kind]}"] = values[_KINDS[kind]]
        return cls(**fields)

"""What one replica asks of another's data server: a snapshot, logged mean gradients, a step's
signature, or the job's initial state.

The data plane carries a request as an opaque dict (``fetch_state``'s meta): this module is the
wire edge. Everything on either side of it handles a typed ``StateRequest``; a malformed one is
refused (answered with nothing), never half-read.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestKind(str, enum.Enum):
    SNAPSHOT = "snapshot"     # the whole state, at a step >= min_step (a joiner's catch-up)
    GRADS = "grads"           # the mean gradients of steps lo..hi-1 (a fast-forward)
    SIG = "sig"               # who contributed to `step` (a replica back from a pause checks it)
    INITIAL = "initial"       # the lead's state at step 0 (the same start everywhere)
    CHECKED = "checked"       # a replica's outcome of comparing its step-0 digest with the lead's

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class StateRequest:
    kind: RequestKind
    shard: int = 0
    min_step: int = 0         # SNAPSHOT
    lo: int = 0               # GRADS: first step
    hi: int = 0               # GRADS: one past the last step
    step: int = 0             # SIG
    digest_only: bool = False  # INITIAL: compare digests, send no tensors
    ok: bool = False          # CHECKED: the digests matched
    who: str = ""             # CHECKED: the reporting replica's id

    @classmethod
    def snapshot(cls, min_step: int, shard: int) -> "StateRequest":
        return cls(RequestKind.SNAPSHOT, shard=shard, min_step=min_step)

    @classmethod
    def grads(cls, lo: int, hi: int, shard: int) -> "StateRequest":
        return cls(RequestKind.GRADS, shard=shard, lo=lo, hi=hi)

    @classmethod
    def signature(cls, step: int, shard: int = 0) -> "StateRequest":
        return cls(RequestKind.SIG, shard=shard, step=step)

    @classmethod
    def initial(cls, digest_only: bool, shard: int = 0) -> "StateRequest":
        return cls(RequestKind.INITIAL, shard=shard, digest_only=digest_only)

    @classmethod
    def checked(cls, ok: bool, who: str) -> "StateRequest":
        """To the lead's rank 0: this replica's check of the initial state; answered with the
        lead's verdict over every check (``JobLife``)."""
        return cls(RequestKind.CHECKED, shard=0, ok=ok, who=who)

    def to_wire(self) -> dict[str, object]:
        d: dict[str, object] = {"kind": self.kind.value, "shard": self.shard}
        if self.kind is RequestKind.SNAPSHOT:
            d["min_step"] = self.min_step
        elif self.kind is RequestKind.GRADS:
            d["from"], d["to"] = self.lo, self.hi
        elif self.kind is RequestKind.SIG:
            d["step"] = self.step
        elif self.kind is RequestKind.CHECKED:
            d["ok"], d["who"] = self.ok, self.who
        elif self.digest_only:
            d["digest_only"] = True
        return d

    @classmethod
    def from_wire(cls, d: object) -> "StateRequest":
        """Raises ValueError (or KeyError/TypeError) on a malformed request."""
        if not isinstance(d, dict):
            raise TypeError(f"a state request is a map, got {type(d).__name__}")
        kind = RequestKind(d["kind"])
        shard = _int(d.get("shard", 0))
        if kind is RequestKind.SNAPSHOT:
            return cls.snapshot(_int(d.get("min_step", 0)), shard)
        if kind is RequestKind.GRADS:
            return cls.grads(_int(d["from"]), _int(d["to"]), shard)
        if kind is RequestKind.SIG:
            return cls.signature(_int(d["step"]), shard)
        if kind is RequestKind.CHECKED:
            ok, who = d["ok"], d["who"]
            if not isinstance(ok, bool) or not isinstance(who, str):
                raise TypeError(f"malformed check report {d!r}")
            return cls.checked(ok, who)
        return cls(kind, shard=shard, digest_only=bool(d.get("digest_only", False)))


def _int(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {v!r}")
    return v


__all__ = ["RequestKind", "StateRequest"]

"""Residency policies: which resident blends of adapters keep their buffers.

A registered adapter is only parsed metadata over a memory map and costs almost nothing;
a *resident* one holds filled input buffers for its rank slot. A blend that a session is
running is never evicted, whatever the policy.
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Mapping, Set
from dataclasses import dataclass

from runtime.errors import InvalidArgumentError


@dataclass(frozen=True)
class KeepAll:
    """Every adapter stays resident once used, until it is unloaded (the default)."""


@dataclass(frozen=True)
class Lru:
    """At most ``max_resident`` resident blends and/or ``max_bytes`` of buffers; the least
    recently used idle ones go first."""

    max_resident: int | None = 4
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_resident is None and self.max_bytes is None:
            raise InvalidArgumentError("Lru needs max_resident, max_bytes or both")
        for name, value, least in (("max_resident", self.max_resident, 1), ("max_bytes", self.max_bytes, 0)):
            # An integer: a string failed the comparison with a TypeError, NaN was never exceeded.
            if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool)
                                      or value < least):
                raise InvalidArgumentError(f"Lru {name}={value!r:.40}, expected an integer >= {least} or None")


@dataclass(frozen=True)
class OnlyActive:
    """Buffers exist only while a session runs with them; every use after an idle spell
    materializes again (least memory, a cold switch every time)."""


ResidencyPolicy = KeepAll | Lru | OnlyActive


def check_policy(policy: object) -> ResidencyPolicy:
    """``policy`` if it is a residency policy, else ``InvalidArgumentError``."""
    if not isinstance(policy, ResidencyPolicy):
        raise InvalidArgumentError(
            f"residency policy {policy!r}, expected KeepAll(), Lru(max_resident=..., max_bytes=...) or OnlyActive()"
        )
    return policy


def choose_evictions(
    policy: ResidencyPolicy,
    resident: Mapping[Hashable, int],
    protected: Set[Hashable],
) -> list[Hashable]:
    """Which resident entries to evict now.

    ``resident`` maps each entry to its bytes, least recently used first; ``protected``
    entries (running, or just requested) are never chosen.
    """
    if isinstance(policy, KeepAll):
        return []
    idle = [key for key in resident if key not in protected]
    if isinstance(policy, OnlyActive):
        return idle
    if not isinstance(policy, Lru):
        raise InvalidArgumentError(f"unknown residency policy {policy!r}")
    count, total = len(resident), sum(resident.values())
    evict = []
    for key in idle:
        over_count = policy.max_resident is not None and count > policy.max_resident
        over_bytes = policy.max_bytes is not None and total > policy.max_bytes
        if not (over_count or over_bytes):
            break
        evict.append(key)
        count -= 1
        total -= resident[key]
    return evict

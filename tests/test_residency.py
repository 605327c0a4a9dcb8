"""Tests for runtime.components.residency."""

from __future__ import annotations

import pytest

from runtime.components.residency import KeepAll, Lru, OnlyActive, choose_evictions
from runtime.errors import InvalidArgumentError

RESIDENT = {"a": 100, "b": 100, "c": 100, "d": 100}  # least recently used first


def test_keep_all_never_evicts():
    assert choose_evictions(KeepAll(), RESIDENT, set()) == []


def test_only_active_keeps_the_protected():
    assert choose_evictions(OnlyActive(), RESIDENT, {"b"}) == ["a", "c", "d"]


def test_lru_by_count_and_bytes_skips_protected():
    assert choose_evictions(Lru(max_resident=2), RESIDENT, set()) == ["a", "b"]
    assert choose_evictions(Lru(max_resident=2), RESIDENT, {"a"}) == ["b", "c"]
    assert choose_evictions(Lru(max_resident=None, max_bytes=250), RESIDENT, set()) == ["a", "b"]
    assert choose_evictions(Lru(max_resident=1), RESIDENT, set(RESIDENT)) == []  # all running
    assert choose_evictions(Lru(max_resident=4), RESIDENT, set()) == []


@pytest.mark.parametrize("kwargs", [{"max_resident": 0}, {"max_resident": None}, {"max_bytes": -1}])
def test_bad_lru(kwargs):
    with pytest.raises(InvalidArgumentError):
        Lru(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_resident": "3"}, "max_resident"),  # compared with 1: a TypeError, not the runtime's error
    ({"max_resident": True}, "max_resident"),  # a bool passed for 1
    ({"max_resident": 2.5}, "max_resident"),
    ({"max_resident": None, "max_bytes": float("nan")}, "max_bytes"),  # never exceeded: nothing ever evicted
    ({"max_resident": None, "max_bytes": "1e6"}, "max_bytes"),
])
def test_lru_limits_must_be_integers(kwargs, field):
    with pytest.raises(InvalidArgumentError, match=f"Lru {field}="):
        Lru(**kwargs)


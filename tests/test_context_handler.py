"""Tests for runtime.framework.resource_management.context_handler."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from runtime.framework.resource_management.context_handler import ContextHandler

# The handler only compares executors and LoRAs by identity and reads ``binding.executor``,
# so plain objects stand in for them.


class Builder:
    """A ``build`` callable that makes a new binding for ``executor`` and counts calls."""

    def __init__(self, executor: object) -> None:
        self.executor = executor
        self.calls = 0

    def __call__(self) -> SimpleNamespace:
        self.calls += 1
        return SimpleNamespace(executor=self.executor, serial=self.calls)


def never() -> SimpleNamespace:
    raise AssertionError("build() should not have been called")


def handler(blend=((1, 1.0),)) -> ContextHandler:
    return ContextHandler(blend=tuple(blend), kv=object())


def test_a_new_context_has_no_binding():
    context = handler()
    assert context.position == 0
    assert context.binding is None and context.bound_lora is None and context.recent == {}


def test_lora_ids_are_the_blend_ids_in_order():
    assert handler([(2, 0.5), (5, 1.0), (9, -1.0)]).lora_ids == [2, 5, 9]
    assert handler(()).lora_ids == []


def test_first_use_builds_and_becomes_current():
    context, executor, lora = handler(), object(), object()
    build = Builder(executor)
    binding = context.use_binding(executor, lora, build)
    assert build.calls == 1
    assert context.binding is binding and context.bound_lora is lora
    assert context.recent == {(id(executor), id(lora)): (lora, binding)}


def test_the_current_binding_is_returned_without_building():
    context, executor, lora = handler(), object(), object()
    binding = context.use_binding(executor, lora, Builder(executor))
    for _ in range(3):
        assert context.use_binding(executor, lora, never) is binding


def test_base_model_binding_with_no_lora():
    context, executor = handler(()), object()
    build = Builder(executor)
    binding = context.use_binding(executor, None, build)
    assert context.use_binding(executor, None, never) is binding
    assert context.bound_lora is None and build.calls == 1


def test_another_lora_builds_then_switching_back_reuses_the_recent_binding():
    context, executor = handler(), object()
    lora_a, lora_b = object(), object()
    build = Builder(executor)
    a = context.use_binding(executor, lora_a, build)
    b = context.use_binding(executor, lora_b, build)
    assert b is not a and build.calls == 2
    assert context.use_binding(executor, lora_a, never) is a
    assert context.binding is a and context.bound_lora is lora_a
    assert context.use_binding(executor, lora_b, never) is b
    assert context.bound_lora is lora_b


def test_bindings_are_per_executor():
    context, lora = handler(), object()
    first, second = object(), object()
    on_first, on_second = Builder(first), Builder(second)
    x = context.use_binding(first, lora, on_first)
    y = context.use_binding(second, lora, on_second)
    assert y is not x and y.executor is second
    assert (on_first.calls, on_second.calls) == (1, 1)
    assert context.use_binding(first, lora, never) is x
    assert context.use_binding(second, lora, never) is y


def test_a_current_binding_of_another_executor_is_not_reused():
    # Same LoRA as the current binding, but the binding belongs to another executor.
    context, lora = handler(), object()
    first, second = object(), object()
    context.use_binding(first, lora, Builder(first))
    build = Builder(second)
    binding = context.use_binding(second, lora, build)
    assert build.calls == 1 and binding.executor is second


def test_recent_keeps_at_most_recent_bindings_most_recent_last():
    context, executor = handler(), object()
    limit = ContextHandler.RECENT_BINDINGS
    loras = [object() for _ in range(limit + 3)]
    build = Builder(executor)
    bindings = [context.use_binding(executor, lora, build) for lora in loras]
    assert len(context.recent) == limit
    assert list(context.recent) == [(id(executor), id(lora)) for lora in loras[-limit:]]
    assert [binding for _, binding in context.recent.values()] == bindings[-limit:]


def test_the_oldest_binding_is_rebuilt_after_being_dropped():
    context, executor = handler(), object()
    limit = ContextHandler.RECENT_BINDINGS
    loras = [object() for _ in range(limit + 1)]
    build = Builder(executor)
    first = [context.use_binding(executor, lora, build) for lora in loras][0]
    assert build.calls == limit + 1
    again = context.use_binding(executor, loras[0], build)
    assert build.calls == limit + 2 and again is not first
    # ...which in turn pushed out loras[1], the oldest now.
    assert (id(executor), id(loras[1])) not in context.recent
    assert list(context.recent)[-1] == (id(executor), id(loras[0]))


def test_reusing_a_recent_binding_makes_it_most_recent():
    context, executor = handler(), object()
    limit = ContextHandler.RECENT_BINDINGS
    loras = [object() for _ in range(limit)]
    build = Builder(executor)
    for lora in loras:
        context.use_binding(executor, lora, build)
    context.use_binding(executor, loras[0], never)  # a hit: moves to the end
    assert list(context.recent)[-1] == (id(executor), id(loras[0]))
    extra = object()
    context.use_binding(executor, extra, build)  # evicts loras[1], not loras[0]
    assert (id(executor), id(loras[0])) in context.recent
    assert (id(executor), id(loras[1])) not in context.recent
    assert len(context.recent) == limit


def test_a_cached_entry_for_another_object_at_the_same_key_is_rebuilt():
    # The key is made of id()s; the entry also remembers the LoRA to tell a reused id apart.
    context, executor, lora = handler(), object(), object()
    impostor, stale = object(), SimpleNamespace(executor=executor)
    context.recent[(id(executor), id(lora))] = (impostor, stale)
    build = Builder(executor)
    binding = context.use_binding(executor, lora, build)
    assert build.calls == 1 and binding is not stale
    assert context.recent[(id(executor), id(lora))] == (lora, binding)


def test_a_failing_build_leaves_the_current_binding():
    context, executor = handler(), object()
    lora_a, lora_b = object(), object()
    a = context.use_binding(executor, lora_a, Builder(executor))

    def broken():
        raise MemoryError("no room for the binding")

    with pytest.raises(MemoryError, match="no room"):
        context.use_binding(executor, lora_b, broken)
    assert context.binding is a and context.bound_lora is lora_a
    assert list(context.recent) == [(id(executor), id(lora_a))]


def test_forget_lora_drops_its_bindings_on_every_executor_only():
    context, lora, other = handler(), object(), object()
    first, second = object(), object()
    context.use_binding(first, lora, Builder(first))
    kept = context.use_binding(first, other, Builder(first))
    context.use_binding(second, lora, Builder(second))
    context.forget_lora(lora)
    assert context.recent == {(id(first), id(other)): (other, kept)}
    # It was the current binding: that is gone too, and the next use builds.
    assert context.binding is None and context.bound_lora is None
    build = Builder(second)
    context.use_binding(second, lora, build)
    assert build.calls == 1


def test_forget_lora_keeps_another_current_binding():
    context, executor = handler(), object()
    evicted, current = object(), object()
    context.use_binding(executor, evicted, Builder(executor))
    binding = context.use_binding(executor, current, Builder(executor))
    context.forget_lora(evicted)
    assert context.binding is binding and context.bound_lora is current
    assert list(context.recent) == [(id(executor), id(current))]
    assert context.use_binding(executor, current, never) is binding


def test_forget_lora_of_an_unknown_lora_changes_nothing():
    context, executor, lora = handler(), object(), object()
    binding = context.use_binding(executor, lora, Builder(executor))
    before = dict(context.recent)
    context.forget_lora(object())
    assert context.recent == before and context.binding is binding


def test_forget_binding_drops_everything():
    context, executor = handler(), object()
    loras = [object(), object(), None]
    for lora in loras:
        context.use_binding(executor, lora, Builder(executor))
    context.forget_binding()
    assert context.binding is None and context.bound_lora is None and context.recent == {}
    build = Builder(executor)
    context.use_binding(executor, loras[0], build)
    assert build.calls == 1
    context.forget_binding()
    context.forget_binding()  # twice is harmless
    assert context.recent == {}


def test_handlers_compare_by_identity():
    kv = object()
    a, b = ContextHandler(((1, 1.0),), kv), ContextHandler(((1, 1.0),), kv)
    assert a != b and a == a
    assert len({a, b}) == 2  # hashable, so a resource manager can keep them in a WeakSet


def test_concurrent_use_and_forget_keep_the_state_consistent():
    context, executor = handler(), object()
    loras = [object() for _ in range(ContextHandler.RECENT_BINDINGS * 2)]
    errors: list[BaseException] = []

    def use():
        try:
            for i in range(2000):
                lora = loras[i % len(loras)]
                binding = context.use_binding(executor, lora, Builder(executor))
                assert binding.executor is executor
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def forget():
        try:
            for i in range(2000):
                context.forget_lora(loras[i % len(loras)])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=use), threading.Thread(target=forget)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(context.recent) <= ContextHandler.RECENT_BINDINGS
    for (executor_id, lora_id), (lora, binding) in context.recent.items():
        assert executor_id == id(executor) and lora_id == id(lora) and binding.executor is executor
    if context.binding is not None:
        assert (id(executor), id(context.bound_lora)) in context.recent

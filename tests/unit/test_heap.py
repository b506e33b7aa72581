"""miles_core/heap.py: the objects alive when work starts are frozen while it runs, and only then."""

import gc
import weakref

import pytest

from miles_core.heap import frozen_heap


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture(autouse=True)
def nothing_frozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_alive_before_is_frozen_within_and_back_after():
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with frozen_heap():  # nested: the outer one's freeze stands
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == 0


def test_garbage_made_within_is_collected_within():
    with frozen_heap():
        gone = weakref.ref(Node())
        gc.collect()
        assert gone() is None


def test_garbage_of_a_frozen_object_is_collected_after():
    old = Node()
    gone = weakref.ref(old)
    with frozen_heap():
        del old
        gc.collect()
        assert gone() is not None  # frozen: the collector skips it while the work runs
    gc.collect()
    assert gone() is None


def test_an_error_still_unfreezes():
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_what_something_else_froze_stays_frozen():
    gc.freeze()
    frozen = gc.get_freeze_count()
    with frozen_heap():
        pass
    assert gc.get_freeze_count() == frozen

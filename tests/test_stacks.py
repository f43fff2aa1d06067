"""Stacks of adapters keyed by their parts' names, versions and scales
(mola/registry/stacks.py)."""

from __future__ import annotations

import itertools

from mola.registry.records import AdapterRecord
from mola.registry.stacks import Stacks, stack_key


UIDS = itertools.count(1)  # records' uids, as a registry's counter gives them


def rec(name: str, version: int = 1, slot_scale: float = 1.0) -> AdapterRecord:
    return AdapterRecord(name=name, path=f"/{name}", source="rest", version=version, uid=next(UIDS),
                         slot_scale=slot_scale)


def test_the_key_is_order_free_and_names_versions_and_scales():
    a, b = rec("a"), rec("b", version=3)
    assert stack_key([(a, 0.5), (b, 1.0)]) == stack_key([(b, 1.0), (a, 0.5)]) == "a@v1*0.5+b@v3*1"
    assert stack_key([(a, 0.5), (rec("b", version=4), 1.0)]) != stack_key([(a, 0.5), (b, 1.0)])


def test_a_stack_is_made_once_and_dropped_with_its_parts():
    stacks = Stacks(UIDS)
    a, b, c = rec("a", slot_scale=2.0), rec("b"), rec("c")
    ab = stacks.get_or_make([(a, 0.5), (b, 1.0)])
    assert stacks.get_or_make([(b, 1.0), (a, 0.5)]) is ab
    assert ab.parts == (("/a", 1.0), ("/b", 1.0))  # the slot_scale times the request's
    bc = stacks.get_or_make([(b, 1.0), (c, 1.0)])
    assert stacks.using(a) == [ab] and set(stacks.using(b)) == {ab, bc}
    stacks.drop(ab)
    assert not stacks.is_current(ab) and list(stacks) == [bc]

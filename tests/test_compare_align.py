"""Sequence alignment: order-preserving, nothing dropped, ties broken by the closest norms."""

from __future__ import annotations

from pi0align.compare.measuring.align import align_sequences


def test_identical_sequences_pair_in_order():
    assert align_sequences([1, 2, 3], [1, 2, 3]) == [(0, 0), (1, 1), (2, 2)]


def test_extra_call_on_one_side_is_left_unpaired():
    assert align_sequences([1, 2, 3], [1, 9, 2, 3]) == [(0, 0), (1, 2), (2, 3)]
    assert align_sequences([1, 2, 3], [9, 1, 2, 3]) == [(0, 1), (1, 2), (2, 3)]


def test_extra_call_between_equal_calls():
    # A: add add ; B: add cast add -- both adds pair, the cast is extra
    assert align_sequences([5, 3, 3, 6], [5, 3, 7, 3, 6]) == [(0, 0), (1, 1), (2, 3), (3, 4)]


def test_equal_calls_of_different_counts_pair_by_closest_norms():
    # B has one extra call among three equal ones; its norm says it is the middle one
    pairs = align_sequences([4, 4], [4, 4, 4], norms_a=[(1.0,), (3.0,)], norms_b=[(1.0,), (50.0,), (3.0,)])
    assert pairs == [(0, 0), (1, 2)]


def test_changed_shape_pairs_by_api_inside_a_differing_stretch():
    # tokens differ at position 1 (shape changed), the APIs are the same
    assert align_sequences([1, 2, 3], [1, 8, 3], apis_a=[10, 20, 30], apis_b=[10, 20, 30]) == [(0, 0), (1, 1), (2, 2)]
    assert align_sequences([1, 2, 3], [1, 8, 3], apis_a=[10, 20, 30], apis_b=[10, 21, 30]) == [(0, 0), (2, 2)]


def test_twenty_thousand_calls_with_scattered_extra_calls():
    a = [i % 37 for i in range(20_000)]
    b = list(a)
    for position in range(19_000, 0, -1000):
        b.insert(position, 99)  # 19 extra calls spread over the sequence
    pairs = align_sequences(a, b)
    assert len(pairs) == 20_000 and all(a[i] == b[j] for i, j in pairs)
    assert {j for _, j in pairs} == {j for j, token in enumerate(b) if token != 99}

"""The numpy table behind the compare: joins and group-bys give what pandas would, without pandas."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pi0align.compare.table import Groups, KeyIndex, Table, gather, isin, key_codes, lookup, mapped, outer_join

TEXT = lambda *values: np.array(values, object)


def test_key_codes_follow_the_sorted_order_of_the_key_tuples():
    codes, count = key_codes(np.array([2, 1, 2, 1]), TEXT("b", "z", "a", "z"))
    assert count == 3 and codes.tolist() == [2, 0, 1, 0]
    codes, count = key_codes(np.array([1.0, np.nan, 0.5, np.nan]))
    assert count == 3 and codes.tolist() == [1, 2, 0, 2]  # NaN last, and equal to NaN


def test_outer_join_keeps_every_row_in_key_order():
    ia, ib = outer_join([np.array([0, 0, 1, 0]), TEXT("output", "input", "input", "input")],
                        [np.array([0, 2, 0]), TEXT("input", "input", "grad")])
    # keys in sorted order: (0, grad) b only; (0, input) a rows 1 and 3 with b row 0; (0, output) a only; ...
    assert list(zip(ia.tolist(), ib.tolist())) == [(-1, 2), (1, 0), (3, 0), (0, -1), (2, -1), (-1, 1)]


def test_lookup_and_gather():
    position = lookup([np.array([5, 7, 9])], [np.array([9, 5, 5])])
    assert position.tolist() == [1, -1, 0]  # the first row of the table with that key
    assert gather(TEXT("x", "y", "z"), position, "").tolist() == ["y", "", "x"]
    assert np.isnan(gather(np.zeros(0), np.array([-1, -1]), np.nan)).all()  # nothing to gather from


_KEY_ROWS = st.lists(st.tuples(st.integers(-3, 3), st.sampled_from(["input", "output", "grad"]),
                                st.sampled_from([0.5, 1.0, float("nan")])), max_size=12)


@settings(max_examples=300, deadline=None)
@given(table_rows=_KEY_ROWS, query_rows=_KEY_ROWS)
def test_a_key_index_finds_what_a_scan_of_the_table_finds(table_rows, query_rows):
    """Integer, text and float keys (NaN equal to NaN), keys absent from the table, empty tables;
    asked twice of one index, and through `lookup`."""
    same = lambda x, y: all(a == b or (a != a and b != b) for a, b in zip(x, y))  # noqa: E731
    expected = [next((i for i, row in enumerate(table_rows) if same(row, query)), -1) for query in query_rows]
    columns = lambda rows: [np.array([r[0] for r in rows], np.int64), TEXT(*[r[1] for r in rows]),  # noqa: E731
                            np.array([r[2] for r in rows], np.float64)]
    index = KeyIndex(columns(table_rows))
    assert index.rows(columns(query_rows)).tolist() == expected
    assert index.rows(columns(query_rows)).tolist() == expected
    assert lookup(columns(query_rows), columns(table_rows)).tolist() == expected


def test_groups_are_numbered_by_first_appearance():
    groups = Groups(TEXT("b", "a", "b", "c", "a"))
    assert groups.codes.tolist() == [0, 1, 0, 2, 1] and groups.first.tolist() == [0, 1, 3]
    assert groups.max(np.array([1.0, np.nan, 3.0, np.nan, 2.0])).tolist()[:2] == [3.0, 2.0]
    assert np.isnan(groups.max(np.array([1.0, np.nan, 3.0, np.nan, 2.0]))[2])  # all NaN
    assert groups.any(np.array([False, False, True, False, False])).tolist() == [True, False, False]
    assert groups.max_text(TEXT("", "rel", "stats", "", "")).tolist() == ["stats", "rel", ""]


def test_table_round_trips_through_pandas():
    table = Table({"step": np.array([0, 1]), "seq_a": np.array([3.0, np.nan]), "name": TEXT("a", "b")},
                  nullable_ints=["seq_a"])
    frame = table.to_pandas()
    assert [str(t) for t in frame.dtypes] == ["int64", "Int64", "str"]
    assert frame["seq_a"].isna().tolist() == [False, True]
    back = Table.from_pandas(frame)
    assert back.nullable_ints == {"seq_a"} and back["step"].dtype == np.int64
    assert back["name"].tolist() == ["a", "b"] and np.isnan(back["seq_a"][1])
    assert len(table.take(np.array([True, False]))) == 1 and table.select(["name"]).columns == ["name"]


@settings(max_examples=200, deadline=None)
@given(length=st.integers(0, 12), data=st.data())
def test_rows_taken_when_read_and_rows_between_are_the_rows_take_gives(length, data):
    table = Table({"step": np.arange(length), "value": np.linspace(0.0, 1.0, length),
                   "name": np.array([f"call{i % 3}" for i in range(length)], dtype=object)})
    picks = [np.array(data.draw(st.lists(st.booleans(), min_size=length, max_size=length)), bool),
             np.array(data.draw(st.lists(st.integers(0, max(length - 1, 0)), max_size=length if length else 0)),
                      np.int64)]
    for rows in picks:
        taken, lazily = table.take(rows), table.taken_when_read(rows)
        assert len(lazily) == len(taken) and lazily.columns == taken.columns and "value" in lazily
        read_first = lazily["name"]  # one column read before the others: the rest still to take
        assert read_first.tolist() == taken["name"].tolist()
        for name in taken.columns:
            assert lazily[name].tolist() == taken[name].tolist()
        assert lazily.take(np.arange(len(lazily)))["step"].tolist() == taken["step"].tolist()
    start = data.draw(st.integers(0, length))
    stop = data.draw(st.integers(start, length))
    between = table.between(start, stop)
    assert len(between) == stop - start and between["name"].tolist() == table["name"][start:stop].tolist()


_WORDS = st.sampled_from(["", "input", "output", "grad_input", "Module.Linear", "torch.matmul"])


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_coded_column_gives_every_helper_the_answer_its_text_gives(data):
    """Text columns with repeats and empty strings, coded once and then taken, sliced, taken when
    read, selected, concatenated and gathered: each helper answers for the codes what it answers
    for the text, and a column set again is coded anew."""
    length = data.draw(st.integers(0, 10))
    words = lambda n: TEXT(*data.draw(st.lists(_WORDS, min_size=n, max_size=n)))  # noqa: E731
    table = Table({"role": words(length), "api": words(length), "step": np.arange(length) % 3})
    for name in ("role", "api", "step"):
        table.coded(name)
    rows = np.array(data.draw(st.lists(st.integers(0, max(length - 1, 0)), max_size=length if length else 0)), np.int64)
    start = data.draw(st.integers(0, length))
    derived = [table.take(rows), table.taken_when_read(rows), table.between(start, length),
               table.select(["api", "role"]), Table.concat([table, table.take(rows)]),
               table.taken_when_read(rows).take(np.arange(len(rows)))]
    for t in derived:
        for name in ("role", "api"):
            coded, text = t.coded(name), t[name]
            assert coded.values.tolist() == text.tolist()
            assert isin(coded, ("input", "")).tolist() == isin(text, ("input", "")).tolist()
            assert mapped(coded, len, np.int64).tolist() == mapped(text, len, np.int64).tolist()
        pair_codes, pair_text = key_codes(t.coded("role"), t.coded("api")), key_codes(t["role"], t["api"])
        assert pair_codes[0].tolist() == pair_text[0].tolist() and pair_codes[1] == pair_text[1]
        assert Groups(t.coded("api")).codes.tolist() == Groups(t["api"]).codes.tolist()
        by_api = Groups(t.coded("api"))
        assert by_api.max_text(t.coded("role")).tolist() == Groups(t["api"]).max_text(t["role"]).tolist()
    query = Table({"role": words(data.draw(st.integers(0, 6)))})
    for keys_of_query in ([query.coded("role")], [query["role"]]):
        found = lookup(keys_of_query, [table.coded("role")])
        assert found.tolist() == lookup([query["role"]], [table["role"]]).tolist()
        joined_codes = outer_join(keys_of_query, [table.coded("role")])
        joined_text = outer_join([query["role"]], [table["role"]])
        assert all(x.tolist() == y.tolist() for x, y in zip(joined_codes, joined_text))
    at = np.array(data.draw(st.lists(st.integers(-1, max(length - 1, 0)), max_size=6)), np.int64) if length else \
        np.full(data.draw(st.integers(0, 3)), -1, np.int64)
    assert table.coded("api").gathered(at, "").values.tolist() == gather(table["api"], at, "").tolist()
    lazily = table.taken_when_read(rows)
    lazily["api"] = TEXT(*["new"] * len(rows))  # set on the rows taken, not their source
    assert lazily.coded("api").values.tolist() == ["new"] * len(rows)
    if length:  # a coded column is read-only: its codes would not follow a change in place
        with pytest.raises(ValueError):
            table["api"][0] = "changed"
    table["role"] = TEXT(*["x"] * length)  # set again: its codes are the new column's
    assert table.coded("role").values.tolist() == ["x"] * length

"""The compiled scanner of msprobe's dump.json (compare/reading/csrc/msprobe_scan.cpp) against the
reference walk through the parsed JSON: on msprobe's own dumps it reads every file, and on any
file, however made, it gives the reference's columns exactly or gives the file up to the reference,
never reading one the reference refuses."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pi0align.compare.reading.msprobe_scan import ScannedStep, scanner
from pi0align.compare.reading.read_msprobe import walked_step
from pi0align.compare.table import Coded
from pi0align.errors import UserError
from pi0align.testing.dumpfactory import write_msprobe_dump

SCANNER = scanner()
pytestmark = pytest.mark.skipif(SCANNER is None, reason="no C++ compiler: the reference reads every file")


def reference(raw: bytes) -> ScannedStep | None:
    """What the reader makes of a dump.json without the scanner: its columns, None where refused."""
    try:
        return walked_step(Path("dump.json"), raw)
    except UserError:
        return None


def assert_same(scanned: ScannedStep, expected: ScannedStep) -> None:
    for field in dataclasses.fields(ScannedStep):
        mine, theirs = getattr(scanned, field.name), getattr(expected, field.name)
        if isinstance(theirs, Coded):
            mine, theirs = mine.values, theirs.values
        if isinstance(theirs, np.ndarray):
            assert mine.shape == theirs.shape and mine.dtype == theirs.dtype, field.name
            same = np.array_equal(mine, theirs, equal_nan=True) if theirs.dtype.kind == "f" else \
                mine.tolist() == theirs.tolist()
            assert same, (field.name, mine, theirs)
        else:
            assert mine == theirs, (field.name, mine, theirs)


@pytest.fixture(scope="module")
def msprobe_files(tmp_path_factory):
    pytest.importorskip("msprobe")
    root = tmp_path_factory.mktemp("msprobe")
    dumps = [write_msprobe_dump(root / task, task=task, steps=2) for task in ("statistics", "tensor")]
    return sorted(path for dump in dumps for path in dump.glob("step*/*/dump.json"))


def test_msprobe_s_own_dumps_are_scanned_as_the_reference_reads_them(msprobe_files):
    assert len(msprobe_files) == 4
    for path in msprobe_files:
        raw = path.read_bytes()
        scanned = SCANNER.scan(raw)
        assert scanned is not None, f"{path}: given up"
        assert_same(scanned, reference(raw))
        assert len(scanned.keys) > 10 and scanned.group_count.sum() > 20


# --- any file ---------------------------------------------------------------------------------

_TEXT = st.sampled_from(["", "a", "Tensor", "torch.Tensor", "é", "a\"b", "\\", "\n", "\ud800x"])
_STATISTICS = st.one_of(st.floats(), st.integers(-2**60, 2**60), st.none(), st.booleans())  # all msprobe's
# each field of a tensor entry as msprobe writes it, and what else a file may hold there
_FIELDS = {
    "type": (st.just("torch.Tensor"), st.sampled_from(["torch.nn.parameter.Parameter", "int", None, 3, "Tensor"])),
    "dtype": (st.sampled_from(["torch.float32", "torch.bfloat16", "bool"]), st.one_of(_TEXT, st.just(3))),
    "shape": (st.lists(st.integers(0, 64), max_size=4),
              st.one_of(st.none(), st.lists(st.integers(-3, 2**40), max_size=3),
                        st.sampled_from([[1.0, 2], "23", [True, 2], {}, 0, [2**31, 2**31, 4], [2**63]]))),
    **{name: (_STATISTICS, st.one_of(st.integers(-2**70, 2**70), st.sampled_from(["inf", "NaN", "1.5", "x", [1]]),
                                     st.floats(1e300, 1e308).map(lambda x: x * 10)))
       for name in ("Max", "Min", "Mean", "Norm")},
    "requires_grad": (st.booleans(), st.one_of(st.integers(-1, 2), st.none(), st.just(1.0), _TEXT, st.just([1]))),
    "data_name": (st.sampled_from(["Functional.linear.0.forward.output.0.pt", ""]),
                  st.one_of(st.sampled_from([None, 0, 1]), _TEXT)),
}


def mostly(common: st.SearchStrategy, *odd: st.SearchStrategy) -> st.SearchStrategy:
    """`common` about nine times in ten, else one of `odd`: files mostly as msprobe writes them."""
    return st.integers(0, 9).flatmap(lambda draw: st.one_of(*odd) if draw == 9 else common)


@st.composite
def tensor_entries(draw) -> dict:
    """A tensor's entry as msprobe writes it; one time in five with one field odd or missing."""
    entry = {name: draw(common) for name, (common, _) in _FIELDS.items()} | {"md5": "00ff"}
    if draw(st.integers(0, 4)) == 0:
        name = draw(st.sampled_from(sorted(_FIELDS)))
        if draw(st.booleans()):
            del entry[name]
        else:
            entry[name] = draw(_FIELDS[name][1])
    return entry


_ODD_VALUES = st.recursive(
    st.one_of(tensor_entries(), st.none(), st.integers(), _TEXT),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["a", "type", "dtype", "shape", "x"]),
                                                                inner, max_size=3),
    max_leaves=6)
_ARGUMENTS = mostly(st.lists(mostly(tensor_entries(), st.fixed_dictionaries({"type": st.just("int"),
                                                                            "value": st.integers()}), _ODD_VALUES),
                             max_size=3),
                    _ODD_VALUES)
_KEYS = mostly(st.builds("{}.{}.{}.{}".format, st.sampled_from(["Functional", "Tensor", "Torch"]),
                         st.sampled_from(["linear", "gelu", "__mul__"]), st.integers(0, 3),
                         st.sampled_from(["forward", "backward"])),
               st.builds("Module.{}.{}.{}.{}".format, st.sampled_from(["fc", "layers.0", "a.b.c"]),
                         st.sampled_from(["Linear", "Block"]), st.sampled_from(["forward", "backward",
                                                                               "parameters_grad"]),
                         st.integers(0, 2)),
               st.lists(st.sampled_from(["Module", "linear", "0", "forward", "backward", "parameters_grad", "", "é"]),
                        min_size=1, max_size=7).map(".".join))
_PARAMETERS = st.dictionaries(st.sampled_from(["weight", "bias"]), _ARGUMENTS | tensor_entries(), max_size=2)
_ENTRIES = mostly(
    st.fixed_dictionaries({"input_args": _ARGUMENTS, "input_kwargs": mostly(st.just({}), st.dictionaries(
        st.sampled_from(["bias", "x"]), _ARGUMENTS, max_size=2)), "output": _ARGUMENTS},
        optional={"input": _ARGUMENTS, "parameters": mostly(_PARAMETERS, st.sampled_from([None, [], [1], 0]))}),
    st.fixed_dictionaries({"input": _ARGUMENTS, "output": _ARGUMENTS}),
    _PARAMETERS, st.sampled_from([None, [], 3]))


@st.composite
def dump_files(draw) -> bytes:
    document = {"task": draw(mostly(st.sampled_from(["statistics", "tensor"]), st.sampled_from(["overflow_check", 3]))),
                "level": "L1", "dump_data_dir": None, "data": draw(st.dictionaries(_KEYS, _ENTRIES, max_size=5))}
    if draw(st.booleans()):
        document["framework"] = draw(mostly(st.just("pytorch"), st.just("mindspore")))
    raw = json.dumps(document, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 1])))
    raw = raw.encode("utf-8", "surrogatepass")  # a lone surrogate as Python would write it
    odd = draw(st.integers(0, 7))
    if odd == 1:  # a key twice in one object
        raw = raw.replace(draw(st.sampled_from([b'"output"', b'"Min"', b'"weight"', b'"a"'])),
                          draw(st.sampled_from([b'"input_args"', b'"Max"', b'"bias"', b'"type"'])), 1)
    if odd == 2:  # damage
        at = draw(st.integers(0, max(len(raw) - 1, 0)))
        raw = raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1:]
    if odd == 3:
        raw = raw[:draw(st.integers(0, len(raw)))]
    return raw


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dump_files())
def test_any_file_is_scanned_as_the_reference_reads_it_or_given_up(raw):
    scanned, expected = SCANNER.scan(raw), reference(raw)
    if scanned is not None:
        assert expected is not None, "the scanner read a file the reference refuses"
        assert_same(scanned, expected)


def test_the_scanner_reads_what_msprobe_writes_and_gives_up_the_rest():
    """Files within what msprobe writes are scanned (not all given up), those beyond are not."""
    tensor = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2, 3], "Max": 1, "Min": -1.5,
              "Mean": float("nan"), "Norm": float("inf"), "requires_grad": True}
    data = {"Functional.linear.0.forward": {"input_args": [tensor, {"type": "int", "value": 3}],
                                            "input_kwargs": {"bias": tensor}, "output": [tensor]},
            "Functional.linear.0.backward": {"input": [tensor], "output": [tensor, None]},
            "Module.fc.Linear.parameters_grad.0": {"weight": tensor},
            "Module.fc.Linear.forward.0": {"input_args": [[tensor]], "output": [tensor],
                                           "parameters": {"weight": tensor, "bias": [tensor, tensor]}}}
    good = json.dumps({"task": "statistics", "framework": "pytorch", "data": data}).encode()
    scanned = SCANNER.scan(good)
    assert scanned is not None
    assert_same(scanned, reference(good))
    assert scanned.group_count.tolist() == [2, 1, 1, 1, 1, 1, 1, 1, 1]
    beyond = [good.replace(b'"Min": -1.5', b'"Min": "-1.5"'),  # text for a number
              good.replace(b"Functional.linear.0.backward", b"Functional.linear.0.backw\\u0061rd"),  # an escaped name
              good.replace(b'"Max": 1', b'"Max": 1, "Max": 2', 1),  # a key twice
              good.replace(b'"shape": [2, 3]', b'"shape": [2.0, 3]', 1),  # a dimension that is not an integer
              good[:-1]]  # cut
    for raw in beyond:
        assert SCANNER.scan(raw) is None, raw[:200]

"""The native backend's call descriptions (csrc/call_description.cpp) against their Python
reference, the torch backend's: a call's arguments as JSON, fuzzed with hypothesis over every kind
of value a torch call is given, and its call site's stack."""

from __future__ import annotations

import enum
import json
from collections import OrderedDict

import pytest
import torch
from conftest import require_native
from hypothesis import given, settings
from hypothesis import strategies as st

from pi0align.dump.capturing.arguments import describe_arguments
from pi0align.dump.capturing.stacks import Stacks, call_site


class Color(enum.IntEnum):
    RED = 3


class Opaque:
    """An argument JSON cannot hold: described by its repr, cut at 200 characters."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


_TENSOR = torch.ones(2)
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2**63, max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True), st.text(), st.just(_TENSOR),
    st.just(torch.nn.Parameter(torch.zeros(1))), st.just(Color.RED), st.just(torch.float32),
    st.just(torch.Size([2, 3])), st.sampled_from([torch.device("cpu"), torch.strided, torch.channels_last,
                                                  slice(1, None, 2), Ellipsis]),
    st.text(min_size=190, max_size=230).map(Opaque))
_VALUES = st.recursive(_SCALARS, lambda children: st.one_of(
    st.lists(children, max_size=4), st.lists(children, max_size=4).map(tuple),
    st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), children, max_size=4),
    st.dictionaries(st.text(max_size=5), children, max_size=3).map(OrderedDict)), max_leaves=12)


@pytest.fixture(scope="module")
def native():
    return require_native()


@settings(max_examples=300, deadline=None)
@given(args=st.lists(_VALUES, max_size=5).map(tuple), kwargs=st.dictionaries(st.text(max_size=8), _VALUES, max_size=3))
def test_arguments_are_described_as_the_reference_describes_them(args, kwargs):
    native = require_native()
    described = native.describe_arguments(args, kwargs)
    assert described.isascii()
    assert json.loads(described) == json.loads(describe_arguments(args, kwargs))


def test_a_failing_repr_fails_the_description_as_in_the_reference(native):
    class Broken:
        def __repr__(self):
            raise RuntimeError("no repr")

    for describe in (native.describe_arguments, describe_arguments):
        with pytest.raises(RuntimeError, match="no repr"):
            describe((Broken(),), {})


def _site(site_of, stacks: Stacks) -> int:
    return site_of(stacks, "block")  # both backends asked from this one line


def test_call_sites_are_the_references_each_stack_formatted_once(native):
    stacks = {"native": Stacks(), "torch": Stacks()}
    ids = {name: [_site(site_of, stacks[name]) for _ in range(2)] + [site_of(stacks[name], "block")]
           for name, site_of in (("native", native.call_site), ("torch", call_site))}
    assert ids["native"] == ids["torch"] == [0, 0, 1]
    new = stacks["native"].take_new()
    assert new == stacks["torch"].take_new() and [stack_id for stack_id, _ in new] == [0, 1]
    innermost = [json.loads(frames)[-1] for _, frames in new]
    assert innermost[0].startswith(__file__) and innermost[0].endswith(" _site")
    assert innermost[1].endswith(" <dictcomp>")


def test_calls_from_one_line_share_its_call_site_after_the_first(native):
    """The native backend finds a site seen before by its instruction: two calls on one line (two
    instructions) are still the line's one site, as the reference keys it, however often seen."""
    for site_of in (native.call_site, call_site):
        stacks = Stacks()
        ids = [(site_of(stacks, "block"), site_of(stacks, "block"), site_of(stacks, "other")) for _ in range(3)]
        assert ids == [(0, 0, 1)] * 3 and len(stacks.take_new()) == 2


def test_a_call_from_hidden_frames_only_has_no_call_site(native):
    for site_of in (native.call_site, call_site):
        stacks = Stacks()
        stacks.hidden = ("",)  # every file is the machinery's
        assert site_of(stacks, "block") == -1 and not stacks.new

"""Link W version negotiation (DESIGN.md "Link W", handshake): the highest common version, or a
typed VersionMismatch."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from basertd.schema.codec import FrameError, FrameErrorCode, VersionMismatch
from basertd.schema.link import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, negotiate


def test_current_build_agrees_with_itself():
    assert negotiate(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION) == PROTOCOL_VERSION


@pytest.mark.parametrize(
    "offered,supported,expected",
    [
        ((1, 5), (3, 7), 5),  # overlap: the highest common
        ((3, 7), (1, 5), 5),
        ((2, 9), (4, 6), 6),  # one range inside the other
        ((4, 6), (2, 9), 6),
        ((1, 3), (3, 8), 3),  # touching at one version
        ((4, 4), (4, 4), 4),  # single version each
        ((4, 4), (1, 9), 4),
        ((1, 65535), (1, 65535), 65535),
    ],
)
def test_overlap(offered, supported, expected):
    assert negotiate(*offered, *supported) == expected


@pytest.mark.parametrize(
    "offered,supported",
    [
        ((1, 2), (3, 4)),  # no overlap, below
        ((5, 9), (1, 4)),  # no overlap, above
        ((2, 2), (3, 3)),  # single versions that differ
        ((3, 1), (1, 5)),  # empty offered range
        ((1, 5), (4, 2)),  # empty supported range
        ((0, 1), (1, 1)),  # version 0 does not exist
        ((1, 70000), (1, 1)),  # beyond u16
        ((-1, 1), (1, 1)),
        ((1.0, 2), (1, 2)),  # not integers
        (("1", 2), (1, 2)),
        ((True, True), (1, 1)),
    ],
)
def test_refused(offered, supported):
    with pytest.raises(VersionMismatch) as info:
        negotiate(*offered, *supported)
    assert isinstance(info.value, FrameError)
    assert info.value.code is FrameErrorCode.BAD_VERSION


@settings(max_examples=200, deadline=None)
@given(a=st.integers(1, 40), b=st.integers(1, 40), c=st.integers(1, 40), d=st.integers(1, 40))
def test_matches_set_intersection(a, b, c, d):
    common = set(range(a, b + 1)) & set(range(c, d + 1))
    if a > b or c > d or not common:
        with pytest.raises(VersionMismatch):
            negotiate(a, b, c, d)
    else:
        assert negotiate(a, b, c, d) == max(common)

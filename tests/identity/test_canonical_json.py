"""identity.signing.canonical_json: byte-identical to the ``rfc8785`` reference for every JSON value.

Signatures of records cross processes and versions: a node signs with one build, the
coordinator verifies with another, so the fast path must never change a single byte.
"""

from __future__ import annotations

import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from identity.signing import canonical_json

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=40,
)


def _reference(value: object) -> bytes | type[Exception]:
    try:
        return rfc8785.dumps(value)  # type: ignore[arg-type]
    except rfc8785.CanonicalizationError as error:
        return type(error)


def _fast(value: object) -> bytes | type[Exception]:
    try:
        return canonical_json(value)
    except rfc8785.CanonicalizationError as error:
        return type(error)


@settings(max_examples=500, deadline=None)
@given(_values)
def test_matches_rfc8785_for_any_value(value: object) -> None:
    assert _fast(value) == _reference(value)


def test_matches_rfc8785_at_the_edges() -> None:
    """The cases where stdlib json and RFC 8785 differ, or where both must fail."""
    edges: list[object] = [
        {"\ue000": 1, "\U0001f600": 2},  # UTF-16 order puts the emoji (surrogates D83D…) first
        {"b": 1, "a": [1.0, 1e21, 1e-7, -0.0, 5e-324]},  # ES6 number formatting
        {"n": 2**53 - 1, "m": -(2**53 - 1)},  # the largest safe integers: stdlib path
        {"n": 2**53},  # unsafe integer: rfc8785 refuses it
        {"s": '\x00\x1f\x7f\b\f\n\r\t"\\/\u2028\u2029é\U0001f600'},
        {"s": "\ud800"},  # a lone surrogate is not Unicode text: refused
        {"t": (1, "x")},  # tuples are arrays
    ]
    for value in edges:
        assert _fast(value) == _reference(value), value

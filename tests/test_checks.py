"""_checks: each helper accepts exactly what it promises, and raises the documented exception type
(TypeError for the wrong kind of object, ValueError for a bad value of the right kind) with a message
naming the argument and the value. The reference is a plain restatement of each rule."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mini_transformer import _checks as checks

# anything a user might pass: every helper must either accept it or raise TypeError/ValueError, never crash
anything = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
    st.lists(st.integers(-3, 300), max_size=4), st.tuples(st.integers()),
    st.dictionaries(st.text(max_size=2), st.integers()),
)


def outcome(fn, *args, **kwargs):
    """The exception type raised (after checking its message names the argument), or None."""
    try:
        fn(*args, **kwargs)
    except (TypeError, ValueError) as err:
        assert "arg" in str(err), str(err)  # every message names the argument
        return type(err)
    return None


def is_int(v):
    return type(v) is int


def is_number(v):
    return type(v) in (int, float)


@given(anything, st.one_of(st.none(), st.integers(-5, 5)), st.one_of(st.none(), st.integers(-5, 5)))
def test_integer_matches_the_rule(value, low, high):
    expected = (TypeError if not is_int(value) else
                ValueError if (low is not None and value < low) or (high is not None and value > high) else None)
    assert outcome(checks.integer, "arg", value, low=low, high=high) is expected
    if expected is None:
        assert checks.integer("arg", value, low=low, high=high) == value


@given(anything)
def test_positive_and_non_negative_int(value):
    kind = None if is_int(value) else TypeError
    assert outcome(checks.positive_int, "arg", value) is (kind or (None if value >= 1 else ValueError))
    assert outcome(checks.non_negative_int, "arg", value) is (kind or (None if value >= 0 else ValueError))


@given(anything, st.booleans(), st.booleans())
def test_probability_matches_the_rule(value, zero, one):
    if not is_number(value):
        expected = TypeError
    else:
        inside = (0 <= value if zero else 0 < value) and (value <= 1 if one else value < 1)
        expected = None if math.isfinite(value) and inside else ValueError
    assert outcome(checks.probability, "arg", value, zero=zero, one=one) is expected


@given(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-10, 10))
def test_number_refuses_nan_and_infinity_even_without_bounds(value):
    assert outcome(checks.number, "arg", value) is (None if math.isfinite(value) else ValueError)
    assert outcome(checks.positive_number, "arg", value) is (None if math.isfinite(value) and value > 0 else ValueError)


@given(anything)
def test_boolean_and_string(value):
    assert outcome(checks.boolean, "arg", value) is (None if type(value) is bool else TypeError)
    assert outcome(checks.string, "arg", value) is (None if type(value) is str else TypeError)
    if type(value) is str:
        assert outcome(checks.string, "arg", value, empty=False) is (None if value else ValueError)


@given(anything)
def test_choice_is_a_value_check_whatever_the_kind(value):
    choices = ("a", "b", 3)
    expected = None if any(value == c for c in choices) else ValueError
    assert outcome(checks.choice, "arg", value, choices) is expected


@given(st.integers(-4, 300))
def test_power_of_two(value):
    good = value >= 16 and (value & (value - 1)) == 0
    assert outcome(checks.power_of_two, "arg", value, low=16) is (None if good else ValueError)


@given(anything, st.integers(1, 300))
def test_token_ids_matches_the_rule(ids, vocab):
    if not isinstance(ids, list | tuple):
        expected = TypeError
    elif not ids or not all(is_int(t) and 0 <= t < vocab for t in ids):
        expected = ValueError
    else:
        expected = None
    assert outcome(checks.token_ids, "arg", ids, vocab) is expected
    if expected is None:
        assert checks.token_ids("arg", ids, vocab) == list(ids)


def test_token_ids_takes_1d_integer_tensors_only():
    assert checks.token_ids("arg", torch.tensor([1, 2]), 5) == [1, 2]
    for bad in (torch.tensor([[1, 2]]), torch.tensor([1.0]), torch.tensor([True])):
        assert outcome(checks.token_ids, "arg", bad, 5) is ValueError
    assert outcome(checks.token_ids, "arg", torch.tensor([7]), 5) is ValueError
    assert checks.token_ids("arg", [], 5, empty=True) == []


def test_messages_name_the_value_and_what_was_expected():
    with pytest.raises(ValueError, match=r"max_tokens=0 must be a positive integer"):
        checks.positive_int("max_tokens", 0)
    with pytest.raises(TypeError, match=r"seed='x' must be an int, got str"):
        checks.integer("seed", "x")
    with pytest.raises(TypeError, match=r"n=True must be an int, got bool"):
        checks.positive_int("n", True)
    with pytest.raises(ValueError, match=r"top_p=0 must be in \(0, 1\]"):
        checks.probability("top_p", 0, zero=False)
    with pytest.raises(ValueError, match=r"norm='x' is not known; expected one of a, b"):
        checks.choice("norm", "x", ("a", "b"))
    with pytest.raises(ValueError, match=r"ids contains 9, expected token ids in \[0, vocab_size=5\)"):
        checks.token_ids("ids", [1, 9], 5)
    with pytest.raises(ValueError, match=r"eos=5 must be a token id in \[0, vocab_size=5\)"):
        checks.token_id("eos", 5, 5)
    with pytest.raises(TypeError, match="model must be a int or str, got list"):
        checks.instance("model", [], (int, str))

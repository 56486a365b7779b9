"""The expert layout, expert ids and the checks of a call's body."""

import numpy as np
import pytest
from pydantic import ValidationError

from crowdtrain.core.experts import ExpertLayout, encode_call, layout_has, parse_uid, read_call
from crowdtrain.core.tensors import TensorFormatError, encode

LAYOUT = ExpertLayout(layers=2, grid=[4, 4], dim=8, hidden=16, k=4, k_min=2, max_rows=32)


def test_a_layout_lists_one_expert_per_grid_coordinate_of_each_layer() -> None:
    uids = LAYOUT.uids(1)
    assert len(uids) == 16 and uids[0] == "1.0.0" and uids[-1] == "1.3.3"
    assert parse_uid("1.3.2") == (1, (3, 2))
    assert layout_has(LAYOUT, "1.3.3") and not layout_has(LAYOUT, "2.0.0") and not layout_has(LAYOUT, "0.4.0")
    assert not layout_has(LAYOUT, "0.1") and not layout_has(LAYOUT, "0.1.1.1")


@pytest.mark.parametrize("uid", ["", "a.b", "1", "1.", "1..2", "-1.0", "1.0 ", "9" * 30 + ".1"])
def test_anything_else_is_not_an_expert_id(uid: str) -> None:
    with pytest.raises(ValueError, match="not an expert id"):
        parse_uid(uid)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"k": 3, "k_min": 4}, "k_min"),
        ({"grid": [2, 2], "k": 5}, "above the 4 experts"),
        ({"grid": [300]}, "grid sizes"),
        ({"grid": []}, "at least 1"),
        ({"nonsense": 1}, "Extra inputs"),
    ],
)
def test_a_layout_that_cannot_work_is_refused_with_its_reason(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ExpertLayout(**fields)


def test_a_call_body_is_read_back_as_sent() -> None:
    x, g = np.random.default_rng(0).normal(size=(2, 5, 8)).astype(np.float32)
    got = read_call(encode_call(x=x, grad_y=g), ("x", "grad_y"), 8, 32)
    assert np.array_equal(got["x"], x) and np.array_equal(got["grad_y"], g)


ROWS = np.ones((3, 8), np.float32)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (encode({"x": ROWS, "extra": ROWS}), "more than 1 tensors"),  # bounded before it is parsed
        (encode({"y": ROWS}), "carries tensors"),
        (encode({"x": ROWS.astype(np.float64)}), "dtype float64"),
        (encode({"x": np.ones((3, 7), np.float32)}), r"expected \[rows, 8\]"),
        (encode({"x": np.ones((3, 8, 1), np.float32)}), r"expected \[rows, 8\]"),
        (encode({"x": np.ones((33, 8), np.float32)}), "1 to 32 rows"),
        (encode({"x": np.ones((0, 8), np.float32)}), "1 to 32 rows"),
        (encode({"x": np.full((3, 8), np.nan, np.float32)}), "NaN"),
        (encode({"x": np.full((3, 8), np.inf, np.float32)}), "NaN or infinite"),
    ],
)
def test_a_call_body_that_is_not_what_the_expert_takes_is_refused(body: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_call(body, ("x",), 8, 32)


def test_rows_must_agree_between_the_tensors_of_a_backward_call() -> None:
    with pytest.raises(ValueError, match="the same in every tensor"):
        read_call(encode_call(x=ROWS, grad_y=ROWS[:2]), ("x", "grad_y"), 8, 32)


@pytest.mark.parametrize("body", [b"", b"\x00" * 7, b"garbage" * 10, (10**9).to_bytes(8, "little") + b"{}"])
def test_a_body_that_is_not_safetensors_is_a_format_error(body: bytes) -> None:
    with pytest.raises(TensorFormatError):
        read_call(body, ("x",), 8, 32)

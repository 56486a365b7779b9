"""crowdtrain.core.updates: each encoding's round trip within its stated error, and every malformed blob
refused with a message that names the problem."""

from collections.abc import Callable

import numpy as np
import pytest
import torch
from safetensors.numpy import save
from safetensors.torch import load as torch_load

from crowdtrain.core.tensors import TensorFormatError, encode, header_limits, manifest_of
from crowdtrain.core.updates import (
    SCALE_SUFFIX,
    decode_result,
    decode_update,
    encode_result,
    encode_update,
    expected_upload_bytes,
    quantize_int8,
    upload_label,
    upload_sizes,
    upload_spec,
    wire_manifest,
)
from crowdtrain.core.zoo import build_model, state_to_numpy

INT8 = {"send": "delta", "dtype": "int8"}
INT8_BLOCKS = {"send": "delta", "dtype": "int8", "block_size": 64}
BF16 = {"send": "delta", "dtype": "bfloat16"}
F32 = {"send": "delta", "dtype": "float32"}
WEIGHTS = {"send": "weights", "dtype": "float32"}
ALL = [WEIGHTS, F32, BF16, INT8, INT8_BLOCKS]


def _model(seed: int = 0) -> tuple[dict, dict]:
    """(W_base, W_c): floats of very different magnitudes, an empty and an all-zero update, and an
    integer counter that training moved."""
    rng = np.random.default_rng(seed)
    base = {
        "conv.weight": rng.normal(size=(8, 4, 5)).astype(np.float32),
        "fc.weight": rng.normal(size=(10, 101)).astype(np.float32),
        "fc.bias": rng.normal(size=(10,)).astype(np.float32),
        "empty": np.zeros((0, 3), np.float32),
        "frozen": np.ones((7,), np.float32),
        "bn.num_batches_tracked": np.array(12, np.int64),
    }
    client = {k: v.copy() for k, v in base.items()}
    client["conv.weight"] += (0.05 * rng.normal(size=(8, 4, 5))).astype(np.float32)
    # Magnitudes from 1e-6 to 1 within one tensor: what per-block scales are for.
    client["fc.weight"] += (rng.normal(size=(10, 101)) * np.logspace(-6, 0, 1010).reshape(10, 101)).astype(np.float32)
    client["fc.bias"] += np.float32(1e-3)
    client["bn.num_batches_tracked"] = np.array(44, np.int64)
    return base, client


def _delta(base: dict, client: dict) -> dict:
    return {k: client[k] - base[k] for k in base if base[k].dtype.kind == "f"}


@pytest.mark.parametrize("upload", [F32, WEIGHTS])
def test_float32_round_trips_exactly(upload) -> None:
    base, client = _model()
    carried = decode_update(encode_result(client, base, upload), manifest_of(base), upload)
    expected = client if upload["send"] == "weights" else {**client, **_delta(base, client)}
    for name, value in expected.items():
        assert carried[name].dtype == value.dtype and np.array_equal(carried[name], value), name


@pytest.mark.parametrize("upload", [INT8, INT8_BLOCKS])
def test_int8_round_trip_is_within_half_a_step_of_its_block(upload) -> None:
    """|Δ − decoded| <= scale · (1/2 + 2^-16) for every value, with its own block's scale
    (scale = max|Δ_block| / 127): half a quantization step plus float32 rounding."""
    base, client = _model()
    delta = _delta(base, client)
    wire = encode_update(delta, upload)
    carried = decode_update(encode_result(client, base, upload), manifest_of(base), upload)
    bs = upload.get("block_size")
    for name, d in delta.items():
        scales = wire[name + SCALE_SUFFIX]
        flat = d.ravel()
        blocks = [flat] if bs is None else [flat[i : i + bs] for i in range(0, flat.size, bs)]
        assert len(scales) == (1 if bs is None else len(blocks))
        np.testing.assert_allclose(scales, [np.abs(b).max(initial=0) / 127 for b in blocks], rtol=1e-6)
        per_value = np.repeat(scales, bs)[: flat.size] if bs else np.full(flat.size, scales[0])
        err = np.abs(carried[name].ravel() - flat)
        assert (err <= per_value * (0.5 + 2**-16)).all(), name
    assert np.array_equal(carried["frozen"], np.zeros(7, np.float32)), "a zero update decodes to exactly zero"


def test_per_block_scales_keep_small_updates_that_one_scale_per_tensor_rounds_to_zero() -> None:
    base, client = _model()
    small = _delta(base, client)["fc.weight"].ravel()[:64]  # the first block: |Δ| around 1e-6
    decoded = {}
    for upload in (INT8, INT8_BLOCKS):
        decoded[upload.get("block_size")] = decode_update(
            encode_result(client, base, upload), manifest_of(base), upload
        )["fc.weight"].ravel()[:64]
    assert not decoded[None].any()
    assert np.abs(decoded[64] - small).max() <= np.abs(small).max() / 254 * 1.001


def test_bfloat16_rounds_to_nearest_even_within_its_relative_error() -> None:
    """|Δ − decoded| <= 2^-8 · |Δ| (8 significant bits, round to nearest even), bit for bit what
    torch's own float32 -> bfloat16 conversion gives; any safetensors reader sees BF16 tensors."""
    base, client = _model()
    delta = _delta(base, client)
    blob = encode_result(client, base, BF16)
    carried = decode_update(blob, manifest_of(base), BF16)
    theirs = torch_load(blob)
    for name, d in delta.items():
        assert (np.abs(carried[name] - d) <= np.abs(d) * 2**-8).all(), name
        assert theirs[name].dtype == torch.bfloat16
        assert torch.equal(theirs[name], torch.from_numpy(d).to(torch.bfloat16)), name
    ties = np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)  # exactly halfway: to the even neighbour
    assert encode_update({"t": ties}, BF16)["t"].astype(np.float32).tolist() == [1.0, 1 + 2**-6]


@pytest.mark.parametrize("upload", ALL, ids=lambda u: "/".join(map(str, u.values())))
def test_integer_tensors_travel_as_they_are_and_w_c_is_base_plus_delta(upload) -> None:
    base, client = _model()
    manifest = manifest_of(base)
    w_c = decode_result(encode_result(client, base, upload), manifest, upload, base)
    assert manifest_of(w_c) == manifest
    assert w_c["bn.num_batches_tracked"] == 44
    bound = {"float32": 1e-6, "bfloat16": 2**-8, "int8": 1 / 127}[upload["dtype"]]
    for name, d in _delta(base, client).items():
        # Relative to the largest |Δ| of the tensor, loose enough for every encoding's own bound.
        assert np.abs(w_c[name] - client[name]).max(initial=0) <= bound * np.abs(d).max(initial=0) + 1e-6, name


def _wire(upload: dict) -> dict:
    base, client = _model()
    carried = {k: v for k, v in client.items() if v.dtype.kind != "f"}
    return {**carried, **encode_update(_delta(base, client), upload)}


def _set(w: dict, name: str, value) -> None:
    w[name] = value


def _set_first(w: dict, name: str, value) -> None:
    w[name].flat[0] = value


def _to_infinity(w: dict) -> None:
    w["fc.weight" + SCALE_SUFFIX][0] = np.float32(3e38)
    w["fc.weight"].flat[0] = 127


S = SCALE_SUFFIX
# Each kind of malformed upload: how it changes a well-formed wire dict.
MALFORM: dict[str, Callable[[dict], None]] = {
    "missing scale": lambda w: w.pop("fc.weight" + S),
    "missing tensor": lambda w: [w.pop("fc.bias"), w.pop("fc.bias" + S)],
    "extra tensor": lambda w: _set(w, "fc.extra", np.zeros(3, np.float32)),
    "extra scale": lambda w: _set(w, "fc.weight" + S + S, w.pop("bn.num_batches_tracked").reshape(1)),
    "wrong dtype": lambda w: _set(w, "fc.weight", w["fc.weight"].astype(np.float32)),
    "wrong scale dtype": lambda w: _set(w, "fc.weight" + S, w["fc.weight" + S].astype(np.float64)),
    "wrong shape": lambda w: _set(w, "fc.weight", w["fc.weight"].reshape(101, 10)),
    "integer tensor as float": lambda w: _set(w, "bn.num_batches_tracked", np.array(44.0, np.float32)),
    "NaN scale": lambda w: _set_first(w, "fc.weight" + S, np.nan),
    "negative scale": lambda w: _set_first(w, "fc.weight" + S, -1.0),
    "wrong block count": lambda w: _set(w, "fc.weight" + S, w["fc.weight" + S][:-1]),
    "int8 -128": lambda w: _set_first(w, "fc.weight", -128),
    "decodes to infinity": _to_infinity,
    "bfloat16 infinity": lambda w: _set_first(w, "fc.bias", np.inf),
}


def _malformed(kind: str) -> tuple[dict, bytes]:
    upload = INT8_BLOCKS if kind == "wrong block count" else (BF16 if kind == "bfloat16 infinity" else INT8)
    w = _wire(upload)
    MALFORM[kind](w)
    return upload, save({k: np.ascontiguousarray(v).reshape(v.shape) for k, v in w.items()})


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("missing scale", "missing ['fc.weight.__scale__']"),
        ("missing tensor", "missing ['fc.bias'"),
        ("extra tensor", "more than 11 tensors"),  # refused before the header is parsed
        ("extra scale", "unexpected ['fc.weight.__scale__.__scale__']"),
        ("wrong dtype", "'fc.weight' has dtype float32, expected int8"),
        ("wrong scale dtype", "'fc.weight.__scale__' has dtype float64, expected float32"),
        ("wrong shape", "'fc.weight' has shape [101, 10], expected [10, 101]"),
        ("integer tensor as float", "'bn.num_batches_tracked' has dtype float32, expected int64"),
        ("NaN scale", "'fc.weight' has a scale that is negative, NaN or infinite"),
        ("negative scale", "'fc.weight' has a scale that is negative"),
        ("wrong block count", "'fc.weight.__scale__' has shape [15], expected [16]"),
        ("int8 -128", "-128"),
        ("decodes to infinity", "'fc.weight' decodes to NaN or infinite"),
        ("bfloat16 infinity", "'fc.bias' decodes to NaN or infinite"),
    ],
)
def test_a_malformed_update_is_refused_naming_the_problem(kind: str, words: str) -> None:
    base, _ = _model()
    upload, blob = _malformed(kind)
    with pytest.raises(ValueError) as exc:
        decode_result(blob, manifest_of(base), upload, base)
    assert words in str(exc.value)
    assert "delta/" in str(exc.value), "the message says which encoding was expected"


def test_weights_where_a_delta_is_announced_are_refused() -> None:
    base, client = _model()
    with pytest.raises(ValueError, match="'conv.weight' has dtype float32, expected bfloat16"):
        decode_result(encode(client), manifest_of(base), BF16, base)
    with pytest.raises(ValueError, match=r"missing \['conv.weight.__scale__'"):
        decode_result(encode(client), manifest_of(base), INT8, base)


def test_base_plus_delta_that_overflows_is_refused() -> None:
    base, client = _model()
    big = {k: (v + np.float32(3e38)) if v.dtype.kind == "f" else v for k, v in base.items()}
    blob = encode_result({**client, "fc.bias": np.full(10, 3.4e38, np.float32)}, base, F32)
    with pytest.raises(ValueError, match="'fc.bias' contains NaN or infinite"):
        decode_result(blob, manifest_of(base), F32, big)


@pytest.mark.parametrize("upload", ALL, ids=lambda u: "/".join(map(str, u.values())))
def test_a_header_past_the_bound_is_refused_before_it_is_parsed(upload) -> None:
    base, client = _model()
    manifest = manifest_of(base)
    honest = encode_result(client, base, upload)
    assert len(honest) <= expected_upload_bytes(manifest, upload)
    header_bound = header_limits(wire_manifest(manifest, upload))[0]
    bloated = (header_bound + 1).to_bytes(8, "little") + b"{" + b" " * header_bound + honest[8:]
    with pytest.raises(TensorFormatError, match="exceeds the limit"):
        decode_update(bloated, manifest, upload)
    with pytest.raises(TensorFormatError, match="not a safetensors"):
        decode_update(b"\x80\x04 a pickle" * 10, manifest, upload)


def test_int8_takes_a_quarter_to_three_tenths_of_float32_and_bfloat16_half() -> None:
    """Bytes of one upload of the example job's model (cnn1d on mnist1d), headers included."""
    manifest = manifest_of(state_to_numpy(build_model("cnn1d", [40], 10, channels=32, kernel_size=5, layers=3)))
    sizes = upload_sizes(manifest)
    f32 = sizes["weights/float32"]
    assert sizes["delta/float32"] == f32
    assert 0.49 <= sizes["delta/bfloat16"] / f32 <= 0.52
    assert 0.25 <= sizes["delta/int8"] / f32 <= 0.3
    assert 0.25 <= sizes["delta/int8/block64"] / f32 <= 0.3
    base = {name: np.zeros(shape, dtype) for name, (shape, dtype) in manifest.items()}
    for upload in ALL:
        blob = encode_result(base, base, upload)
        assert len(blob) == sizes[upload_label(upload)]
        assert len(blob) <= expected_upload_bytes(manifest, upload)


def test_quantize_handles_empty_and_all_zero_tensors() -> None:
    for bs in (None, 16):
        q, scales = quantize_int8(np.zeros((0, 4), np.float32), bs)
        assert q.shape == (0, 4) and len(scales) == (1 if bs is None else 0)
        q, scales = quantize_int8(np.zeros(20, np.float32), bs)
        assert not q.any() and not scales.any() and len(scales) == (1 if bs is None else 2)


def test_upload_spec_defaults_to_weights_and_refuses_bad_fields() -> None:
    assert upload_spec(None).send == "weights" and upload_spec({}).dtype == "float32"
    with pytest.raises(ValueError, match="needs send: delta"):
        upload_spec({"send": "weights", "dtype": "int8"})
    with pytest.raises(ValueError):
        upload_spec({"send": "delta", "dtype": "int4"})

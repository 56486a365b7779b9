"""Results on the wire: a client's weights W_c, or its update Δ = W_c − W_base encoded as float32,
bfloat16 or int8, as the job's `assimilation.upload` (crowdtrain.core.assimilationspec.UploadSpec) says; and the
validated decode back to W_c that the scheduler and the parameter servers run. No I/O.

A result is one safetensors blob whose tensors are named after the model's (its manifest):
- `send: weights`: W_c in the model's own dtypes, as ever (`dtype` is always float32 then);
- `send: delta`: each floating-point tensor carries Δ as F32, BF16 (rounded to nearest even) or I8.
  With I8, `<name>.__scale__` (F32, shape [blocks]) goes with it: one block for the whole tensor
  (`block_size` null) or `block_size` consecutive values of the flattened tensor, the last block
  shorter. Symmetric quantization: scale = max|Δ_block| / 127, q = round(Δ / scale) in [-127, 127],
  Δ ≈ q · scale (PRIME's int8 pseudo-gradients, INTELLECT-1);
- tensors that are not floating point (BatchNorm's integer counters) carry the client's own value in
  the model's dtype, whatever is sent.

Error of one round trip, for each value x of Δ: float32 none; bfloat16 |err| <= 2^-8 · |x| (normal
numbers); int8 |err| <= scale · (1/2 + 2^-16) with the scale of x's block (half a step, plus float32
rounding). Rounding is to nearest, not stochastic: one update's error is bounded and is not carried
into the next (the server applies each Δ once), so an unbiased but twice as large error buys nothing.
"""

import math
from typing import Any

import numpy as np
from safetensors.numpy import save as _st_save

from crowdtrain.core.assimilationspec import UploadSpec
from crowdtrain.core.tensors import (
    Manifest,
    Params,
    TensorFormatError,
    bfloat16,
    check_against_manifest,
    check_layout,
    encode,
    header_limits,
    views,
)

SCALE_SUFFIX = ".__scale__"
INT8_MAX = 127

# The encodings `upload_sizes` compares by default (benchmarks report bytes per upload for each).
STANDARD_UPLOADS: tuple[dict[str, Any], ...] = (
    {"send": "weights", "dtype": "float32"},
    {"send": "delta", "dtype": "float32"},
    {"send": "delta", "dtype": "bfloat16"},
    {"send": "delta", "dtype": "int8"},
    {"send": "delta", "dtype": "int8", "block_size": 64},
)


def upload_spec(upload: UploadSpec | dict[str, Any] | None) -> UploadSpec:
    """The upload spec from a job spec's `assimilation.upload` (None or {}: weights as float32, as
    jobs stored before the field had); ValueError (pydantic's) names a bad field."""
    return upload if isinstance(upload, UploadSpec) else UploadSpec.model_validate(upload or {})


def upload_of(assimilation: dict[str, Any]) -> UploadSpec:
    """The upload spec of a stored job spec's `assimilation` section."""
    return upload_spec(assimilation.get("upload"))


def upload_label(upload: UploadSpec | dict[str, Any] | None) -> str:
    """A short name for an encoding: weights/float32, delta/int8, delta/int8/block64, ..."""
    u = upload_spec(upload)
    return f"{u.send}/{u.dtype}" + (f"/block{u.block_size}" if u.block_size else "")


def _floating(dtype: str) -> bool:
    return np.dtype(dtype).kind == "f"


def _blocks(shape: list[int], block_size: int | None) -> int:
    return 1 if block_size is None else -(-math.prod(shape) // block_size)


def wire_manifest(manifest: dict[str, Any], upload: UploadSpec | dict[str, Any] | None) -> Manifest:
    """Name -> (shape, dtype name) of every tensor a result encoded per `upload` has: no more, no fewer."""
    u = upload_spec(upload)
    if u.send == "weights":
        return {name: (list(shape), dtype) for name, (shape, dtype) in manifest.items()}
    out: Manifest = {}
    for name, (shape, dtype) in manifest.items():
        if not _floating(dtype):
            out[name] = (list(shape), dtype)
            continue
        out[name] = (list(shape), u.dtype)  # the dtype names are numpy's
        if u.dtype == "int8":
            if name + SCALE_SUFFIX in manifest:
                raise ValueError(f"the model has a tensor {name + SCALE_SUFFIX!r}, the name of {name!r}'s scales")
            out[name + SCALE_SUFFIX] = ([_blocks(shape, u.block_size)], "float32")
    return out


def expected_upload_bytes(manifest: dict[str, Any], upload: UploadSpec | dict[str, Any] | None) -> int:
    """The largest blob that can be a valid result: 8 length bytes, the header bound the decoder
    enforces (crowdtrain.core.tensors.header_limits) and the tensors' data. An honest result is smaller."""
    wire = wire_manifest(manifest, upload)
    data = sum(math.prod(shape) * np.dtype(_np_dtype(dtype)).itemsize for shape, dtype in wire.values())
    return 8 + header_limits(wire)[0] + data


def _np_dtype(dtype: str) -> np.dtype:
    return bfloat16() if dtype == "bfloat16" else np.dtype(dtype)


# -- encoding (the client) -------------------------------------------------------------------------


def quantize_int8(x: np.ndarray, block_size: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(q, scales): int8 q of x's shape and float32 scales, one per block of the flattened x."""
    flat = np.asarray(x, np.float32).ravel()
    nb = _blocks(list(x.shape), block_size)
    size = flat.size if block_size is None else block_size
    padded = np.zeros(nb * size, np.float32)
    padded[: flat.size] = flat
    blocks = padded.reshape(nb, size)
    scales = (np.abs(blocks).max(axis=1, initial=0.0) / INT8_MAX).astype(np.float32)
    safe = np.where(scales > 0, scales, 1.0).astype(np.float32)[:, None]
    q = np.clip(np.rint(blocks / safe), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q.ravel()[: flat.size].reshape(x.shape), scales


def dequantize_int8(q: np.ndarray, scales: np.ndarray, block_size: int | None) -> np.ndarray:
    """float32 q · scale, each value with its block's scale."""
    per_value = scales[0] if block_size is None else np.repeat(scales, block_size)[: q.size].reshape(q.shape)
    out: np.ndarray = q.astype(np.float32) * per_value
    return out


def encode_update(delta: Params, upload: UploadSpec | dict[str, Any] | None) -> Params:
    """The tensors that carry `delta` (float tensors only) per `upload`'s dtype, scales included."""
    u = upload_spec(upload)
    out: Params = {}
    for name, d in delta.items():
        d = np.asarray(d, np.float32)
        if u.dtype == "float32":
            out[name] = d
        elif u.dtype == "bfloat16":
            out[name] = d.astype(bfloat16())  # ml_dtypes rounds to nearest even
        else:
            out[name], out[name + SCALE_SUFFIX] = quantize_int8(d, u.block_size)
    return out


def encode_result(params: Params, base: Params, upload: UploadSpec | dict[str, Any] | None) -> bytes:
    """The upload body for a client that trained `base` (the snapshot it decoded) into `params`:
    W_c itself, or Δ = W_c − W_base for every float tensor plus the others as they are."""
    u = upload_spec(upload)
    if u.send == "weights":
        return encode(params)
    floats = {k for k, v in params.items() if v.dtype.kind == "f"}
    for k in floats:  # the snapshot came from the server: never broadcast a mismatch into a larger array
        if k not in base or np.shape(base[k]) != np.shape(params[k]):
            raise ValueError(f"tensor {k!r}: the snapshot has no tensor of shape {list(np.shape(params[k]))}")
    delta = {k: np.asarray(params[k], np.float32) - np.asarray(base[k], np.float32) for k in floats}
    wire = {**{k: v for k, v in params.items() if k not in floats}, **encode_update(delta, u)}
    return _st_save({k: np.ascontiguousarray(v).reshape(np.shape(v)) for k, v in wire.items()})


# -- decoding (the scheduler and the parameter servers) ----------------------------------------------


def decode_update(
    blob: bytes | bytearray | memoryview, manifest: dict[str, Any], upload: UploadSpec | dict[str, Any] | None
) -> Params:
    """What a result carries, validated and widened: W_c for weights uploads; for delta uploads Δ as
    float32 for each float tensor and the client's own value of each other tensor.

    Raises TensorFormatError (not safetensors, or a header past the bounds the manifest allows,
    checked before it is parsed) or ValueError naming the tensor: a name missing or unexpected, a
    wrong shape or dtype for this encoding, a scale that is negative or not finite, an int8 value
    outside [-127, 127], a decoded value that is NaN or infinite. Arrays may view `blob`.
    """
    u = upload_spec(upload)
    wire = wire_manifest(manifest, u)
    what = f"a {upload_label(u)} upload"
    try:
        tensors = views(blob, *header_limits(wire))
    except TensorFormatError as exc:
        raise TensorFormatError(f"{what}: {exc}") from None
    if u.send == "weights":
        check_against_manifest(tensors, manifest)
        return tensors
    check_layout(tensors, wire, what)
    out: Params = {}
    for name, (_, dtype) in manifest.items():
        arr = tensors[name]
        if not _floating(dtype):
            out[name] = arr
            continue
        if u.dtype == "int8":
            scales = tensors[name + SCALE_SUFFIX]
            if not (np.isfinite(scales).all() and (scales >= 0).all()):
                raise ValueError(f"{what}: tensor {name!r} has a scale that is negative, NaN or infinite")
            if arr.size and arr.min() < -INT8_MAX:
                raise ValueError(f"{what}: tensor {name!r} has the value -128, outside [-127, 127]")
            with np.errstate(over="ignore"):  # an overflow is refused just below, by name
                arr = dequantize_int8(arr, scales, u.block_size)
        else:
            arr = arr.astype(np.float32, copy=False)
        if not np.isfinite(arr).all():
            raise ValueError(f"{what}: tensor {name!r} decodes to NaN or infinite values")
        out[name] = arr
    return out


def decode_result(
    blob: bytes | bytearray | memoryview,
    manifest: dict[str, Any],
    upload: UploadSpec | dict[str, Any] | None,
    base: Params,
) -> Params:
    """W_c from a result: the weights themselves, or W_base + Δ in the model's dtypes, where `base` is
    the snapshot the host started from. Raises like `decode_update`, and ValueError when W_base + Δ
    is not finite."""
    u = upload_spec(upload)
    carried = decode_update(blob, manifest, u)
    if u.send == "weights":
        return carried
    client = {}
    with np.errstate(over="ignore"):  # an overflow is refused just below, by name
        for name, (_, dtype) in manifest.items():
            arr = carried[name]
            client[name] = (
                (np.asarray(base[name], np.float32) + arr).astype(dtype, copy=False) if _floating(dtype) else arr
            )
    check_against_manifest(client, manifest)
    return client


def upload_sizes(
    manifest: dict[str, Any], uploads: tuple[UploadSpec | dict[str, Any], ...] = STANDARD_UPLOADS
) -> dict[str, int]:
    """Bytes of one upload for each encoding (label -> bytes), for a model with this manifest. Exact:
    a blob's size depends on the names, shapes and encoding only, not on the values."""
    zeros = {name: np.zeros(shape, _np_dtype(dtype)) for name, (shape, dtype) in manifest.items()}
    return {upload_label(u): len(encode_result(zeros, zeros, u)) for u in uploads}

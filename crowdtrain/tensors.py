"""Tensor codec: named numpy arrays <-> safetensors bytes, and content hashes."""

import hashlib
import io

import numpy as np
from safetensors.numpy import load as _st_load
from safetensors.numpy import save as _st_save

Params = dict[str, np.ndarray]


class TensorFormatError(ValueError):
    """The bytes are not a safetensors file."""


def encode(params: Params) -> bytes:
    return _st_save({k: np.ascontiguousarray(v) for k, v in params.items()})


def decode(blob: bytes) -> Params:
    try:
        return _st_load(blob)
    except Exception as exc:  # safetensors raises its own SafetensorError and others
        raise TensorFormatError(f"not a safetensors file: {exc}") from exc


def sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


Manifest = dict[str, tuple[list[int], str]]


def manifest_of(params: Params) -> Manifest:
    """Name -> (shape, dtype name); what every result must match."""
    return {k: (list(v.shape), str(v.dtype)) for k, v in params.items()}


def check_against_manifest(params: Params, manifest: dict) -> None:
    """Raise ValueError naming the first mismatch of names, shapes, dtypes or non-finite values."""
    missing = sorted(set(manifest) - set(params))
    extra = sorted(set(params) - set(manifest))
    if missing or extra:
        raise ValueError(f"tensor names differ from the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, (shape, dtype) in manifest.items():
        arr = params[name]
        if list(arr.shape) != list(shape):
            raise ValueError(f"tensor {name!r} has shape {list(arr.shape)}, the model has {list(shape)}")
        if str(arr.dtype) != dtype:
            raise ValueError(f"tensor {name!r} has dtype {arr.dtype}, the model has {dtype}")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise ValueError(f"tensor {name!r} contains NaN or infinite values")


def encode_shard(x: np.ndarray, y: np.ndarray) -> bytes:
    """A training shard on the wire: an uncompressed npz with arrays `x` and `y`."""
    buf = io.BytesIO()
    np.savez(buf, x=x, y=y)
    return buf.getvalue()


def decode_shard(blob: bytes) -> tuple[np.ndarray, np.ndarray]:
    with np.load(io.BytesIO(blob), allow_pickle=False) as f:
        return f["x"], f["y"]

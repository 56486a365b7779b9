"""The digest of a result's weights: the same weights give the same digest however they travelled."""

import numpy as np
from safetensors.numpy import save

from crowdtrain.core.digests import weights_digest
from crowdtrain.core.tensors import manifest_of, views
from crowdtrain.core.updates import decode_result, encode_result


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "b.weight": rng.standard_normal((4, 3)).astype(np.float32),
        "a.bias": rng.standard_normal(3).astype(np.float32),
        "n.count": np.array(7, np.int64),
    }


def test_the_same_weights_digest_alike_however_they_travelled() -> None:
    w = _weights()
    base = {k: np.zeros_like(v) for k, v in w.items()}
    reordered = views(save(dict(reversed(list(w.items()))), metadata={"by": "another client"}))
    via_delta = decode_result(
        encode_result(w, base, {"send": "delta", "dtype": "float32"}),
        manifest_of(w),
        {"send": "delta", "dtype": "float32"},
        base,
    )
    assert weights_digest(w) == weights_digest(reordered) == weights_digest(via_delta)


def test_different_weights_or_names_digest_apart() -> None:
    w = _weights()
    nudged = {**w, "a.bias": np.nextafter(w["a.bias"], np.inf)}
    renamed = {("c.bias" if k == "a.bias" else k): v for k, v in w.items()}
    assert len({weights_digest(w), weights_digest(nudged), weights_digest(renamed)}) == 3

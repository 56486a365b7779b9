"""Expert-parallel training's vocabulary (Learning@home, Ryabinin & Gusev 2020): the layout of a
model's mixture-of-experts layers, expert ids, the experts' architecture and the wire format of a
call to an expert. No I/O.

The experts' modules are the client's (crowdtrain.client.experts.expert): this module imports no
framework, so that the scheduler and a job's spec can use it.

An expert is named by its layer and its coordinates on the layer's grid: `"1.3.0"` is layer 1,
coordinates (3, 0) of a 4x4 grid. A call carries one tensor per argument in a safetensors body:
forward sends `x` [rows, dim] and gets `y` [rows, dim]; backward sends `x` and `grad_y` and gets
`grad_x`. Both sides bound the body before parsing it and check names, shapes, dtype and finiteness
(`read_call`), so neither a host nor a trainer has to trust the other's bytes.
"""

import math
import re

import numpy as np
from pydantic import Field, model_validator

from crowdtrain.core.specfile import SpecSection
from crowdtrain.core.tensors import decode, encode, views

FORWARD_ARGS = ("x",)
BACKWARD_ARGS = ("x", "grad_y")
_UID = re.compile(r"^(\d{1,4})((?:\.\d{1,4}){1,4})$")
_HEADER_BYTES = 1024  # two tensors' entries, with room to spare: a safetensors header of a call is ~150 bytes


class ExpertLayout(SpecSection):
    """The mixture-of-experts layers of a model: `layers` layers, each a grid of experts (every
    coordinate one expert) over activations of width `dim`; each input goes to its `k` best experts
    and is kept when at least `k_min` answer."""

    layers: int = Field(2, ge=1, le=64)
    grid: list[int] = Field([4, 4], min_length=1, max_length=4, description="experts per grid dimension")
    dim: int = Field(32, ge=1, le=65_536, description="width of the activations an expert takes and returns")
    hidden: int = Field(64, ge=1, le=262_144, description="an expert's hidden width (dim -> hidden -> dim)")
    k: int = Field(4, ge=1, le=64, description="experts each input is sent to")
    k_min: int = Field(1, ge=1, le=64, description="answers an input needs to count; fewer and it is left out")
    lr: float = Field(1e-3, gt=0, le=10, description="the experts' Adam learning rate, stepped on each backward")
    max_rows: int = Field(4096, ge=1, le=1_000_000, description="rows one call may carry")
    forward_timeout: float = Field(5.0, gt=0, le=600, description="seconds a trainer waits for forward answers")
    backward_timeout: float = Field(5.0, gt=0, le=600, description="seconds a trainer waits for backward answers")
    backward_quorum: float = Field(
        0.9,
        gt=0,
        le=1,
        description="a trainer waits for a micro-batch's backward answers until each row has as many as its "
        "forward had (up to k_min), or until this share of the calls has answered, then the grace period: a "
        "row whose call is lost then lacks that expert's part of its input gradient, instead of holding the "
        "batch until the call's error or timeout",
    )
    grace: float = Field(
        0.05,
        ge=0,
        le=60,
        description="once every input has k_min answers, how long to wait for more: as long again as those "
        "took, at most this many seconds",
    )
    heartbeat_seconds: float = Field(5.0, ge=0.1, le=3600, description="how often an expert host reports in")
    lease_heartbeats: int = Field(
        3, ge=2, le=100, description="heartbeats an expert's lease outlives: missed that many, it is leased anew"
    )
    checkpoint_every: int = Field(
        50,
        ge=1,
        le=1_000_000,
        description="the most steps of an expert a host that vanishes can lose: the host uploads a checkpoint "
        "every half of it, and a step beyond it past the last stored checkpoint waits for the upload",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="seed of the experts' initial weights")
    in_flight: int = Field(
        12, ge=1, le=256, description="micro-batches a trainer keeps going through the model at once"
    )
    replicas: int = Field(
        1,
        ge=1,
        le=3,
        description="hosts that serve each expert: each replica is leased to a different host, steps on the "
        "calls it gets, and averages its weights with another replica's newest checkpoint at each of its own",
    )
    compare_every: int = Field(
        20,
        ge=0,
        le=1_000_000,
        description="with replicas: every this many forward calls to an expert go to two of its replicas, "
        "and the trainer compares the answers; 0: never",
    )
    compare_tolerance: float = Field(
        0.5,
        gt=0,
        le=100,
        description="two replicas' answers disagree when |a - b| / max(|a|, |b|) (Frobenius norms) is above this: "
        "replicas drift apart between their averagings, an answer made up is far off",
    )

    @model_validator(mode="after")
    def _coherent(self) -> "ExpertLayout":
        if any(not 1 <= n <= 256 for n in self.grid):
            raise ValueError(f"grid sizes must lie in [1, 256], got {self.grid}")
        if self.k_min > self.k:
            raise ValueError(f"k_min ({self.k_min}) is above k ({self.k})")
        if self.k > self.experts_per_layer:
            raise ValueError(f"k ({self.k}) is above the {self.experts_per_layer} experts of a layer")
        return self

    @property
    def experts_per_layer(self) -> int:
        return math.prod(self.grid)

    def uids(self, layer: int) -> list[str]:
        """Every expert id of `layer`, in grid order."""
        return [expert_uid(layer, tuple(int(c) for c in coords)) for coords in np.ndindex(*self.grid)]

    def checkpoint_limit(self) -> int:
        """The largest checkpoint of one expert: its weights and Adam's two moments in float32, the step
        count, and the header."""
        weights = 2 * self.dim * self.hidden + self.hidden + self.dim
        return 65_536 + 3 * weights * 4 + 8

    def call_limit(self, args: tuple[str, ...]) -> int:
        """The largest body a call with `args` may have: its header, then `max_rows` float32 rows per tensor."""
        return 8 + _HEADER_BYTES + len(args) * self.max_rows * self.dim * 4


def disagree(a: np.ndarray, b: np.ndarray, tolerance: float) -> bool:
    """Whether two replicas' answers to the same call differ by more than `tolerance`, relative to the
    larger of the two (ExpertLayout.compare_tolerance)."""
    scale = max(float(np.linalg.norm(a)), float(np.linalg.norm(b)))
    return a.shape != b.shape or float(np.linalg.norm(a - b)) > tolerance * max(scale, 1e-12)


def answer_flops(layout: ExpertLayout, rows: int) -> int:
    """Floating-point operations an expert host spends answering `rows` rows, forward and backward calls
    counted alike: a forward row costs 4 x dim x hidden (two matrix products), a backward row three
    times that (it recomputes the forward pass, then both gradients); each row is credited their mean."""
    return 8 * layout.dim * layout.hidden * rows


EXPERT_PREFIX = "expert/"  # a whole model's parameters: the trunk's, and each expert's as expert/UID/NAME
_CHECKPOINT_WEIGHTS = "param/"  # a checkpoint's weights, beside its optimizer state


def checkpoint_weights(uid: str, checkpoint: bytes) -> dict[str, np.ndarray]:
    """The weights in an expert's checkpoint (crowdtrain.client.experts.expert.Expert.state), named as
    a whole model's parameters name them (expert/UID/NAME); TensorFormatError for bytes that are not
    safetensors. Whether they fit the expert is the reader's check (zoo_experts.local_experts)."""
    tensors = decode(checkpoint)
    return {
        f"{EXPERT_PREFIX}{uid}/{name[len(_CHECKPOINT_WEIGHTS) :]}": t
        for name, t in tensors.items()
        if name.startswith(_CHECKPOINT_WEIGHTS)
    }


def expert_uid(layer: int, coords: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in (layer, *coords))


def parse_uid(uid: str) -> tuple[int, tuple[int, ...]]:
    """(layer, coordinates) of an expert id; ValueError for anything else."""
    match = _UID.match(uid)
    if match is None:
        raise ValueError(f"{uid[:40]!r} is not an expert id (layer.coordinate[.coordinate...])")
    return int(match.group(1)), tuple(int(c) for c in match.group(2)[1:].split("."))


def layout_has(layout: ExpertLayout, uid: str) -> bool:
    layer, coords = parse_uid(uid)
    if layer >= layout.layers or len(coords) != len(layout.grid):
        return False
    return all(c < n for c, n in zip(coords, layout.grid, strict=True))


def encode_call(**tensors: np.ndarray) -> bytes:
    """A call's (or an answer's) body: float32 tensors by name."""
    return encode({name: np.ascontiguousarray(t, dtype=np.float32) for name, t in tensors.items()})


def read_call(body: bytes, args: tuple[str, ...], dim: int, max_rows: int) -> dict[str, np.ndarray]:
    """The tensors of a call (or an answer) with arguments `args`, each float32 [rows, dim] with the
        same rows (1..max_rows) and finite; ValueError saying what is wrong otherwise (TensorFormatError, one,
    when the body is not safetensors at all). The body is bounded
        by the caller (ExpertLayout.call_limit); the header is bounded here before it is parsed."""
    tensors = views(body, max_header_bytes=_HEADER_BYTES, max_tensors=len(args))  # TensorFormatError
    if sorted(tensors) != sorted(args):
        raise ValueError(f"a call carries tensors {list(args)}, not {sorted(tensors)[:4]}")
    for name in args:
        t = tensors[name]
        if t.dtype != np.float32:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, expected float32")
        if t.ndim != 2 or t.shape[1] != dim:
            raise ValueError(f"tensor {name!r} has shape {list(t.shape)}, expected [rows, {dim}]")
    rows = sorted({t.shape[0] for t in tensors.values()})
    if len(rows) != 1 or not 1 <= rows[0] <= max_rows:
        raise ValueError(f"a call carries 1 to {max_rows} rows, the same in every tensor; got {rows}")
    for name in args:
        if not np.isfinite(tensors[name]).all():
            raise ValueError(f"tensor {name!r} contains NaN or infinite values")
    return tensors

"""Local training with TensorFlow/Keras: start from the snapshot, train on the shard, return W_c.

Takes and returns the canonical layout (crowdtrain.core.zoo_keras maps it to Keras weights). The
optimizer follows PyTorch's semantics, so that a job trains alike on either framework: weight
decay is L2 added to the gradient (not Keras's decoupled decay) and Adam's epsilon is 1e-8.
"""

import logging
import os
import sys
import time

import numpy as np

from crowdtrain.client.trainers import Checkpoint, TrainControl, TrainResult, examples_in, local_steps
from crowdtrain.core.tensors import Params
from crowdtrain.core.zoo_keras import KerasModel, build_model, keras_module

log = logging.getLogger(__name__)

MODEL_PREFIX, OPTIMIZER_PREFIX = "model/", "optimizer/"


def _tensorflow():
    keras_module()  # sets the backend and log level before TensorFlow is first imported
    import tensorflow as tf

    return tf


def limit_threads(n: int) -> None:
    """Cap TensorFlow's intra- and inter-op thread pools; effective only before TensorFlow first runs.

    Before TensorFlow is imported this only sets the variables its runtime reads at start-up, so a
    client that never trains with TensorFlow does not pay for importing it.
    """
    if "tensorflow" not in sys.modules:
        os.environ["TF_NUM_INTRAOP_THREADS"] = os.environ["TF_NUM_INTEROP_THREADS"] = str(n)
        return
    tf = _tensorflow()
    try:
        tf.config.threading.set_intra_op_parallelism_threads(n)
        tf.config.threading.set_inter_op_parallelism_threads(n)
    except RuntimeError as exc:  # the runtime is already initialised: its pools are fixed
        log.warning("could not limit TensorFlow to %d threads: %s", n, exc)


def _tf_device(device: str) -> str:
    if device.startswith("cuda"):
        return f"/GPU:{device.partition(':')[2] or 0}"
    return "/CPU:0"


def _optimizer(keras, t: dict):
    if t["optimizer"] == "adam":
        return keras.optimizers.Adam(learning_rate=t["lr"], epsilon=1e-8)
    return keras.optimizers.SGD(learning_rate=t["lr"], momentum=t["momentum"])


def _train_step(tf, model, opt, weight_decay: float, sample_shape: tuple[int, ...]):
    variables = model.trainable_variables

    # One signature with a free batch axis: the last, shorter batch does not retrace.
    @tf.function(input_signature=[tf.TensorSpec([None, *sample_shape], tf.float32), tf.TensorSpec([None], tf.int64)])
    def step(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=logits))
        grads = tape.gradient(loss, variables)
        if weight_decay:
            grads = [g + weight_decay * v for g, v in zip(grads, variables, strict=True)]
        opt.apply_gradients(zip(grads, variables, strict=True))
        return loss

    return step


def _state(km: KerasModel, opt) -> Params:
    """Model (canonical layout) and optimizer variables as named arrays, for a checkpoint."""
    tensors = {MODEL_PREFIX + k: v for k, v in km.get_params().items()}
    tensors.update({f"{OPTIMIZER_PREFIX}{i:04d}": np.asarray(v.numpy()) for i, v in enumerate(opt.variables)})
    return tensors


def _restore(km: KerasModel, opt, tensors: Params) -> None:
    km.set_params({k[len(MODEL_PREFIX) :]: v for k, v in tensors.items() if k.startswith(MODEL_PREFIX)})
    saved = sorted(k for k in tensors if k.startswith(OPTIMIZER_PREFIX))
    if len(saved) != len(opt.variables):
        raise ValueError(f"checkpoint has {len(saved)} optimizer variables, the optimizer {len(opt.variables)}")
    for key, var in zip(saved, opt.variables, strict=True):
        var.assign(tensors[key])


def _start(km: KerasModel, opt, params: Params, seed: int, checkpoint: Checkpoint | None) -> dict:
    """Load the snapshot, or the checkpoint's state; return where in the data to start."""
    fresh = {"framework": "tensorflow", "seed": seed, "epoch": 0, "batch": 0, "loss_sum": 0.0, "seen": 0}
    if checkpoint is not None and checkpoint.resumed is not None:
        tensors, progress = checkpoint.resumed
        if progress.get("framework") == "tensorflow" and progress.get("seed") == seed:
            _restore(km, opt, tensors)
            return dict(progress)
        log.warning("ignoring a checkpoint written by another trainer; starting from the snapshot")
    km.set_params(params)
    return fresh


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The example order of one local epoch: a function of (seed, epoch) alone, so a resumed run
    finds the same order without replaying earlier epochs."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def train(
    recipe: dict,
    params: Params,
    x: np.ndarray,
    y: np.ndarray,
    device: str = "cpu",
    *,
    control: TrainControl,
    checkpoint: Checkpoint | None = None,
    local_fraction: float = 1.0,
) -> TrainResult:
    """Run `local_fraction` of `training.local_epochs` passes over (x, y) from `params` (in steps,
    rounded up); see crowdtrain.client.trainers for the contract."""
    start = time.monotonic()
    keras, tf = keras_module(), _tensorflow()
    t, seed = recipe["training"], int(recipe["seed"])
    x, y = np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.int64)
    with tf.device(_tf_device(device)):
        km = build_model(recipe["model"])
        opt = _optimizer(keras, t)
        opt.build(km.model.trainable_variables)
        pos = _start(km, opt, params, seed, checkpoint)
        start_at = (pos["epoch"], pos["batch"])
        step = _train_step(tf, km.model, opt, float(t["weight_decay"]), x.shape[1:])
        bs = t["batch_size"]
        steps = local_steps(len(x), bs, t["local_epochs"], local_fraction)
        per_epoch = -(-len(x) // bs)
        for epoch in range(start_at[0], -(-steps // per_epoch)):
            order = epoch_order(seed, epoch, len(x))
            first = start_at[1] if epoch == start_at[0] else 0
            if first == 0:
                pos["loss_sum"], pos["seen"] = 0.0, 0
            for i in range(first, min(len(order), (steps - epoch * per_epoch) * bs), bs):
                control.between_batches()
                # Not at the position this run started from: that state is the snapshot or the checkpoint.
                if checkpoint is not None and (epoch, i) != start_at and checkpoint.due():
                    pos.update(epoch=epoch, batch=i)
                    checkpoint.save(_state(km, opt), dict(pos))
                idx = order[i : i + bs]
                loss = step(x[idx], y[idx])
                pos["loss_sum"] += float(loss) * len(idx)
                pos["seen"] += len(idx)
    return TrainResult(
        km.get_params(), pos["loss_sum"] / max(pos["seen"], 1), examples_in(steps, len(x), bs), time.monotonic() - start
    )

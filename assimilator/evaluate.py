"""Validation of W_s on the job's server-side validation split, with the job's framework.

A zoo job is evaluated with its own framework when this process has it installed, else with
another that ports the model (W_s has one canonical layout). The loss and accuracy are computed
here from the model's logits, the same arithmetic for every framework.

The framework itself is imported on the first evaluation, not with this module: the scheduler and
the transitioner evaluate only when a job ends or a DeDLOC step is stored, and their processes
(every scheduler worker among them) start and serve without loading torch or tensorflow.
"""

import importlib
from collections.abc import Callable
from typing import Protocol

import numpy as np

from crowdtrain.core import frameworks
from crowdtrain.core.tensors import Params

# The module that computes logits with each framework, imported by name when first needed.
LOGITS = {
    "pytorch": "crowdtrain.assimilator.logits_pytorch",
    "tensorflow": "crowdtrain.assimilator.logits_tensorflow",
}


class Logits(Protocol):
    def __call__(
        self, job_id: int, model_config: dict, params: Params, x: np.ndarray, batch_size: int
    ) -> np.ndarray: ...


def logits_function(framework: str) -> Logits:
    """The `logits` function of `framework`'s module, importing the framework on first use."""
    found: Logits = importlib.import_module(LOGITS[framework]).logits
    return found


def evaluation_framework(model_config: dict) -> str:
    found = frameworks.pick(model_config, frameworks.installed())
    if found is None:
        raise RuntimeError(
            f"no installed framework runs model {model_config['name']!r} "
            f"(needs one of {frameworks.able_to_run(model_config)}; install crowdtrain[tensorflow])"
        )
    return found


def evaluate(
    job_id: int,
    model_config: dict,
    params: Params,
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int = 1024,
    framework: str | None = None,
) -> tuple[float, float]:
    """Return (mean cross-entropy loss, accuracy) of `params` on (x, y)."""
    losses, correct = example_losses(job_id, model_config, params, x, y, batch_size, framework)
    return float(losses.mean()), float(correct.mean())


class FrameworkEvaluator:
    """The evaluator a process makes once where it starts and hands its services
    (crowdtrain.server.ledger.job_end.Evaluator): `evaluate` with the job's framework. A test that
    needs other scores gives its services another object with the same method.

    The model of a mode moe job is its trunk W_s with the experts' weights that `expert_weights`
    (mixture id) gives (crowdtrain.assimilator.expert_weights.ExpertCheckpoints); a process without it
    evaluates such a job with the experts' initial weights."""

    def __init__(self, expert_weights: Callable[[int], Params] | None = None):
        self.expert_weights = expert_weights

    def evaluate(
        self, job_id: int, model_config: dict, params: Params, x: np.ndarray, y: np.ndarray
    ) -> tuple[float, float]:
        """(mean cross-entropy loss, accuracy) of `params` on (x, y) (`evaluate`)."""
        if "mixture" in model_config and self.expert_weights is not None:
            params = {**params, **self.expert_weights(int(model_config["mixture"]))}
        return evaluate(job_id, model_config, params, x, y)


def example_losses(
    job_id: int,
    model_config: dict,
    params: Params,
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int = 1024,
    framework: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The cross-entropy loss of `params` on each example of (x, y) (float64), and whether it is classified right."""
    logits = logits_function(framework or evaluation_framework(model_config))(
        job_id, model_config, params, x, batch_size
    )
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -log_probs[np.arange(len(y)), y], logits.argmax(axis=1) == y

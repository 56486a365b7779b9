"""A replica's evidence of training on its workunit's shard, measured with the job's model.

Two measures, both on the first `training_examples` of the shard, both judged by the validator
(crowdtrain.assimilator.validator):

- **training z**: W_c against W_base, per example (validator.training_z). Honest results score 4.5 to
  40; a random direction scores about 0, but its per-example gains move together (a direction shifts
  whole classes at once), so its spread is about twice that of a standard z, and a small random step
  early in training reached 6 (one in twenty at the example job's initial model).
- **descent z**: how far Δ points downhill on the shard's loss at W_base compared with random
  directions drawn here, from this process's own entropy, so a host cannot know them. The slope of
  the shard's mean loss along Δ's unit direction, by a central difference, over the root mean square
  of the slopes along `directions` random unit directions: a direction the host did not fit to the
  shard is one of those random directions as far as this test can tell (its descent z follows
  Student's t with `directions` degrees of freedom), while training descends (honest results scored
  3.2 to 50 over whole runs, benchmarks/replica_improvement.py).

The validator (validator.untrained) requires a training z of `min_training_z` and, below
`training_z_alone`, a descent z of `min_descent_z`: late in training an honest update's descent can be
as weak as 3 while its training z stays 8 or more, and early a random step's training z can reach 6
while its descent stays under 3. Each costs forward passes only: 2 + 2·(directions + 1) on
`training_examples` examples per replica.
"""

import math
from collections.abc import Mapping

import numpy as np

from crowdtrain.assimilator.evaluate import example_losses
from crowdtrain.assimilator.rules.update import params_norm
from crowdtrain.assimilator.validator import training_z
from crowdtrain.core.tensors import Params

STEP = 1e-3  # the central difference's step, as a fraction of ||W_base||


def measure(
    job_id: int,
    model_config: dict,
    client: Params,
    delta: Mapping[str, np.ndarray],
    shard: tuple[np.ndarray, np.ndarray],
    directions: int,
    rng: np.random.Generator,
) -> tuple[float, float]:
    """(training z, descent z) of W_c = `client` against W_base = W_c − Δ on the shard's examples."""
    base = {k: (v - delta[k]).astype(v.dtype) if k in delta else v for k, v in client.items()}
    before, _ = example_losses(job_id, model_config, base, *shard)
    after, _ = example_losses(job_id, model_config, client, *shard)
    floats = [k for k in sorted(delta) if delta[k].dtype.kind == "f"]
    step = STEP * params_norm({k: base[k] for k in floats})

    def slope(direction: Params) -> float:
        up, _ = example_losses(job_id, model_config, _moved(base, direction, step), *shard)
        down, _ = example_losses(job_id, model_config, _moved(base, direction, -step), *shard)
        return float(up.mean() - down.mean()) / (2 * step)

    along = slope(_unit({k: delta[k] for k in floats}))
    null = [slope(_unit({k: rng.standard_normal(base[k].shape) for k in floats})) for _ in range(directions)]
    return training_z(before, after), descent_z(along, null)


def descent_z(slope: float, null_slopes: list[float]) -> float:
    """−`slope` over the root mean square of `null_slopes` (slopes along random directions, mean 0):
    how many random-direction spreads downhill Δ points; 0 when nothing could be measured."""
    scale = math.sqrt(float(np.mean(np.square(null_slopes)))) if null_slopes else 0.0
    if scale == 0 or not math.isfinite(slope):
        return 0.0
    return -slope / scale


def _unit(direction: Params) -> Params:
    size = params_norm(direction)
    return {k: np.asarray(v, dtype=np.float64) / size for k, v in direction.items()} if size > 0 else direction


def _moved(params: Params, direction: Params, step: float) -> Params:
    return {k: (v + step * direction[k]).astype(v.dtype) if k in direction else v for k, v in params.items()}

"""A replica's evidence of training, measured with a real model: an honest update of the example job
shows it, and a colluding pair's random direction does not, at the job's initial model, where a
random direction's training z alone can pass."""

from pathlib import Path

import numpy as np

from crowdtrain.assimilator.evaluate import example_losses
from crowdtrain.assimilator.evidence import descent_z, measure
from crowdtrain.assimilator.rules.update import params_norm
from crowdtrain.assimilator.validator import training_z, untrained
from crowdtrain.client.trainers.pytorch import train
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.validationspec import ValidationSpec
from crowdtrain.core.zoo import build_model, state_to_numpy
from crowdtrain.workgen.datasets import deal_shards, load_dataset
from tests.conftest import EXAMPLE_SPEC

JOB_ID = -4242  # evaluation caches models per job id: never a real job's


def test_an_honest_update_shows_training_and_random_directions_do_not() -> None:
    spec = load_job_spec(Path(EXAMPLE_SPEC))
    data = load_dataset(spec.dataset.source, spec.dataset.validation_fraction, spec.dataset.classes)
    config = {
        "name": spec.model.name,
        "framework": "pytorch",
        "input_shape": data.input_shape,
        "num_classes": data.num_classes,
        "options": spec.model.options,
    }
    model = build_model(spec.model.name, data.input_shape, data.num_classes, seed=0, **spec.model.options)
    base = state_to_numpy(model)
    floats = [k for k, v in base.items() if v.dtype.kind == "f"]
    shard = deal_shards(data.y, spec.dataset.subsets, spec.dataset.shuffle, 0)[0]
    checks = ValidationSpec()
    examples = data.x[shard][: checks.training_examples], data.y[shard][: checks.training_examples]
    recipe = {"model": config, "training": spec.training.model_dump(mode="json"), "seed": 1}
    honest = train(recipe, base, data.x[shard], data.y[shard]).params
    rng = np.random.default_rng(7)
    delta = {k: honest[k] - base[k] for k in floats}
    z, descent = measure(JOB_ID, config, honest, delta, examples, checks.descent_directions, rng)
    assert untrained(z, descent, checks) is None, (z, descent)

    before, _ = example_losses(JOB_ID, config, base, *examples)
    passed_z, passed_both = 0, 0
    for draw in range(40):  # the colluding pair's construction: W_base + d, ||d|| = 3% of ||W_base||
        shared = np.random.default_rng(draw)
        d = {k: shared.standard_normal(base[k].shape) for k in floats}
        size = 0.03 * params_norm({k: base[k] for k in floats}) / params_norm(d)
        forged_delta = {k: (size * d[k]).astype(base[k].dtype) for k in floats}
        forged = {k: (v + forged_delta[k]).astype(v.dtype) if k in forged_delta else v for k, v in base.items()}
        if training_z(before, example_losses(JOB_ID, config, forged, *examples)[0]) < checks.min_training_z:
            continue  # refused by the training z alone
        passed_z += 1
        z, descent = measure(JOB_ID, config, forged, forged_delta, examples, checks.descent_directions, rng)
        passed_both += untrained(z, descent, checks) is None
    assert passed_z >= 1, "no draw shows what the descent check is for: a random direction passing training z"
    assert passed_both == 0


def test_descent_z_is_the_slope_against_the_spread_of_random_slopes() -> None:
    assert descent_z(-3.0, [1.0, -1.0, 1.0, -1.0]) == 3.0
    assert descent_z(2.0, [2.0, -2.0]) == -1.0
    assert descent_z(-1.0, []) == 0.0 and descent_z(-1.0, [0.0, 0.0]) == 0.0 and descent_z(float("nan"), [1.0]) == 0.0

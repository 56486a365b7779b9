"""A trainer keeping many micro-batches in flight: each on its own replica of the trunk, every step
applied once to the one trunk, and training goes on as it would one batch at a time."""

import numpy as np
import torch

from crowdtrain.client.experts.mixture import ExpertClient
from crowdtrain.client.experts.trainer import STALENESS_POWER, MixtureClassifier, PipelinedTrainer, accuracy
from crowdtrain.core.experts import ExpertLayout
from crowdtrain.core.zoo_experts import MixtureTrunk
from tests.benchmark_modules import load_benchmark

LAYOUT = ExpertLayout(layers=2, grid=[2, 2], dim=16, hidden=16, k=2)


def test_micro_batches_in_flight_each_apply_one_step_to_the_shared_trunk() -> None:
    data = load_benchmark("efficiency_data").cluster_arrays(1, n_train=4000, n_val=500)
    client = ExpertClient(LAYOUT, {})  # no expert answers: the trunk alone learns
    torch.manual_seed(0)
    model = MixtureClassifier(MixtureTrunk([8], 10, LAYOUT.model_dump()), client)
    trunk = [
        *model.trunk.embed.parameters(),
        *model.trunk.head.parameters(),
    ]  # (the gates get no gradient without experts)
    before = [p.detach().clone() for p in trunk]
    trainer = PipelinedTrainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), in_flight=4)
    rng = np.random.default_rng(0)

    def batches():
        while True:
            i = rng.integers(0, 4000, 32)
            yield data["x"][i], data["y"][i]

    trainer.train(batches(), lambda: trainer.steps >= 300)
    assert 300 <= trainer.steps < 304 and trainer.examples == 32 * trainer.steps
    assert all(not torch.equal(b, p) for b, p in zip(before, trunk, strict=True))
    assert accuracy(model, data["x_val"], data["y_val"]) > 0.45  # chance is 0.1; a linear trunk tops out near 0.63
    client.close()


def test_a_stale_micro_batch_steps_the_trunk_at_a_learning_rate_scaled_down_for_its_staleness() -> None:
    client = ExpertClient(LAYOUT, {})
    model = MixtureClassifier(MixtureTrunk([8], 10, LAYOUT.model_dump()), client)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = PipelinedTrainer(model, optimizer, in_flight=4)
    p = model.trunk.embed.bias
    moved = []
    for staleness in (0, 3):
        before = p.detach().clone()
        for q in model.parameters():
            q.grad = torch.ones_like(q)
        trainer._stale_step(staleness)
        moved.append(float((before - p.detach()).mean()))
    assert moved == [1.0, 1.0 / 4**STALENESS_POWER]  # lr / (1 + staleness) ** STALENESS_POWER
    assert optimizer.param_groups[0]["lr"] == 1.0, "the learning rate is put back"
    client.close()

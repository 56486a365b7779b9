"""A mode moe workunit on a volunteer client (crowdtrain.client.experts.workunit): the trunk trains on
the shard through expert host processes, the routing table is read as changes, and a cancelled
workunit stops between batches."""

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from crowdtrain.client.trainers import Cancelled, TrainControl, local_steps, train
from crowdtrain.core import zoo
from crowdtrain.core.experts import ExpertLayout
from crowdtrain.core.schemas_experts import CallReport, CallsRecorded, RouteOut, RoutingTable
from crowdtrain.workgen.datasets import gaussian_clusters
from tests.client.experts.hosts import start_host

pytestmark = pytest.mark.integration

LAYOUT = ExpertLayout(layers=2, grid=[2, 2], dim=16, hidden=32, k=2, lr=3e-3, in_flight=4)
MIXTURE = 7


def recipe(local_epochs: int = 1) -> dict:
    model = {
        "name": "moe",
        "framework": "pytorch",
        "input_shape": [8],
        "num_classes": 10,
        "options": {"layout": LAYOUT.model_dump(mode="json")},
        "mixture": MIXTURE,
    }
    training = {"local_epochs": local_epochs, "batch_size": 50, "optimizer": "adam", "lr": 3e-3}
    return {"model": model, "training": training | {"momentum": 0.0, "weight_decay": 0.0}, "seed": 3}


class Registry:
    """The scheduler's side of a moe workunit, as a trainer sees it (crowdtrain.client.trainers.ExpertRegistry):
    a fixed routing table, and the reports kept."""

    def __init__(self, routes: list[RouteOut]):
        self.routes, self.asked, self.reports = routes, [], []

    def routing(self, mixture_id: int, since: int) -> RoutingTable:
        self.asked.append((mixture_id, since))
        return RoutingTable(version=1, routes=self.routes if since == 0 else [])

    def report_calls(self, mixture_id: int, report: CallReport) -> CallsRecorded:
        self.reports.append((mixture_id, report))
        return CallsRecorded(counted=len(report.experts), ignored=0)


@pytest.fixture
def hosts(tmp_path) -> Iterator[dict]:
    """Two hosts serving half the experts each, and the routing table's changes as the scheduler gives them."""
    uids = [u for layer in range(LAYOUT.layers) for u in LAYOUT.uids(layer)]
    a, url_a = start_host(tmp_path, "a", LAYOUT, uids[::2])
    b, url_b = start_host(tmp_path, "b", LAYOUT, uids[1::2])
    routes = [RouteOut(uid=u, url=url_a if i % 2 == 0 else url_b) for i, u in enumerate(uids)]
    yield {"registry": Registry(routes), "urls": [url_a, url_b]}
    a.stop()
    b.stop()


def expert_steps(urls: list[str]) -> int:
    return sum(
        e["steps"] for url in urls for e in httpx.get(f"{url}/v1/experts", timeout=10).json()["experts"].values()
    )


def test_a_workunit_trains_the_trunk_through_the_experts_which_step_on_their_hosts(hosts) -> None:
    x, y, _, _ = gaussian_clusters(seed=1, n_train=600, n_val=1)
    trunk = zoo.state_to_numpy(zoo.build_model("moe", [8], 10, seed=0, layout=LAYOUT.model_dump(mode="json")))
    registry = hosts["registry"]
    result = train("pytorch", recipe(local_epochs=2), trunk, x, y, experts=registry)

    assert result.params.keys() == trunk.keys()
    assert all(
        not np.array_equal(result.params[k], trunk[k]) for k in ("embed.weight", "gates.0.per_dimension.0.weight")
    )
    steps = local_steps(600, 50, 2)
    assert result.examples == 600 * 2 and np.isfinite(result.train_loss) and result.optimizer_state
    # Each micro-batch called backward on the experts its rows chose (each row its top 2 of a layer's 4);
    # a host steps an expert once per batch of calls, so at most once per micro-batch and expert.
    stepped = expert_steps(hosts["urls"])
    assert 0 < stepped <= steps * LAYOUT.layers * LAYOUT.experts_per_layer
    assert registry.asked[0] == (MIXTURE, 0)
    # One report, at the end: every expert that was called, at the host that serves it, all answered.
    [(mixture, report)] = registry.reports
    served = {r.uid: r.url for r in registry.routes}
    assert mixture == MIXTURE and report.experts and all(c.url == served[c.uid] for c in report.experts)
    assert all(c.failed == c.refused == 0 for c in report.experts)
    # A step of an expert took a forward and a backward call (or more, run by its host as one batch); each
    # batch's 50 rows went to 2 experts of each of the 2 layers, forward and backward (less the calls a
    # micro-batch stopped waiting for once each row had k_min answers).
    assert sum(c.answered for c in report.experts) >= 2 * stepped
    sent = steps * 50 * LAYOUT.k * LAYOUT.layers * 2
    assert 0.8 * sent <= sum(c.rows for c in report.experts) <= sent


def test_a_cancelled_workunit_stops_between_batches(hosts) -> None:
    x, y, _, _ = gaussian_clusters(seed=1, n_train=2000, n_val=1)
    trunk = zoo.state_to_numpy(zoo.build_model("moe", [8], 10, seed=0, layout=LAYOUT.model_dump(mode="json")))
    control = TrainControl()

    registry = hosts["registry"]

    class Cancelling(Registry):
        def routing(self, mixture_id: int, since: int) -> RoutingTable:
            control.cancel()  # once the workunit has its routes, it is no longer wanted
            return registry.routing(mixture_id, since)

    with pytest.raises(Cancelled):
        train("pytorch", recipe(), trunk, x, y, control=control, experts=Cancelling(registry.routes))
    assert len(registry.asked) == 1 and expert_steps(hosts["urls"]) == 0


def test_a_moe_workunit_without_a_routing_source_is_refused() -> None:
    trunk = zoo.state_to_numpy(zoo.build_model("moe", [8], 10, seed=0, layout=LAYOUT.model_dump(mode="json")))
    with pytest.raises(ValueError, match="expert registry"):
        train("pytorch", recipe(), trunk, np.zeros((10, 8), np.float32), np.zeros(10, np.int64))

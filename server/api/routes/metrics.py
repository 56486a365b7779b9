from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from crowdtrain.core import keys
from crowdtrain.server.api.deps import AdminDep, DbDep, RedisDep
from crowdtrain.server.services.telemetry import CrowdtrainCollector

router = APIRouter(tags=["operations"], dependencies=[AdminDep])


@router.get("/metrics", response_class=Response)
def metrics(r: RedisDep, db: DbDep) -> Response:
    """Prometheus metrics (scrape with the admin token as a bearer token)."""
    registry = CollectorRegistry()
    registry.register(CrowdtrainCollector(r, db, keys.ASSIMILATE_QUEUE))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

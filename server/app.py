"""The FastAPI scheduler application."""

from fastapi import FastAPI

from crowdtrain import logs
from crowdtrain.settings import get_settings

from server.routes import admin, dedloc, files, hosts, jobs, metrics, work


def create_app() -> FastAPI:
    app = FastAPI(title="crowdtrain scheduler", version="0.1.0")
    for module in (hosts, work, files, jobs, admin, metrics):
        app.include_router(module.router)
    app.include_router(dedloc.router)
    app.include_router(dedloc.admin_router)

    @app.get("/v1/health", tags=["health"])
    def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


logs.configure(get_settings().log_format)
app = create_app()

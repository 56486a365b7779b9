"""The FastAPI scheduler application."""

import logging

from fastapi import FastAPI

from server.routes import admin, files, hosts, jobs, metrics, work


def create_app() -> FastAPI:
    app = FastAPI(title="crowdtrain scheduler", version="0.1.0")
    for module in (hosts, work, files, jobs, admin, metrics):
        app.include_router(module.router)

    @app.get("/v1/health", tags=["health"])
    def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
app = create_app()

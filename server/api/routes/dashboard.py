"""The web dashboard: the operator's pages under `/dashboard` (a login cookie), the public project page,
and their static files.

The pages are static HTML (the public one with its figures rendered in by the server, for the first
paint); a small script (`static/dashboard.js`) fetches their JSON and polls it every 2 s. The
operator's JSON is read-only and admits the session cookie only for GET
(crowdtrain.server.api.deps.has_session); the `/v1` API keeps its bearer token.
"""

import html
from importlib import resources
from urllib.parse import parse_qs

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from crowdtrain.core.schemas import Id
from crowdtrain.core.schemas_dashboard import DedlocFigures, HostFigures, JobDashboard, JobInFlight, ProjectPublic
from crowdtrain.core.schemas_experts import MixtureOut
from crowdtrain.core.schemas_jobs import JobSummary
from crowdtrain.server.api import public_page
from crowdtrain.server.api.deps import (
    SESSION_COOKIE,
    DbDep,
    FailureBudgetDep,
    RedisDep,
    RequireSession,
    SessionDep,
    SettingsDep,
)
from crowdtrain.server.services import dashboard, dedloc_figures, experts, in_flight, jobs, sessions

STATIC = resources.files("crowdtrain.server.api") / "static"
STATIC_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8"}
# The pages load only their own scripts and styles, and may not be framed.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
LOGIN_FORM_MAX_BYTES = 4096
COOKIE_PATH = "/dashboard"

router = APIRouter(include_in_schema=False)
operator = APIRouter(prefix="/dashboard", include_in_schema=False)
operator_data = APIRouter(prefix="/dashboard/api", include_in_schema=False, dependencies=[RequireSession])
public = APIRouter(tags=["public"])


def page(name: str, message: str = "", status_code: int = status.HTTP_200_OK) -> HTMLResponse:
    """One of the static pages; `message` (escaped) fills its message slot."""
    text = (STATIC / f"{name}.html").read_text(encoding="utf-8")
    return HTMLResponse(
        text.replace("<!--message-->", html.escape(message)), status_code=status_code, headers=PAGE_HEADERS
    )


def operator_page(name: str, logged_in: bool) -> Response:
    return page(name) if logged_in else RedirectResponse("/dashboard/login", status.HTTP_303_SEE_OTHER)


@router.get("/")
def root() -> RedirectResponse:
    return RedirectResponse("/project", status.HTTP_303_SEE_OTHER)


@router.get("/static/{name}")
def static_file(name: str) -> Response:
    """The pages' scripts and styles (nothing secret: every page loads them)."""
    suffix = name[name.rfind(".") :] if "." in name else ""
    file = STATIC / name
    if "/" in name or "\\" in name or suffix not in STATIC_TYPES or not file.is_file():
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no static file {name!r}")
    return Response(file.read_bytes(), media_type=STATIC_TYPES[suffix], headers={"Cache-Control": "no-cache"})


@router.get("/project")
def project_page(db: DbDep) -> HTMLResponse:
    """The public project page with its figures in it (the page's script refreshes them)."""
    template = (STATIC / "project.html").read_text(encoding="utf-8")
    return HTMLResponse(public_page.render(template, dashboard.project_public(db)), headers=PAGE_HEADERS)


@public.get("/v1/project", response_model=ProjectPublic)
def project(db: DbDep) -> ProjectPublic:
    """The public project page's figures: jobs' progress and volunteers' contributions by display name.
    Needs no token and shows none."""
    return dashboard.project_public(db)


@operator.get("/login")
def login_page(logged_in: SessionDep) -> Response:
    if logged_in:
        return RedirectResponse("/dashboard/jobs", status.HTTP_303_SEE_OTHER)
    return page("login")


def login_token(body: bytes) -> str:
    """The `token` field of a form-encoded login body; empty if the body is not such a form."""
    if len(body) > LOGIN_FORM_MAX_BYTES:
        return ""
    try:
        fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=4)
    except ValueError:  # more fields than a login form has
        return ""
    return fields.get("token", [""])[0]


@operator.post("/login")
async def login(request: Request, settings: SettingsDep, budget: FailureBudgetDep) -> Response:
    """The login form (`token=...`, form-encoded): the admin token gets a session cookie and the jobs
    page; anything else the form again with 401, spending the caller's failure budget (429 once it is
    used up)."""
    token = login_token(await request.body())
    if not sessions.is_admin_token(settings.admin_token, token):
        await run_in_threadpool(budget.fail)
        return page("login", "wrong admin token", status.HTTP_401_UNAUTHORIZED)
    resp = RedirectResponse("/dashboard/jobs", status.HTTP_303_SEE_OTHER)
    resp.set_cookie(
        SESSION_COOKIE,
        sessions.issue(settings.admin_token, settings.dashboard_session_seconds),
        max_age=settings.dashboard_session_seconds,
        path=COOKIE_PATH,
        secure=True,
        httponly=True,
        samesite="strict",
    )
    return resp


@operator.post("/logout")
def logout(request: Request, settings: SettingsDep, r: RedisDep) -> RedirectResponse:
    """End the session: on the server (the cookie, wherever copied, admits nothing from now on) and in
    this browser (the cookie is dropped). A new admin token ends them all."""
    sessions.end(r, settings.admin_token, request.cookies.get(SESSION_COOKIE))
    resp = RedirectResponse("/dashboard/login", status.HTTP_303_SEE_OTHER)
    resp.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH, secure=True, httponly=True, samesite="strict")
    return resp


@operator.get("")
def home(logged_in: SessionDep) -> Response:
    return RedirectResponse("/dashboard/jobs" if logged_in else "/dashboard/login", status.HTTP_303_SEE_OTHER)


@operator.get("/jobs")
def jobs_page(logged_in: SessionDep) -> Response:
    return operator_page("jobs", logged_in)


@operator.get("/jobs/{job_id}")
def job_page(job_id: Id, logged_in: SessionDep) -> Response:
    return operator_page("job", logged_in)


@operator.get("/hosts")
def hosts_page(logged_in: SessionDep) -> Response:
    return operator_page("hosts", logged_in)


@operator_data.get("/jobs", response_model=list[JobSummary])
def jobs_data(db: DbDep) -> list[JobSummary]:
    return jobs.list_jobs(db)


@operator_data.get("/jobs/{job_id}", response_model=JobDashboard)
def job_data(job_id: Id, db: DbDep) -> JobDashboard:
    """404 for no such job."""
    return dashboard.job_dashboard(db, job_id)


@operator_data.get("/jobs/{job_id}/in-flight", response_model=JobInFlight)
def job_in_flight(job_id: Id, db: DbDep) -> JobInFlight:
    """What the job is waiting on: its running assignments, merge backlog, stragglers and duplicates.
    404 for no such job."""
    return in_flight.job_in_flight(db, job_id)


@operator_data.get("/jobs/{job_id}/dedloc", response_model=DedlocFigures)
def job_dedloc(job_id: Id, db: DbDep, r: RedisDep) -> DedlocFigures:
    """A DeDLOC job's rounds: steps committed, members, mean round time, examples per step. 404 for no
    such job, 409 for a job of another mode."""
    return dedloc_figures.dedloc_figures(db, r, job_id)


@operator_data.get("/mixtures/{mixture_id}", response_model=MixtureOut)
def mixture_data(mixture_id: Id, db: DbDep) -> MixtureOut:
    """A moe job's experts: each one's host, lease and checkpoint, and what trainers reported of their
    calls. 404 for no such mixture."""
    return experts.mixture_status(db, mixture_id)


@operator_data.get("/hosts", response_model=list[HostFigures])
def hosts_data(db: DbDep) -> list[HostFigures]:
    return dashboard.host_figures(db)


ROUTERS = (router, public, operator, operator_data)

"""The operator's HTTP routes: ``/admin/*``, ``/metrics`` and the status page ``/ui``.

They serve on the API's listener, or on a listener of their own (``admin_port``), which
can then stay on an interface clients never reach. With keys configured, every ``/admin``
route needs an admin key (401 without a valid key, 403 for a tenant's), and state-changing
ones also refuse what a browser could send cross-site (``orchestrator.cross_site``).
``/metrics`` stays open to scrapers: move it off the public interface with ``admin_port``.
The status page's files hold no data and are open too; the data it polls, ``/admin/status``,
is an admin route.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from foundation import wire
from orchestrator.admin import describe_unavailable, describe_workers, reset_all_caches
from orchestrator.api import DECISIONS_LIMIT, ApiContext, json_response
from orchestrator.auth import require_admin
from orchestrator.cross_site import check_not_cross_site
from orchestrator.errors import APIError
from orchestrator.node_stores import describe_stores
from orchestrator.status_page import status_page_router


def admin_routers(context: ApiContext) -> list[APIRouter]:
    async def admin_only(request: Request) -> None:
        require_admin(context.authenticate(request))
        check_not_cross_site(request.method, request.headers)

    admin, public = APIRouter(prefix="/admin", dependencies=[Depends(admin_only)]), APIRouter()
    service = context.service

    @admin.get("/workers")
    async def workers(request: Request):
        """Workers in rotation, then draining ones (operators, tests, dashboards); and the
        topology ``kvroute serve`` chose, where it started them."""
        model = service.calibration.calibrated_model(time.monotonic())
        body = {"workers": describe_workers(service.fleet, service.index, model.prefill_speed)}
        topology = getattr(request.app.state, "topology", None)
        return body if topology is None else {**body, "topology": topology}

    @admin.get("/stores")
    async def stores():
        """The node KV stores behind the workers: capacity and use per tier, hit rate,
        evictions (``orchestrator.node_stores``)."""
        return {"stores": await describe_stores(service.fleet, service.tiers)}

    @admin.get("/status")
    async def status(decisions: int = Query(20, ge=0, le=DECISIONS_LIMIT)):
        """What the status page shows, in one answer: the workers (as ``/admin/workers``) and
        those a fault took out of rotation, the newest ``decisions`` records of every tenant,
        and TTFT and hit rate over the last minutes (``orchestrator.recent_activity``)."""
        now, monotonic = time.time(), time.monotonic()
        model = service.calibration.calibrated_model(monotonic)
        return json_response({
            "time": now, "model": context.model_name, "policy": service.default_policy,
            "workers": describe_workers(service.fleet, service.index, model.prefill_speed),
            "unavailable": describe_unavailable(service.fleet, monotonic),
            "decisions": service.decisions.recent(decisions),  # msgspec encodes the dataclasses, no asdict copy
            "activity": service.activity.summary(now)},
            headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})

    @admin.post("/reset-cache")
    async def reset_cache(role: str | None = None):
        if role is not None and role not in wire.ROLES:
            raise APIError(400, f"role must be one of {', '.join(wire.ROLES)}", code="invalid_role", param="role")
        results = await reset_all_caches(service.fleet, context.index_sync, wire.ROLES if role is None else (role,))
        everywhere = all(r["reset"] for r in results)
        return JSONResponse({"reset": everywhere, "workers": results}, status_code=200 if everywhere else 503)

    @public.get("/metrics")
    async def metrics():
        service.metrics.refresh_fleet(service.fleet, service.index, service.tiers)
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return [admin, public, status_page_router()]

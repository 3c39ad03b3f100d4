"""The operator's HTTP routes: ``/admin/*`` and ``/metrics``.

They serve on the API's listener, or on a listener of their own (``admin_port``), which
can then stay on an interface clients never reach. With keys configured, every ``/admin``
route needs an admin key (401 without a valid key, 403 for a tenant's), and state-changing
ones also refuse what a browser could send cross-site (``orchestrator.cross_site``).
``/metrics`` stays open to scrapers: move it off the public interface with ``admin_port``.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from foundation import wire
from orchestrator.admin import describe_workers, reset_all_caches
from orchestrator.api import ApiContext
from orchestrator.auth import require_admin
from orchestrator.cross_site import check_not_cross_site
from orchestrator.errors import APIError


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

    @admin.post("/reset-cache")
    async def reset_cache(role: str | None = None):
        if role is not None and role not in wire.ROLES:
            raise APIError(400, f"role must be one of {', '.join(wire.ROLES)}", code="invalid_role", param="role")
        results = await reset_all_caches(service.fleet, context.index_sync, wire.ROLES if role is None else (role,))
        everywhere = all(r["reset"] for r in results)
        return JSONResponse({"reset": everywhere, "workers": results}, status_code=200 if everywhere else 503)

    @public.get("/metrics")
    async def metrics():
        service.metrics.refresh_fleet(service.fleet, service.index)
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return [admin, public]

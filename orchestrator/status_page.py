"""The status page, ``/ui``: an HTML shell, its script and its style sheet, served by the
orchestrator itself, with no build step and nothing fetched from elsewhere.

The shell holds no data, so it needs no key; its script polls ``GET /admin/status``
(``orchestrator.admin_routes``), which needs an admin key when keys are configured: the
page asks for one and keeps it in the tab's sessionStorage. The page moves with the admin
routes to the admin listener (``admin_port``), so its requests stay same-origin.

Every file is sent with a strict Content-Security-Policy: scripts, styles and requests to
this origin only (no inline script or style a stolen string could smuggle in), never in a
frame (clickjacking), no ``<base>`` or form target elsewhere. The script writes data with
``textContent`` only, since worker ids and reasons come from the workers.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

CONTENT_SECURITY_POLICY = ("default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'; "
                           "object-src 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
                    "X-Frame-Options": "DENY",  # frame-ancestors, for browsers that predate it
                    "Referrer-Policy": "no-referrer",
                    "Cache-Control": "no-cache"}  # revalidate: an upgraded orchestrator serves a new script
FILES = {"/ui": ("index.html", "text/html; charset=utf-8"),
         "/ui/status.js": ("status.js", "text/javascript; charset=utf-8"),
         "/ui/status.css": ("status.css", "text/css; charset=utf-8")}


def status_page_router() -> APIRouter:
    """The page's routes; the files are read once, here (a few kilobytes)."""
    folder = resources.files("orchestrator") / "ui"
    router = APIRouter()
    for path, (name, media_type) in FILES.items():
        router.add_api_route(path, _serve((folder / name).read_bytes(), media_type), methods=["GET"],
                             include_in_schema=False)
    return router


def _serve(body: bytes, media_type: str):
    async def serve() -> Response:
        return Response(body, media_type=media_type, headers=SECURITY_HEADERS)
    return serve

"""Refusing state-changing requests that a web page could make a browser send.

Bearer keys are never attached by a browser on its own, but an orchestrator without keys
on loopback is reachable from any page its operator's browser opens: an HTML form on
another site can POST to ``http://127.0.0.1:8000/admin/reset-cache``. The rule, for every
method but GET, HEAD and OPTIONS:

1. ``Content-Type`` must be ``application/json`` (the body may be empty). A form can only
   send ``application/x-www-form-urlencoded``, ``multipart/form-data`` or ``text/plain``,
   and a script on another origin can set JSON only after a CORS preflight, which kvroute
   never grants (it sends no CORS headers).
2. A request a browser marks as coming from another site is refused even so:
   ``Sec-Fetch-Site`` other than ``same-origin`` or ``none`` (typed by the user), or an
   ``Origin`` whose host and port differ from the request's ``Host``.

Clients that are not browsers (curl, httpx, the openai package) send neither header, so
rule 1 is all they meet.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from orchestrator.errors import APIError

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
BROWSER_SAME_SITE = frozenset({"same-origin", "none"})


def check_not_cross_site(method: str, headers: Mapping[str, str]) -> None:
    """Raise the 403 or 415 a state-changing request gets when a browser form could have sent
    it; ``headers`` are looked up by lower-case name."""
    if method.upper() in SAFE_METHODS:
        return
    fetch_site = headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site.lower() not in BROWSER_SAME_SITE:
        raise _cross_site(f"Sec-Fetch-Site: {fetch_site}")
    origin = headers.get("origin")
    if origin is not None and urlsplit(origin).netloc.lower() != headers.get("host", "").lower():
        raise _cross_site(f"Origin {origin}")
    media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, "state-changing admin requests need 'Content-Type: application/json' (the body may "
                            "be empty), which no cross-site form can send", code="json_content_type_required")


def _cross_site(what: str) -> APIError:
    return APIError(403, f"refused a cross-site request ({what}): admin actions must come from the same origin "
                         f"or from a client that is not a browser", code="cross_site_request")

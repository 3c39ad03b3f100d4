"""Assembling the orchestrator: model, tokenizer, fleet, policy, service, HTTP apps."""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import uvloop
from fastapi import APIRouter, FastAPI

from foundation import tracing, zmq_auth
from foundation.log_setup import LOG_FORMAT
from foundation.model_fingerprint import model_fingerprint
from orchestrator.admin_routes import admin_routers
from orchestrator.api import ApiContext, build_routers
from orchestrator.auth import ApiKeys
from orchestrator.decisions import DecisionLog
from orchestrator.errors import install_handlers
from orchestrator.feedback import Feedback
from orchestrator.fleet import Fleet
from orchestrator.http_middleware import BodySizeLimit, RequestCounter
from orchestrator.http_server import listeners, serve_all, stop_on_signals
from orchestrator.index import PrefixIndex
from orchestrator.index_sync import IndexSync
from orchestrator.input_limits import InputLimits
from orchestrator.metrics import Metrics
from orchestrator.planner.calibration import Calibration
from orchestrator.planner.policies import POLICIES, make_policy
from orchestrator.rate_limit import TenantRateLimits
from orchestrator.registry import WorkerRegistry
from orchestrator.service import CompletionService
from orchestrator.settings import OrchestratorSettings
from orchestrator.startup_calibration import StartupCalibration
from orchestrator.tier_holdings import TierHoldings
from orchestrator.tier_sync import TierSync
from orchestrator.tokenization import TextCodec

logger = logging.getLogger("kvroute.orchestrator")


@dataclass(frozen=True)
class OrchestratorApps:
    """The API app, and the admin app when ``/admin``, ``/metrics`` and ``/ui`` have a listener
    of their own (None: they are routes of the API app). Both share one ``state``."""

    api: FastAPI
    admin: FastAPI | None = None

    @property
    def state(self):
        return self.api.state

    def __iter__(self):
        return iter((self.api,) if self.admin is None else (self.api, self.admin))


def create_apps(settings: OrchestratorSettings) -> OrchestratorApps:
    """``settings.model`` is a model folder or hub id, already resolved by the entry point."""
    if not settings.model:
        raise ValueError("create_apps needs a model folder or hub id (foundation.model_prep.resolve_model)")
    api_keys = ApiKeys.from_file(settings.api_keys) if settings.api_keys else ApiKeys.disabled()  # fails fast
    model_path = settings.model
    codec = TextCodec(model_path)
    # After the codec: a hub model's tokenizer is downloaded by then, so the fingerprint
    # covers the revision the cache resolved (foundation.model_fingerprint).
    fingerprint = model_fingerprint(model_path)
    orchestrator_id = f"orchestrator-{uuid.uuid4().hex[:8]}"
    fleet = Fleet(WorkerRegistry(fingerprint, settings.heartbeat_timeout_seconds, settings.max_workers),
                  f"tcp://{settings.registry_host}:{settings.registry_port}", orchestrator_id,
                  settings.breaker_settings(), settings.retry_policy(), settings.registry_max_frame_bytes)
    index, metrics, calibration = PrefixIndex(settings.pending_settings()), Metrics(), Calibration()
    index_sync, tiers = IndexSync(index), TierHoldings()
    tier_sync = TierSync(tiers, settings.tier_index_poll_seconds)
    fleet.listeners += [index_sync, tier_sync, StartupCalibration(calibration)]
    policies = {name: make_policy(name, settings.planner_settings()) for name in POLICIES}
    service = CompletionService(fleet, codec, policies, settings.policy, metrics, index,
                                DecisionLog(), calibration, Feedback(index_sync, calibration, metrics),
                                settings.worker_timeout_seconds, settings.admission_wait_seconds,
                                settings.max_attempts, settings.queue_wait_limit_seconds, settings.recent_activity(),
                                tiers)
    model_name = settings.served_model_name or Path(model_path).name

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await fleet.start()
        logger.info("%s serving '%s' (fingerprint %s, policy %s)", orchestrator_id, model_name,
                    fingerprint, settings.policy)
        try:
            yield
        finally:
            await index_sync.stop()
            await tier_sync.stop()
            await fleet.stop()

    rate_limits = TenantRateLimits(settings.default_rate_limit(), api_keys.rate_limits,
                                   on_limited=metrics.observe_rate_limited)
    limits = InputLimits(settings.max_prompts_per_request, settings.max_stop_sequences, settings.max_stop_length,
                         settings.tokenize_in_thread_chars)
    security = zmq_auth.current()
    context = ApiContext(service, model_name, settings.max_model_len, fingerprint, api_keys, index_sync,
                         settings.allow_policy_override, rate_limits, limits,
                         salt_secret=security.keys.salt_secret if security.keys else None,
                         tpot_target_seconds=settings.tpot_target_seconds)
    api = _http_app(FastAPI(title="kvroute", lifespan=lifespan), settings, metrics, build_routers(context))
    api.state.fleet = fleet
    api.state.model_name = model_name
    if not settings.separate_admin_listener:
        for router in admin_routers(context):
            api.include_router(router)
        return OrchestratorApps(api)
    admin = _http_app(FastAPI(title="kvroute admin"), settings, metrics, admin_routers(context))
    admin.state = api.state  # the topology ``kvroute serve`` sets, for /admin/workers
    return OrchestratorApps(api, admin)


def _http_app(app: FastAPI, settings: OrchestratorSettings, metrics: Metrics, routers: list[APIRouter]) -> FastAPI:
    install_handlers(app)
    app.add_middleware(BodySizeLimit, limit=settings.max_request_bytes)
    app.add_middleware(RequestCounter, metrics=metrics)  # outermost: counts the 413s too
    for router in routers:
        app.include_router(router)
    return app


def run_orchestrator(settings: OrchestratorSettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(),
                        format=LOG_FORMAT)
    settings.configure_security()
    settings.configure_tracing()
    servers = listeners(create_apps(settings), settings, graceful_seconds=10)

    async def serve() -> None:
        stop_on_signals(servers)
        await serve_all(servers)

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve())
    finally:
        tracing.shutdown()  # the last requests' spans are exported, not lost

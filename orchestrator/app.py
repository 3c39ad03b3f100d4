"""Assembling the orchestrator: model, tokenizer, fleet, policy, service, HTTP app."""

from __future__ import annotations

import logging
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from foundation.model_fingerprint import model_fingerprint
from orchestrator.api import ApiContext, build_routers
from orchestrator.auth import ApiKeys
from orchestrator.decisions import DecisionLog
from orchestrator.errors import install_handlers
from orchestrator.feedback import Feedback
from orchestrator.fleet import Fleet
from orchestrator.http_middleware import BodySizeLimit, RequestCounter
from orchestrator.index import PrefixIndex
from orchestrator.index_sync import IndexSync
from orchestrator.metrics import Metrics
from orchestrator.planner.calibration import Calibration
from orchestrator.planner.policies import POLICIES, make_policy
from orchestrator.rate_limit import TenantRateLimits
from orchestrator.registry import WorkerRegistry
from orchestrator.service import CompletionService
from orchestrator.settings import OrchestratorSettings
from orchestrator.startup_calibration import StartupCalibration
from orchestrator.tokenization import TextCodec

logger = logging.getLogger("kvroute.orchestrator")


def create_app(settings: OrchestratorSettings) -> FastAPI:
    """``settings.model`` is a model folder or hub id, already resolved by the entry point."""
    if not settings.model:
        raise ValueError("create_app needs a model folder or hub id (foundation.model_prep.resolve_model)")
    model_path = settings.model
    codec = TextCodec(model_path)
    # After the codec: a hub model's tokenizer is downloaded by then, so the fingerprint
    # covers the revision the cache resolved (foundation.model_fingerprint).
    fingerprint = model_fingerprint(model_path)
    orchestrator_id = f"orchestrator-{uuid.uuid4().hex[:8]}"
    fleet = Fleet(WorkerRegistry(fingerprint, settings.heartbeat_timeout_seconds),
                  f"tcp://{settings.registry_host}:{settings.registry_port}", orchestrator_id,
                  settings.breaker_settings(), settings.retry_policy())
    index, metrics, calibration = PrefixIndex(settings.pending_settings()), Metrics(), Calibration()
    index_sync = IndexSync(index)
    fleet.listeners += [index_sync, StartupCalibration(calibration)]
    policies = {name: make_policy(name, settings.planner_settings()) for name in POLICIES}
    service = CompletionService(fleet, codec, policies, settings.policy, metrics, index,
                                DecisionLog(), calibration, Feedback(index_sync, calibration, metrics),
                                settings.worker_timeout_seconds, settings.admission_wait_seconds,
                                settings.max_attempts, settings.queue_wait_limit_seconds)
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
            await fleet.stop()

    app = FastAPI(title="kvroute", lifespan=lifespan)
    app.state.fleet = fleet
    app.state.model_name = model_name
    install_handlers(app)
    app.add_middleware(BodySizeLimit, limit=settings.max_request_bytes)
    app.add_middleware(RequestCounter, metrics=service.metrics)  # outermost: counts the 413s too
    api_keys = ApiKeys.from_file(settings.api_keys) if settings.api_keys else ApiKeys.disabled()
    rate_limits = TenantRateLimits(settings.default_rate_limit(), api_keys.rate_limits,
                                   on_limited=metrics.observe_rate_limited)
    context = ApiContext(service, model_name, settings.max_model_len, fingerprint, api_keys, index_sync,
                         settings.allow_policy_override, rate_limits)
    for router in build_routers(context):
        app.include_router(router)
    return app


def run_orchestrator(settings: OrchestratorSettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), **settings.http_server_options(), timeout_graceful_shutdown=10)

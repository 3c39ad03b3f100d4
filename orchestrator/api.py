"""The OpenAI-compatible HTTP API: routes, request → Job, and response shapes."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from foundation import wire
from foundation.identity import Namespace
from orchestrator.auth import ApiKeys, Principal
from orchestrator.errors import APIError, error_body
from orchestrator.index_sync import IndexSync
from orchestrator.input_limits import InputLimits
from orchestrator.planner.settings import DEFAULT_TPOT_TARGET_SECONDS, TPOT_TARGET_BOUNDS
from orchestrator.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from orchestrator.rate_limit import TenantRateLimits
from orchestrator.request_tracing import ApiCall
from orchestrator.service import CompletionService, Delta, Job, Outcome
from orchestrator.tokenization import PromptError

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
POLICY_HEADER = "X-KVRoute-Policy"
TPOT_TARGET_HEADER = "X-KVRoute-TPOT-Target"  # seconds per output token, e.g. 0.05
DECISIONS_LIMIT = 100


@dataclass
class ApiContext:
    service: CompletionService
    model_name: str
    max_model_len: int
    model_fingerprint: str
    api_keys: ApiKeys
    index_sync: IndexSync
    allow_policy_override: bool = False
    rate_limits: TenantRateLimits = field(default_factory=TenantRateLimits)
    limits: InputLimits = field(default_factory=InputLimits)
    salt_secret: bytes | None = None  # the cluster's (foundation.cluster_keys); None: unkeyed salts
    tpot_target_seconds: float = DEFAULT_TPOT_TARGET_SECONDS  # a request's unless its header asks another

    def authenticate(self, request: Request) -> Principal:
        """The caller's principal (401 without a valid key), kept on ``request.state``."""
        request.state.principal = self.api_keys.authenticate(request.headers.get("authorization"))
        return request.state.principal

    def namespace(self, request: Request) -> Namespace:
        principal = request.state.principal
        return Namespace(model_fingerprint=self.model_fingerprint, tenant=principal.tenant, scope=principal.scope)

    def policy_for(self, request: Request) -> str | None:
        name = request.headers.get(POLICY_HEADER)
        if name is None:
            return None
        if not self.allow_policy_override:
            raise APIError(400, f"{POLICY_HEADER} needs the orchestrator's --allow-policy-override",
                           param=POLICY_HEADER, code="policy_override_disabled")
        if name not in self.service.policies:
            raise APIError(400, f"unknown policy {name!r}; choose one of {', '.join(self.service.policies)}",
                           param=POLICY_HEADER, code="unknown_policy")
        return name

    def tpot_target_for(self, request: Request) -> float:
        """The TPOT target the request's header asks for, within ``TPOT_TARGET_BOUNDS``; else the default."""
        value = request.headers.get(TPOT_TARGET_HEADER)
        if value is None:
            return self.tpot_target_seconds
        low, high = TPOT_TARGET_BOUNDS
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not low <= seconds <= high:  # NaN and infinities too
            raise APIError(400, f"{TPOT_TARGET_HEADER} must be seconds per output token from {low:g} to {high:g}, "
                                f"got {value!r}", param=TPOT_TARGET_HEADER, code="invalid_tpot_target")
        return seconds


def build_routers(context: ApiContext) -> list[APIRouter]:
    """The public route (health) and the routes that need an API key when keys are set. The
    operator's routes (``/admin``, ``/metrics``) are ``orchestrator.admin_routes``."""
    async def authenticate(request: Request) -> None:
        context.authenticate(request)

    public, router = APIRouter(), APIRouter(dependencies=[Depends(authenticate)])
    service, codec, limits = context.service, context.service.codec, context.limits

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": context.model_name, "object": "model",
                                            "created": 0, "owned_by": "kvroute"}]}

    @public.get("/health")
    async def health():
        fleet = service.fleet
        body = {f"{role}_workers": len(fleet.live(role)) for role in wire.ROLES}
        return JSONResponse({"status": "ok" if fleet.can_serve() else "unavailable", **body},
                            status_code=200 if fleet.can_serve() else 503)

    @router.get("/v1/decisions")
    async def recent_decisions(request: Request, limit: int = Query(20, ge=1, le=DECISIONS_LIMIT)):
        records = service.decisions.recent(limit, _visible_tenant(request))
        return {"object": "list", "data": [r.to_dict() for r in records]}

    @router.get("/v1/decisions/{response_id}")
    async def decisions_of(response_id: str, request: Request):
        # Another tenant's record answers as an unknown one: its existence is not the caller's to learn.
        records = service.decisions.by_response(response_id, _visible_tenant(request))
        if not records:
            raise APIError(404, f"no decision record for '{response_id}' (unknown, or aged out)",
                           param="response_id", code="decision_not_found")
        return {"object": "list", "data": [r.to_dict() for r in records]}

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_request(body, context)
        context.rate_limits.admit(request.state.principal.tenant)
        messages = [m.as_template_message() for m in body.messages]
        size = sum(len(m["content"]) for m in messages)
        prompt = await tokenize_off_loop_if_large(size, limits.tokenize_in_thread_chars, _encode_chat, codec,
                                                  messages)
        shape = ChatShape(context.model_name)
        return await _respond(service, body, _jobs(body, [prompt], context, request, shape), shape, request.headers)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_request(body, context)
        texts = body.prompts()
        limits.check_prompt_count(len(texts))
        context.rate_limits.admit(request.state.principal.tenant, cost=len(texts))
        size = sum(len(t) for t in texts if isinstance(t, str))
        prompts = await tokenize_off_loop_if_large(size, limits.tokenize_in_thread_chars, _encode_prompts, codec,
                                                   texts)
        shape = TextShape(context.model_name)
        return await _respond(service, body, _jobs(body, prompts, context, request, shape), shape, request.headers)

    return [public, router]


def _visible_tenant(request: Request) -> str | None:
    """Whose decision records the caller may read: its tenant's, or every tenant's (None) for an admin."""
    principal = request.state.principal
    return None if principal.admin else principal.tenant


def _check_request(body: _Sampling, context: ApiContext) -> None:
    if body.model != context.model_name:
        raise APIError(404, f"the model '{body.model}' does not exist; this server serves "
                            f"'{context.model_name}'", param="model", code="model_not_found")
    if (name := body.unsupported_parameter()) is not None:
        raise APIError(400, f"'{name}' is not supported by kvroute", param=name, code="unsupported_parameter")
    context.limits.check_stops(body.stop_strings())


async def tokenize_off_loop_if_large(size: int, threshold: int, encode, *args):
    """Tokenizing a large body takes milliseconds to seconds; on a worker thread the event loop
    keeps streaming every other request meanwhile. Small ones stay inline: a thread hop
    costs more than they do."""
    if size >= threshold:
        return await asyncio.to_thread(encode, *args)
    return encode(*args)


def _encode_chat(codec, messages: list[dict]) -> list[int]:
    try:
        return codec.encode_chat(messages)
    except PromptError as error:
        raise APIError(400, str(error), param="messages") from error


def _encode_prompts(codec, prompts: list[str | list[int]]) -> list[list[int]]:
    return [_encode_prompt(codec, prompt) for prompt in prompts]


def _encode_prompt(codec, prompt: str | list[int]) -> list[int]:
    try:
        if isinstance(prompt, str):
            return codec.encode_text(prompt)
        codec.check_token_ids(prompt)
        return prompt
    except PromptError as error:
        raise APIError(400, str(error), param="prompt") from error


def _jobs(body: _Sampling, prompts: list[list[int]], context: ApiContext, request: Request,
          shape: ChatShape) -> list[Job]:
    response_id = shape.id_prefix + uuid.uuid4().hex
    policy, tpot_target = context.policy_for(request), context.tpot_target_for(request)
    salt = context.namespace(request).cache_salt(context.salt_secret)
    tenant = request.state.principal.tenant
    jobs = [_job(body, prompt, context) for prompt in prompts]
    for index, job in enumerate(jobs):
        job.response_id, job.choice_index, job.policy, job.cache_salt = response_id, index, policy, salt
        job.tenant, job.sampling = tenant, msgspec.structs.replace(job.sampling, tpot_target=tpot_target)
    return jobs


def _job(body: _Sampling, prompt: list[int], context: ApiContext) -> Job:
    room = context.max_model_len - len(prompt)
    if room < 1:
        raise APIError(400, f"the prompt is {len(prompt)} tokens; this model's context is "
                            f"{context.max_model_len} tokens", param="messages", code="context_length_exceeded")
    default = DEFAULT_COMPLETION_MAX_TOKENS if isinstance(body, CompletionRequest) else room
    max_tokens = body.requested_max_tokens() or default
    if max_tokens > room:
        raise APIError(400, f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                            f"context of {context.max_model_len} tokens", param="max_tokens",
                       code="context_length_exceeded")
    if body.min_tokens > max_tokens:
        raise APIError(400, "min_tokens must not exceed max_tokens", param="min_tokens")
    sampling = wire.SamplingSpec(
        max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed, min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos)
    return Job(prompt_token_ids=prompt, sampling=sampling, cache_salt="", stop=body.stop_strings())


# ---------------------------------------------------------------- response shapes


class ChatShape:
    object_name, chunk_name, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"
    operation, route = "chat", "/v1/chat/completions"  # as the request's span names them

    def __init__(self, model: str):
        self.model = model

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        # ``refusal`` is required by OpenAI's schema (null when there is none).
        return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, index: int, delta: Delta, first: bool) -> dict:
        content = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        return {"index": index, "delta": content, "logprobs": None, "finish_reason": delta.finish_reason}


class TextShape(ChatShape):
    object_name, chunk_name, id_prefix = "text_completion", "text_completion", "cmpl-"
    operation, route = "text_completion", "/v1/completions"

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, index: int, delta: Delta, first: bool) -> dict:
        return {"index": index, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}


def usage(jobs: list[Job], outcomes: list[Outcome]) -> dict:
    prompt = sum(len(job.prompt_token_ids) for job in jobs)
    completion = sum(outcome.completion_tokens for outcome in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outcomes),
                                      "tier_cached_tokens": sum(o.tier_tokens for o in outcomes)}}


async def _respond(service: CompletionService, body: _Sampling, jobs: list[Job], shape: ChatShape,
                   headers: Mapping[str, str]):
    envelope = {"id": jobs[0].response_id, "created": int(time.time()), "model": shape.model}
    outcomes = [Outcome() for _ in jobs]
    call = ApiCall(shape.operation, shape.route, shape.model, jobs, headers)
    if body.stream:
        events = _sse(service, jobs, outcomes, shape, envelope, body.include_usage(), call)
        # Admission happens on the way to the first event: a request that cannot be placed
        # (429 with Retry-After, 503) gets that status, not a 200 stream holding an error.
        first = await anext(events)
        return StreamingResponse(_prepend(first, events), media_type="text/event-stream")
    with call.until_done(outcomes):
        texts = await asyncio.gather(*(_collect(service, job, outcome) for job, outcome in zip(jobs, outcomes)))
    choices = [shape.choice(i, text, o.finish_reason) for i, (text, o) in enumerate(zip(texts, outcomes))]
    return json_response({**envelope, "object": shape.object_name, "choices": choices, "usage": usage(jobs, outcomes)})


async def _collect(service: CompletionService, job: Job, outcome: Outcome) -> str:
    return "".join([delta.text async for delta in service.stream(job, outcome)])


async def _sse(service, jobs, outcomes, shape, envelope, include_usage: bool, call: ApiCall) -> AsyncIterator[bytes]:
    base = {**envelope, "object": shape.chunk_name}
    extra = {"usage": None} if include_usage else {}
    started = False
    with call.until_done(outcomes):
        try:
            async for index, delta, first in _merged(service, jobs, outcomes):
                started = True
                yield _event({**base, "choices": [shape.chunk_choice(index, delta, first)], **extra})
            if include_usage:
                yield _event({**base, "choices": [], "usage": usage(jobs, outcomes)})
        except APIError as error:
            if not started:
                raise  # nothing sent yet: the caller answers with the error's own status
            call.fail(error)
            yield _event(error_body(error.status, error.message, error.param, error.code))
        yield b"data: [DONE]\n\n"


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    async with aclosing(rest):
        yield first
        async for event in rest:
            yield event


async def _merged(service, jobs, outcomes) -> AsyncIterator[tuple[int, Delta, bool]]:
    """Interleave the deltas of several jobs (one per prompt) as they arrive."""
    if len(jobs) == 1:
        first = True
        async for delta in service.stream(jobs[0], outcomes[0]):
            yield 0, delta, first
            first = False
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            first = True
            async for delta in service.stream(jobs[index], outcomes[index]):
                await queue.put((index, delta, first))
                first = False
        except APIError as error:
            await queue.put(error)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(jobs))]
    try:
        for _ in range(len(jobs)):
            while (item := await queue.get()) is not None:
                if isinstance(item, APIError):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_json = msgspec.json.Encoder()


def json_response(payload: dict, headers: dict[str, str] | None = None) -> Response:
    """A JSON response encoded once by msgspec. A dict returned from a route would go
    through FastAPI's jsonable_encoder first, which walks it in Python on every request;
    and msgspec writes a non-finite float as null, which every JSON parser reads."""
    return Response(_json.encode(payload), media_type="application/json", headers=headers)


def _event(payload: dict) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"

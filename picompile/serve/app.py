"""The OpenAI-compatible HTTP server (FastAPI on uvicorn): ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (whole responses, or server-sent events in OpenAI's chunk format ending with
``data: [DONE]``), ``GET /health``.

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: malformed JSON and requests that
cannot be served (beyond the context, unsupported options) are 400, an unknown model 404, wrong types and
values out of range 422 (pydantic, ``schemas.py``), a full queue or a server shutting down 503.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from picompile.errors import InputError
from picompile.runtime.sampling import SamplingParams
from picompile.serve.chat import chat_ids, has_template
from picompile.serve.scheduler import Event, QueueFull, Scheduler, ShuttingDown
from picompile.serve.schemas import ChatCompletionRequest, CompletionRequest, _Sampling, error

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error(message, type_, param, code)


@dataclass
class ServerState:
    session: Any
    scheduler: Scheduler
    model_id: str
    template: str | None
    created: int


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    first = e.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    return f"{loc}: {first.get('msg', 'invalid value')}" if loc else str(first.get("msg")), loc or None


async def _body(request: Request, model: type[_Sampling]) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        msg, param = _validation_message(e)
        raise ApiError(422, msg, param=param) from None


def _check_common(state: ServerState, body: _Sampling) -> SamplingParams:
    if body.model != state.model_id:
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {state.model_id!r}",
                       param="model", code="model_not_found")
    why = body.unsupported()
    if why:
        raise ApiError(400, why)
    return SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
                          repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                          frequency_penalty=body.frequency_penalty, seed=body.seed, stop=body.stops())


def _fit(state: ServerState, ids: list[int], max_tokens: int | None, default: int | None) -> int:
    ctx = state.session.max_seq_len
    if len(ids) >= ctx:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is {ctx} tokens",
                       param="messages" if default is None else "prompt", code="context_length_exceeded")
    room = ctx - len(ids)
    want = max_tokens if max_tokens is not None else (default if default is not None else room)
    if want > room:
        raise ApiError(400, f"the prompt has {len(ids)} tokens and max_tokens is {want}, but this model's context "
                            f"is {ctx} tokens (at most {room} new tokens fit)", param="max_tokens",
                       code="context_length_exceeded")
    return want


def _completion_ids(state: ServerState, body: CompletionRequest) -> list[int]:
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], str):
        if len(p) != 1:
            raise ApiError(400, f"one prompt per request is supported, got {len(p)}", param="prompt")
        p = p[0]
    s = state.session
    try:
        if isinstance(p, str):
            if s.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: give the prompt as token ids", param="prompt")
            ids = list(s.tokenizer.encode(p))
        else:
            ids = [int(i) for i in p]
    except InputError as e:
        raise ApiError(400, str(e), param="prompt") from None
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    bad = [i for i in ids if not 0 <= i < s.vocab_size]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{s.vocab_size - 1})", param="prompt")
    return ids


def _submit(state: ServerState, ids: list[int], max_tokens: int, params: SamplingParams, body: _Sampling) -> Any:
    try:
        return state.scheduler.submit(ids, max_tokens, params, asyncio.get_running_loop(), not body.ignore_eos)
    except (QueueFull, ShuttingDown) as e:
        raise ApiError(503, str(e), type_="server_error", code="overloaded" if isinstance(e, QueueFull)
                       else "shutting_down") from None


async def _events(state: ServerState, req: Any) -> AsyncIterator[Event]:
    """The request's events until it ends; cancelling the consumer (a client gone) cancels the request."""
    try:
        while True:
            ev: Event = await req.events.get()
            yield ev
            if ev.finish_reason is not None or ev.error is not None:
                return
    finally:
        state.scheduler.cancel(req)  # a no-op once the request has finished; frees its slot when it has not


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="picompile", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.picompile = state

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body, status_code=e.status)

    @app.exception_handler(404)
    async def _not_found(request: Request, _: Exception) -> JSONResponse:
        return JSONResponse(error(f"no route {request.method} {request.url.path}", code="not_found"), status_code=404)

    @app.exception_handler(405)
    async def _bad_method(request: Request, _: Exception) -> JSONResponse:
        return JSONResponse(error(f"{request.method} is not allowed on {request.url.path}"), status_code=405)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "shutting_down" if state.scheduler.closing else "ok", "model": state.model_id,
                **state.scheduler.stats()}

    def model_card() -> dict[str, Any]:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "picompile",
                "max_model_len": state.session.max_seq_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        if model_id != state.model_id:
            raise ApiError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body: CompletionRequest = await _body(request, CompletionRequest)
        params = _check_common(state, body)
        ids = _completion_ids(state, body)
        max_tokens = _fit(state, ids, body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS)
        prefix = state.session.decode(ids) if body.echo and isinstance(body.prompt, (str, list)) else ""
        req = _submit(state, ids, max_tokens, params, body)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created, "model": state.model_id,
                    "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage

            async def stream() -> AsyncIterator[str]:
                if prefix:
                    yield _sse(chunk(prefix, None))
                async for ev in _events(state, req):
                    if ev.error is not None:
                        yield _sse(error(ev.error, "server_error"))
                        break
                    if ev.delta or ev.finish_reason:
                        yield _sse(chunk(ev.delta, ev.finish_reason))
                    if ev.finish_reason and usage:
                        yield _sse({**chunk("", None), "choices": [], "usage": _usage(len(ids), ev.completion_tokens)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, last = prefix, Event()
        async for ev in _events(state, req):
            if ev.error is not None:
                raise ApiError(503, ev.error, type_="server_error")
            text += ev.delta
            last = ev
        return {**chunk(text, last.finish_reason), "usage": _usage(len(ids), last.completion_tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body: ChatCompletionRequest = await _body(request, ChatCompletionRequest)
        params = _check_common(state, body)
        tok = state.session.tokenizer
        if tok is None or not has_template(tok, state.template):
            raise ApiError(400, "this model has no chat template; start the server with --template FILE "
                                "(a Jinja chat template), or use /v1/completions", param="messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        try:
            ids = chat_ids(tok, messages, state.template)
        except InputError as e:
            raise ApiError(400, str(e), param="messages") from None
        max_tokens = _fit(state, ids, body.max_completion_tokens or body.max_tokens, None)
        req = _submit(state, ids, max_tokens, params, body)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_id,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage

            async def stream() -> AsyncIterator[str]:
                yield _sse(chunk({"role": "assistant", "content": ""}, None))
                async for ev in _events(state, req):
                    if ev.error is not None:
                        yield _sse(error(ev.error, "server_error"))
                        break
                    if ev.delta:
                        yield _sse(chunk({"content": ev.delta}, None))
                    if ev.finish_reason:
                        yield _sse(chunk({}, ev.finish_reason))
                        if usage:
                            yield _sse({**chunk({}, None), "choices": [],
                                        "usage": _usage(len(ids), ev.completion_tokens)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, last = "", Event()
        async for ev in _events(state, req):
            if ev.error is not None:
                raise ApiError(503, ev.error, type_="server_error")
            text += ev.delta
            last = ev
        return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": last.finish_reason}],
                "usage": _usage(len(ids), last.completion_tokens)}

    return app

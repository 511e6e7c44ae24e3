"""The HTTP API (aiohttp): OpenAI-style completions and chat over an engine loop thread.

Routes:
- POST /v1/completions: see engine.server.protocol for the body; `stream: true`
  answers with server-sent events (`data: {chunk}` per step that produced text, a
  final chunk with `finish_reason`, optionally a `usage` chunk, then `data: [DONE]`).
  Errors: 400 for bad input (`error.param` names the field), 503 when the request can
  never fit the cache or the engine has stopped, 500 if the engine failed mid-request.
  A `model` other than the served one: 404, `error.code` "model_not_found".
  `usage.prompt_tokens_details.cached_tokens`: prompt tokens reused from the cache (what
  the segment lookups found; also `timings.reused_prompt_tokens`).
- POST /v1/chat/completions: OpenAI chat (streamed or not); the messages are rendered
  through the model's chat template into prompt segments, content parts marked
  `"cache": true` staying whole cacheable segments (engine.server.chat has the body and
  the rendering rule); errors, `usage` and `timings` as for /v1/completions. Streamed:
  a first chunk with the assistant role, `delta.content` pieces, a chunk with
  `finish_reason`, the optional usage chunk, `data: [DONE]`.
- GET /v1/models: the one served model (its name: `--served-model-name`, else the
  preset's name or the checkpoint directory's name; `created`: when this server started).
- GET /health: 200 `{"status": "ok", "model", "prefill_graphs", "decode_graphs",
  "recurrence_kernels"}` while the engine loop runs (`prefill_graphs`: mode, ready,
  captured, pending_buckets, capture_s; null without stages; `decode_graphs`: mode,
  captured_buckets, pending_buckets, capture_s, failed; `recurrence_kernels`: the fla
  patterns warmed and left, engine.pic.kernel_warmup), else 503.
- GET /metrics: Prometheus text format (engine.server.metrics).

Every error is OpenAI-shaped JSON (`{"error": {message, type, param, code}}`), also an
unknown route (404, code "not_found") and a wrong method (405, "method_not_allowed").

`serve()` runs it until interrupted; `start_server()` starts it on a running asyncio
loop and returns the runner (tests, embedding).
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import uuid
from typing import Any, Optional

from aiohttp import web

from engine.engine import LLMEngine, RequestOutput
from engine.errors import CapacityError, EngineStoppedError, InvalidRequestError
from engine.runtime.sampling import SamplingParams
from engine.server import chat, protocol
from engine.server.metrics import CONTENT_TYPE, ServerMetrics
from engine.server.worker import AsyncEngineClient, EngineLoop

log = logging.getLogger(__name__)

ENGINE_LOOP_KEY = web.AppKey("engine_loop", EngineLoop)
METRICS_KEY = web.AppKey("metrics", ServerMetrics)
MODEL_NAME_KEY = web.AppKey("model_name", str)
STARTED_KEY = web.AppKey("started", int)


def _json_error(status: int, message: str, field: Optional[str] = None, kind: str = "invalid_request_error",
                code: Optional[str] = None) -> web.Response:
    return web.json_response(protocol.error_body(message, field, kind, code), status=status)


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own errors (no route, wrong method, body too large) as OpenAI-shaped JSON
    instead of text/plain."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        message = f"{request.method} {request.path}: {exc.reason}"
        if isinstance(exc, web.HTTPMethodNotAllowed):
            message += f" (allowed: {', '.join(sorted(exc.allowed_methods))})"
        resp = _json_error(exc.status, message, None, "invalid_request_error", codes.get(exc.status))
        if "Allow" in exc.headers:
            resp.headers["Allow"] = exc.headers["Allow"]
        return resp


def _timings(out: RequestOutput) -> dict[str, Any]:
    tl = out.timeline

    def ms(v: Optional[float]) -> Optional[float]:
        return None if v is None else round(v * 1000.0, 3)

    return {
        "ttft_ms": ms(tl.ttft),
        "queue_ms": ms(tl.queue_time),
        "e2e_ms": ms(tl.e2e),
        "decode_tokens_per_s": tl.decode_tokens_per_s,
        "reused_prompt_tokens": out.num_reused_tokens,
        "prefill_split_ms": {k: ms(v) for k, v in tl.prefill_split.items()},
    }


def _sampling_params(req: protocol.CompletionRequest) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stop_strings=req.stop,
        seed=req.seed,
    )


async def _read_json(request: web.Request) -> Any:
    """The decoded body, or `InvalidRequestError` naming the body."""
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError("body", f"not valid JSON ({exc})") from exc


class _StreamChunks:
    """What one route's stream chunks look like (completions or chat)."""

    def __init__(self, completion_id: str, model: str, created: int) -> None:
        self.id, self.model, self.created = completion_id, model, created

    def head(self) -> Optional[dict[str, Any]]:
        return None

    def piece(self, text: str, finish_reason: Optional[str]) -> dict[str, Any]:
        return protocol.completion_body(self.id, self.model, text, finish_reason, created=self.created)

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        body = protocol.completion_body(self.id, self.model, "", None, created=self.created)
        body["choices"] = []
        body["usage"] = usage
        return body


class _ChatStreamChunks(_StreamChunks):
    def head(self) -> Optional[dict[str, Any]]:
        return chat.chat_chunk(self.id, self.model, self.created, {"role": "assistant", "content": ""})

    def piece(self, text: str, finish_reason: Optional[str]) -> dict[str, Any]:
        return chat.chat_chunk(self.id, self.model, self.created, {"content": text} if text else {}, finish_reason)

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        body = chat.chat_chunk(self.id, self.model, self.created, None)
        body["usage"] = usage
        return body


async def _start(app: web.Application, request_id: str, params: SamplingParams, prompt: Any,
                 token_ids: Optional[list[int]], field_names: dict[str, str]) -> tuple[Any, Any]:
    """Submit a request; returns (its output stream, its first output) or an error
    response as (None, response). `field_names` maps the engine's argument names to the
    route's fields in a 400."""
    metrics = app[METRICS_KEY]
    client = AsyncEngineClient(app[ENGINE_LOOP_KEY])
    outputs = client.stream(request_id, params, prompt=prompt, prompt_token_ids=token_ids)
    try:
        return outputs, await outputs.__anext__()
    except InvalidRequestError as exc:
        metrics.observe_rejected("invalid")
        field = field_names.get(exc.field, exc.field)
        return None, _json_error(400, f"{field}: {exc.message}", field)
    except CapacityError as exc:
        metrics.observe_rejected("capacity")
        return None, _json_error(503, str(exc), None, "capacity_error")
    except EngineStoppedError as exc:
        return None, _json_error(503, str(exc), None, "engine_stopped")


async def _last_output(outputs: Any, first: RequestOutput) -> RequestOutput:
    last = first
    try:
        async for out in outputs:
            last = out
    finally:
        await outputs.aclose()
    return last


def _usage(out: RequestOutput) -> dict[str, Any]:
    return protocol.usage_body(out.num_prompt_tokens, len(out.token_ids), out.num_reused_tokens)


async def handle_completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    metrics = app[METRICS_KEY]
    model = app[MODEL_NAME_KEY]
    try:
        creq = protocol.parse_completion_request(await _read_json(request))
    except InvalidRequestError as exc:
        metrics.observe_rejected("invalid")
        return _json_error(400, str(exc), exc.field)

    if creq.model is not None and creq.model != model:
        metrics.observe_rejected("invalid")
        return web.json_response(protocol.model_error(creq.model, model), status=404)

    completion_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if creq.segments is not None:
        prompt, token_ids = creq.segments, None
    elif isinstance(creq.prompt, str):
        prompt, token_ids = creq.prompt, None
    else:
        prompt, token_ids = None, creq.prompt
    # the engine names its own arguments; map them to this API's fields
    outputs, first = await _start(app, completion_id, _sampling_params(creq), prompt, token_ids,
                                  {"prompt_token_ids": "prompt", "max_new_tokens": "max_tokens"})
    if outputs is None:
        return first

    if creq.stream:
        return await _stream_response(request, outputs, first, _StreamChunks(completion_id, model, created),
                                      creq.include_usage)
    last = await _last_output(outputs, first)
    if last.error is not None:
        return _json_error(500, last.error, None, "engine_error")
    return web.json_response(
        protocol.completion_body(completion_id, model, last.text, last.finish_reason, usage=_usage(last),
                                 timings=_timings(last), created=created)
    )


def _chat_prompt(engine: LLMEngine, req: chat.ChatRequest) -> tuple[list[dict[str, Any]], int]:
    """The conversation's segments and max_tokens (when not given: OpenAI's default, up to
    the end of the context or of what the cache holds for one sequence)."""
    segments = chat.render_segments(engine.tokenizer, req.messages, req.template_kwargs)
    max_tokens = req.sampling.max_tokens
    if max_tokens is None:
        token_ids, _ = engine.check_prompt(segments, SamplingParams(max_new_tokens=1))
        max_tokens = engine.max_new_tokens_for(len(token_ids))
        if max_tokens < 1:
            raise InvalidRequestError("messages", f"{len(token_ids)} prompt tokens leave no room for an answer")
    return segments, max_tokens


async def handle_chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions: the conversation rendered through the chat template
    into segments (engine.server.chat), then generated as a completion is."""
    app = request.app
    metrics = app[METRICS_KEY]
    model = app[MODEL_NAME_KEY]
    engine = app[ENGINE_LOOP_KEY].engine
    try:
        req = chat.parse_chat_request(await _read_json(request))
        fields = req.sampling
        if fields.model is not None and fields.model != model:
            metrics.observe_rejected("invalid")
            return web.json_response(protocol.model_error(fields.model, model), status=404)
        # rendering and (for the default max_tokens) tokenizing a long conversation take
        # a while: off the event loop
        segments, max_tokens = await asyncio.get_running_loop().run_in_executor(
            None, _chat_prompt, engine, req)
        params = SamplingParams(max_new_tokens=max_tokens, temperature=fields.temperature, top_p=fields.top_p,
                                stop_strings=fields.stop, seed=fields.seed)
    except InvalidRequestError as exc:
        metrics.observe_rejected("invalid")
        field = {"prompt": "messages", "segments": "messages", "max_new_tokens": "max_tokens"}.get(exc.field, exc.field)
        return _json_error(400, f"{field}: {exc.message}", field)

    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    outputs, first = await _start(app, completion_id, params, segments, None,
                                  {"prompt": "messages", "segments": "messages",
                                   "max_new_tokens": req.max_tokens_field})
    if outputs is None:
        return first
    if fields.stream:
        return await _stream_response(request, outputs, first, _ChatStreamChunks(completion_id, model, created),
                                      fields.include_usage)
    last = await _last_output(outputs, first)
    if last.error is not None:
        return _json_error(500, last.error, None, "engine_error")
    return web.json_response(chat.chat_body(completion_id, model, last.text, last.finish_reason, _usage(last),
                                            timings=_timings(last), created=created))


async def _stream_response(
    request: web.Request,
    outputs: Any,
    first: RequestOutput,
    chunks: _StreamChunks,
    include_usage: bool,
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(obj: Any) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
        await resp.write(f"data: {data}\n\n".encode())

    try:
        head = chunks.head()
        if head is not None:
            await send(head)
        out: Optional[RequestOutput] = first
        while out is not None:
            if out.error is not None:
                await send(protocol.error_body(out.error, None, "engine_error"))
                break
            if out.new_text or out.finished:
                chunk = chunks.piece(out.new_text, out.finish_reason if out.finished else None)
                if out.finished:
                    chunk["timings"] = _timings(out)
                await send(chunk)
            if out.finished:
                if include_usage:
                    await send(chunks.usage(_usage(out)))
                break
            out = await outputs.__anext__()
        await send("[DONE]")
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client of %s went away; aborting it", chunks.id)
        raise
    finally:
        await outputs.aclose()  # aborts the request unless it finished
    await resp.write_eof()
    return resp


async def handle_health(request: web.Request) -> web.Response:
    loop = request.app[ENGINE_LOOP_KEY]
    if loop.alive:
        graphs = loop.engine.prefill_graphs
        decode = getattr(loop.engine, "decode_graphs", None)
        kernels = getattr(loop.engine, "recurrence_kernels", None)
        return web.json_response({"status": "ok", "model": request.app[MODEL_NAME_KEY],
                                  "prefill_graphs": None if graphs is None else graphs.snapshot(),
                                  "decode_graphs": None if decode is None else decode.snapshot(),
                                  "recurrence_kernels": None if kernels is None else kernels.snapshot()})
    return web.json_response({"status": "error", "error": str(loop.error or "engine loop stopped")}, status=503)


async def handle_metrics(request: web.Request) -> web.Response:
    metrics = request.app[METRICS_KEY]
    metrics.observe_prefill_graphs(request.app[ENGINE_LOOP_KEY].engine)
    body = metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def handle_models(request: web.Request) -> web.Response:
    name = request.app[MODEL_NAME_KEY]
    created = request.app[STARTED_KEY]
    return web.json_response(
        {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "kvengine"}]}
    )


def build_app(engine: LLMEngine, model_name: Optional[str] = None) -> web.Application:
    """An application serving `engine` under `model_name` (default: the engine's own
    name); its loop thread starts and stops with the app."""
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[json_errors])
    app[STARTED_KEY] = int(time.time())
    name = model_name or engine.model_name
    metrics = ServerMetrics(name)
    app[METRICS_KEY] = metrics
    app[MODEL_NAME_KEY] = name
    app[ENGINE_LOOP_KEY] = EngineLoop(engine, metrics)
    register = getattr(engine.planner, "register_metrics", None)
    if callable(register):  # e.g. the store connector's planner (kvstore metrics, store_available)
        register(metrics.registry)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat_completions)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)

    async def start_loop(app: web.Application) -> None:
        app[ENGINE_LOOP_KEY].start()

    async def stop_loop(app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, app[ENGINE_LOOP_KEY].stop)

    app.on_startup.append(start_loop)
    app.on_cleanup.append(stop_loop)
    return app


async def start_server(engine: LLMEngine, host: str = "127.0.0.1", port: int = 8000,
                       model_name: Optional[str] = None) -> tuple[web.AppRunner, int]:
    """Start serving on the running event loop; returns the runner and the bound port
    (pass port 0 for a free one). Stop with `await runner.cleanup()`."""
    runner = web.AppRunner(build_app(engine, model_name), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = port
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            bound = addr[1]
            break
    return runner, bound


def serve(engine: LLMEngine, host: str = "127.0.0.1", port: int = 8000, model_name: Optional[str] = None) -> None:
    """Serve until SIGINT/SIGTERM under `model_name` (default: the engine's own name).
    Prints the bound address once listening."""

    async def main() -> None:
        runner, bound = await start_server(engine, host, port, model_name)
        print(f"kvengine serving {model_name or engine.model_name} on http://{host}:{bound}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())

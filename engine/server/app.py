"""The HTTP API (aiohttp): OpenAI-style completions over an engine loop thread.

Routes:
- POST /v1/completions: see engine.server.protocol for the body; `stream: true`
  answers with server-sent events (`data: {chunk}` per step that produced text, a
  final chunk with `finish_reason`, optionally a `usage` chunk, then `data: [DONE]`).
  Errors: 400 for bad input (`error.param` names the field), 503 when the request can
  never fit the cache or the engine has stopped, 500 if the engine failed mid-request.
  A `model` other than the served one: 404, `error.code` "model_not_found".
  `usage.prompt_tokens_details.cached_tokens`: prompt tokens reused from the cache (what
  the segment lookups found; also `timings.reused_prompt_tokens`).
- GET /v1/models: the one served model (`created`: when this server started).
- GET /health: 200 `{"status": "ok"}` while the engine loop runs, else 503.
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
from engine.server import protocol
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


async def handle_completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    metrics = app[METRICS_KEY]
    model = app[MODEL_NAME_KEY]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        metrics.observe_rejected("invalid")
        return _json_error(400, f"body: not valid JSON ({exc})", "body")
    try:
        creq = protocol.parse_completion_request(body)
    except InvalidRequestError as exc:
        metrics.observe_rejected("invalid")
        return _json_error(400, str(exc), exc.field)

    if creq.model is not None and creq.model != model:
        metrics.observe_rejected("invalid")
        return web.json_response(protocol.model_error(creq.model, model), status=404)

    client = AsyncEngineClient(app[ENGINE_LOOP_KEY])
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if creq.segments is not None:
        prompt, token_ids = creq.segments, None
    elif isinstance(creq.prompt, str):
        prompt, token_ids = creq.prompt, None
    else:
        prompt, token_ids = None, creq.prompt
    outputs = client.stream(completion_id, _sampling_params(creq), prompt=prompt, prompt_token_ids=token_ids)

    try:
        first = await outputs.__anext__()
    except InvalidRequestError as exc:
        metrics.observe_rejected("invalid")
        # the engine names its own arguments; map them to this API's fields
        field = {"prompt_token_ids": "prompt", "max_new_tokens": "max_tokens"}.get(exc.field, exc.field)
        return _json_error(400, f"{field}: {exc.message}", field)
    except CapacityError as exc:
        metrics.observe_rejected("capacity")
        return _json_error(503, str(exc), None, "capacity_error")
    except EngineStoppedError as exc:
        return _json_error(503, str(exc), None, "engine_stopped")

    if creq.stream:
        return await _stream_response(request, outputs, first, completion_id, created, model, creq.include_usage)

    last = first
    try:
        async for out in outputs:
            last = out
    finally:
        await outputs.aclose()
    if last.error is not None:
        return _json_error(500, last.error, None, "engine_error")
    return web.json_response(
        protocol.completion_body(
            completion_id,
            model,
            last.text,
            last.finish_reason,
            usage=protocol.usage_body(last.num_prompt_tokens, len(last.token_ids), last.num_reused_tokens),
            timings=_timings(last),
            created=created,
        )
    )


async def _stream_response(
    request: web.Request,
    outputs: Any,
    first: RequestOutput,
    completion_id: str,
    created: int,
    model: str,
    include_usage: bool,
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(obj: Any) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
        await resp.write(f"data: {data}\n\n".encode())

    try:
        out: Optional[RequestOutput] = first
        while out is not None:
            if out.error is not None:
                await send(protocol.error_body(out.error, None, "engine_error"))
                break
            if out.new_text or out.finished:
                chunk = protocol.completion_body(
                    completion_id, model, out.new_text, out.finish_reason if out.finished else None, created=created
                )
                if out.finished:
                    chunk["timings"] = _timings(out)
                await send(chunk)
            if out.finished:
                if include_usage:
                    usage = protocol.completion_body(completion_id, model, "", None, created=created)
                    usage["choices"] = []
                    usage["usage"] = protocol.usage_body(out.num_prompt_tokens, len(out.token_ids),
                                                         out.num_reused_tokens)
                    await send(usage)
                break
            out = await outputs.__anext__()
        await send("[DONE]")
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client of %s went away; aborting it", completion_id)
        raise
    finally:
        await outputs.aclose()  # aborts the request unless it finished
    await resp.write_eof()
    return resp


async def handle_health(request: web.Request) -> web.Response:
    loop = request.app[ENGINE_LOOP_KEY]
    if loop.alive:
        return web.json_response({"status": "ok", "model": request.app[MODEL_NAME_KEY]})
    return web.json_response({"status": "error", "error": str(loop.error or "engine loop stopped")}, status=503)


async def handle_metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def handle_models(request: web.Request) -> web.Response:
    name = request.app[MODEL_NAME_KEY]
    created = request.app[STARTED_KEY]
    return web.json_response(
        {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "kvengine"}]}
    )


def build_app(engine: LLMEngine) -> web.Application:
    """An application serving `engine`; its loop thread starts and stops with the app."""
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[json_errors])
    app[STARTED_KEY] = int(time.time())
    metrics = ServerMetrics(engine.model_name)
    app[METRICS_KEY] = metrics
    app[MODEL_NAME_KEY] = engine.model_name
    app[ENGINE_LOOP_KEY] = EngineLoop(engine, metrics)
    register = getattr(engine.planner, "register_metrics", None)
    if callable(register):  # e.g. the store connector's planner (kvstore metrics, store_available)
        register(metrics.registry)
    app.router.add_post("/v1/completions", handle_completions)
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


async def start_server(engine: LLMEngine, host: str = "127.0.0.1", port: int = 8000) -> tuple[web.AppRunner, int]:
    """Start serving on the running event loop; returns the runner and the bound port
    (pass port 0 for a free one). Stop with `await runner.cleanup()`."""
    runner = web.AppRunner(build_app(engine), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = port
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            bound = addr[1]
            break
    return runner, bound


def serve(engine: LLMEngine, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve until SIGINT/SIGTERM. Prints the bound address once listening."""

    async def main() -> None:
        runner, bound = await start_server(engine, host, port)
        print(f"kvengine serving {engine.model_name} on http://{host}:{bound}", flush=True)
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

"""The engine loop: one background thread that owns an `LLMEngine` and steps it.

Other threads never touch the engine. They send commands through a queue:
`submit` (add a request; the returned future resolves to its id, or to the engine's
`InvalidRequestError`/`CapacityError`) and `abort`. The loop drains commands, runs one
`engine.step()` while any request is unfinished (and blocks on the queue while idle;
with a planner that has idle work, e.g. computing cold segments other engines offered
through the store, it calls `engine.help_idle()` every `engine.idle_poll_s`; before
that, while prefill-stage graphs are pending (`--prefill-graphs idle`), it captures them
one bucket per idle turn, `engine.capture_idle_graphs()`, checking for commands between
buckets),
and hands each `RequestOutput` to the callback registered with its request, on the
loop thread. `AsyncEngineClient` wraps this for asyncio code (the HTTP server): an
async iterator of a request's outputs that aborts the request if the consumer stops
early (client disconnect).

If a step raises, the loop stops: every live request gets a final output carrying
the error, `error` is set, `/health` reports the failure, and new submissions fail
with `EngineStoppedError`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from engine.engine import LLMEngine, PromptInput, RequestOutput
from engine.errors import EngineError, EngineStoppedError
from engine.runtime.request import RequestTimeline
from engine.runtime.sampling import SamplingParams
from engine.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


@dataclass
class _Submit:
    request_id: str
    prompt: Optional[PromptInput]
    prompt_token_ids: Optional[Sequence[int]]
    params: SamplingParams
    callback: OutputCallback
    future: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str


_STOP = object()


class EngineLoop:
    """Runs an engine in a daemon thread (see the module docstring)."""

    def __init__(self, engine: LLMEngine, metrics: Optional[ServerMetrics] = None, idle_wait_s: float = 0.5) -> None:
        self.engine = engine
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self.error: Optional[BaseException] = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._thread = threading.Thread(target=self._run, name="kvengine-loop", daemon=True)
        self._stopping = False

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the loop to exit after its current step and wait for it."""
        self._stopping = True
        self._commands.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(
        self,
        request_id: str,
        params: SamplingParams,
        callback: OutputCallback,
        prompt: Optional[PromptInput] = None,
        prompt_token_ids: Optional[Sequence[int]] = None,
    ) -> concurrent.futures.Future:
        """Queue a request; `callback` gets each of its outputs on the loop thread."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive or self._stopping:
            fut.set_exception(EngineStoppedError(f"the engine loop is not running ({self.error or 'stopped'})"))
            return fut
        self._commands.put(_Submit(request_id, prompt, prompt_token_ids, params, callback, fut))
        return fut

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # ---- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished()
                warming = self.engine.idle_graphs_pending
                poll = self.engine.idle_poll_s
                wait = self.idle_wait_s if poll is None else min(self.idle_wait_s, poll)
                if not self._drain(block=not (busy or warming), timeout=wait):
                    return
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    if self.metrics is not None:
                        self.metrics.observe_step(self.engine, outputs)
                    self._deliver(outputs)
                elif warming:  # one bucket, then commands again: a request waits one bucket at most
                    self.engine.capture_idle_graphs()
                    if self.metrics is not None:
                        self.metrics.observe_gauges(self.engine)
                else:
                    if poll is not None:  # idle work gives way as soon as a command (a request) arrives
                        self.engine.help_idle(should_stop=lambda: not self._commands.empty())
                    if self.metrics is not None:
                        self.metrics.observe_gauges(self.engine)
        except BaseException as exc:  # a failed step: fail every live request, then stop
            log.exception("engine loop failed")
            self.error = exc
            self._fail_all(exc)

    def _drain(self, block: bool, timeout: float) -> bool:
        """Apply queued commands (waiting up to `timeout` for one when `block`); False
        once asked to stop."""
        try:
            cmd = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return not self._stopping
        while True:
            if cmd is _STOP:
                self._fail_all(EngineStoppedError("the engine is shutting down"))
                return False
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: Any) -> None:
        if isinstance(cmd, _Submit):
            if not cmd.future.set_running_or_notify_cancel():
                return
            try:
                rid = self.engine.add_request(
                    cmd.prompt, cmd.params, request_id=cmd.request_id, prompt_token_ids=cmd.prompt_token_ids
                )
            except EngineError as exc:
                cmd.future.set_exception(exc)
                return
            self._callbacks[rid] = cmd.callback
            cmd.future.set_result(rid)
        elif isinstance(cmd, _Abort):
            if cmd.request_id in self._callbacks:
                self.engine.abort(cmd.request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            cb = self._callbacks.get(out.request_id)
            if cb is None:
                continue
            if out.finished:
                del self._callbacks[out.request_id]
            try:
                cb(out)
            except Exception:  # a consumer's bug must not kill the loop
                log.exception("output callback of %s failed", out.request_id)

    def _fail_all(self, exc: BaseException) -> None:
        callbacks, self._callbacks = self._callbacks, {}
        for rid, cb in callbacks.items():
            try:
                cb(
                    RequestOutput(
                        request_id=rid, new_token_ids=[], new_text="", token_ids=[], text="",
                        finished=True, finish_reason="abort", num_prompt_tokens=0,
                        timeline=RequestTimeline(0.0), error=f"engine stopped: {exc}",
                    )
                )
            except Exception:
                log.exception("output callback of %s failed", rid)
        while True:  # refuse submissions still queued
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Submit) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(EngineStoppedError(f"the engine loop stopped: {exc}"))


class AsyncEngineClient:
    """asyncio face of an `EngineLoop`."""

    def __init__(self, loop: EngineLoop) -> None:
        self.engine_loop = loop

    async def stream(
        self,
        request_id: str,
        params: SamplingParams,
        prompt: Optional[PromptInput] = None,
        prompt_token_ids: Optional[Sequence[int]] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until the finished one. Raises the engine's
        refusal (`InvalidRequestError`, `CapacityError`, `EngineStoppedError`) before
        the first output. Closing the iterator early aborts the request."""
        aloop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def callback(out: RequestOutput) -> None:
            aloop.call_soon_threadsafe(outputs.put_nowait, out)

        fut = self.engine_loop.submit(request_id, params, callback, prompt=prompt, prompt_token_ids=prompt_token_ids)
        await asyncio.wrap_future(fut)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.engine_loop.abort(request_id)

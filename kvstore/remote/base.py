"""The remote-tier adapter interface: how the daemon talks to a store shared by many hosts.

Owns: `RemoteAdapter` (the interface the Store's remote tier calls), its records
(`PutItem`, `GetItem`, `TaskResult`), the remote error classes, and `BlockingAdapter`, the
task machinery (a small thread pool, exactly-once results, reachability and automatic
reconnect) that adapters over a blocking client (Mooncake Store, the in-memory mock) fill
in with three blocking calls.

Call order (one remote tier, any number of threads)::

    tid = adapter.submit_stat(names)              # sizes of the objects, -1 where absent
    res = adapter.wait(tid, timeout_s)            # TaskResult, or None: not done yet
    tid = adapter.submit_get([GetItem(name, [(slot_ptr, n)])])  # ranges: (address, length)
    res = adapter.wait(tid, timeout_s)            # per item: bytes read, or a negative code
    tid = adapter.submit_put([PutItem(name, [(slot_ptr, n), (trailer_ptr, t)])])
    adapter.add_done_callback(tid, fn)            # fn(TaskResult) once the task has ended
    res = adapter.call("get", items, timeout_s, late=fn)  # submit + wait in one, maybe inline
    code = adapter.get_one(name, slot_ptr, n, timeout_s, landed, late=fn)  # one object, one range: a code

Contract (every adapter keeps it):

- Non-blocking: every `submit_*` returns a task id at once; the work runs elsewhere.
  `wait(tid, timeout_s)` blocks at most `timeout_s` and returns None when the task has
  not finished; `poll(tid)` is `wait(tid, 0)`.
- Exactly once: a task's `TaskResult` is delivered exactly once, by the first `wait`/
  `poll` that sees it finished, or to the callback given to `add_done_callback` (then
  no `wait` returns it). A task that timed out in `wait` still runs to its end.
- Buffers: the caller owns every buffer named in a `PutItem`/`GetItem` and must keep it
  alive and unchanged (put) or untouched (get) until the task's result has been
  delivered, even after a `wait` timed out. A put never keeps a reference after that;
  a get writes only inside the ranges given (and may report its progress through
  `GetItem.landed`).
- Objects are all-or-nothing: an object is visible to `submit_stat`/`submit_get` only
  once its put has completed; a reader never sees a half-written object (a put that
  fails or dies half-way leaves nothing, or the previous complete object).
- Results per item: `codes[i] >= 0` is success (bytes moved, or the size for stat),
  `NOT_FOUND` means absent, any other negative value is an error (`error` says what).
  A task whose whole batch failed (the store unreachable, a timeout of the client)
  reports `ok=False` and every code negative.
- Thread safety: every public method may be called from any thread at once.
- Synchronous calls: `call(op, batch, timeout_s, late)` is `submit_<op>` + `wait`, always
  returning a TaskResult: when the wait ran out it reports `pending=True` (and
  `timed_out`, every code `TIMED_OUT`), the task keeps running and `late(result)` is
  called once it has ended (the caller releases its buffers there); without `pending`
  the operation has ended and `late` is never called. An adapter
  whose client bounds every blocking call by itself within `timeout_s`
  (`inline_bound_s`) runs the call on the caller's thread instead, saving the hand-off
  to a worker thread (two wake-ups, 0.1-0.3 ms on a loaded host); only a caller already
  off an event loop may use `call`.
- One object in one range: `get_one` / `put_one` are `call` for a batch of one item
  with one range, answering its code alone (`PENDING` for a result that says
  `pending`; `late` as for `call`). Same contract, without the item and result records:
  inline, they cost a Python call or two beside the client's, where `call` makes five
  records and calls (each several microseconds right after a transfer has flushed the
  caches: together 1-4% of a 1 MiB object's get or put on loopback).
- Reachability: `reachable()` is False after an operation failed because the store
  could not be reached, or a caller's wait timed out (`suspect()`: a hung or very slow
  store), until a background probe (every `probe_interval_s`) gets an answer again;
  while unreachable, submitted tasks fail at once with `UNREACHABLE` instead of waiting
  for a timeout, and `reconnects` counts each return.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from kvstore.errors import InvalidRequest, KVStoreError

log = logging.getLogger(__name__)

NOT_FOUND = -704  # the object is absent (Mooncake's OBJECT_NOT_FOUND; every adapter uses it)
UNREACHABLE = -900  # the remote store could not be reached (Mooncake's RPC_FAIL)
TIMED_OUT = -901  # the operation ran out of time (Mooncake's RPC timeout; `call`'s own timeout)
FAILED = -1  # any other failure of one item
PENDING = -999_999  # `get_one` / `put_one`: the wait ran out and the operation still runs (never a client's code)


class RemoteError(KVStoreError):
    """The remote tier failed: unreachable, timed out, or refused an operation."""

    code = "REMOTE_ERROR"


class RemoteConfigError(RemoteError, InvalidRequest):
    """A remote tier URL or setting is invalid (the message names the bad part)."""

    code = "INVALID_REQUEST"


@dataclass(frozen=True)
class PutItem:
    """One object to write: its remote name and its bytes as (address, length) ranges,
    concatenated in order (the caller's buffers; see the module contract)."""

    name: str
    ranges: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return sum(n for _, n in self.ranges)


@dataclass(frozen=True)
class GetItem:
    """One object to read into (address, length) ranges whose lengths sum to its exact size.

    `landed` (optional): called with `end` each time the object's bytes [0, end) have
    landed in the ranges, in order, on the thread running the get, so the caller can
    check them while they are still in cache (kvstore.remote.envelope.PayloadVerifier).
    An adapter may call it after each chunk it reads, or never (then the caller sees the
    bytes only when the get has ended); the caller trusts no byte before the get's
    result says the whole object was read."""

    name: str
    ranges: tuple[tuple[int, int], ...]
    landed: Optional[Callable[[int], None]] = field(default=None, compare=False)

    @property
    def size(self) -> int:
        return sum(n for _, n in self.ranges)


@dataclass(frozen=True)
class TaskResult:
    """A finished task: one code per item (module contract), and how long it ran."""

    ok: bool
    codes: tuple[int, ...]
    seconds: float
    error: str = ""
    timed_out: bool = False  # the operation ran out of time (some code is TIMED_OUT)
    pending: bool = False  # a `call` whose wait ran out: still running, `late` gets its result


class RemoteAdapter(ABC):
    """A store shared across hosts (module docstring: the contract)."""

    namespace: str = "kvstore"  # prefix of the remote object names (kvstore.remote.envelope)
    kind: str = "remote"  # short adapter name for stats
    # The longest any blocking call of the client can take by its own timeouts, or None
    # when it has none: `call` runs inline only when this is within the caller's timeout.
    inline_bound_s: Optional[float] = None

    @abstractmethod
    def submit_stat(self, names: Sequence[str]) -> int:
        """Sizes of the named objects (code: size in bytes, NOT_FOUND, or an error)."""

    @abstractmethod
    def submit_get(self, items: Sequence[GetItem]) -> int:
        """Read each object into its ranges (code: bytes read, NOT_FOUND, or an error)."""

    @abstractmethod
    def submit_put(self, items: Sequence[PutItem]) -> int:
        """Write each object whole (code: bytes written, or an error). Writing a name that
        exists leaves one complete object under it."""

    @abstractmethod
    def submit_remove(self, names: Sequence[str]) -> int:
        """Remove the named objects (code 0, NOT_FOUND, or an error)."""

    @abstractmethod
    def wait(self, task_id: int, timeout_s: float) -> Optional[TaskResult]:
        """The task's result once, or None when it has not finished within `timeout_s`.
        Raises RemoteError for an id that is unknown or whose result was delivered."""

    def poll(self, task_id: int) -> Optional[TaskResult]:
        """`wait(task_id, 0)`."""
        return self.wait(task_id, 0.0)

    def call(self, op: str, batch: Sequence, timeout_s: float,
             late: Optional[Callable[[TaskResult], None]] = None) -> TaskResult:
        """Run one `op` ("stat", "get", "put", "remove") and wait for it at most
        `timeout_s` (module contract: a timed-out result, and `late`)."""
        submit = {"stat": self.submit_stat, "get": self.submit_get, "put": self.submit_put,
                  "remove": self.submit_remove}.get(op)
        if submit is None:
            raise InvalidRequest(f"unknown remote operation {op!r}")
        tid = submit(batch)
        res = self.wait(tid, timeout_s)
        if res is not None:
            return res
        self.add_done_callback(tid, late if late is not None else _ignore)
        return TaskResult(False, (TIMED_OUT,) * len(batch), timeout_s,
                          f"no answer within {timeout_s:g} s", timed_out=True, pending=True)

    def get_one(self, name: str, addr: int, size: int, timeout_s: float,
                landed: Optional[Callable[[int], None]] = None,
                late: Optional[Callable[[TaskResult], None]] = None) -> int:
        """Read one object of exactly `size` bytes into [addr, addr + size): `call("get",
        [GetItem(name, ((addr, size),), landed)], timeout_s, late)` answered as its one
        code: bytes read, NOT_FOUND, another negative error (TIMED_OUT when the client
        timed out: ended), or PENDING when the wait ran out (the get still runs and owns
        the range; `late(result)` is called once it has ended, and never otherwise)."""
        res = self.call("get", [GetItem(name, ((addr, size),), landed)], timeout_s, late)
        return PENDING if res.pending else res.codes[0]

    def put_one(self, name: str, addr: int, size: int, timeout_s: float,
                late: Optional[Callable[[TaskResult], None]] = None) -> int:
        """Write one object, the `size` bytes at `addr`: `call("put", [PutItem(name,
        ((addr, size),))], timeout_s, late)` answered as its one code: bytes written, a
        negative error, or PENDING (as `get_one`: the bytes stay the put's until `late`)."""
        res = self.call("put", [PutItem(name, ((addr, size),))], timeout_s, late)
        return PENDING if res.pending else res.codes[0]

    @abstractmethod
    def add_done_callback(self, task_id: int, fn: Callable[[TaskResult], None]) -> None:
        """Deliver the task's result to `fn` (on some adapter thread, or at once when it has
        finished) instead of to `wait`."""

    @abstractmethod
    def reachable(self) -> bool:
        """False while the store is known to be unreachable (module contract)."""

    @abstractmethod
    def suspect(self) -> None:
        """A caller's `wait` timed out: treat the store as unreachable (fail fast) until
        the probe gets an answer from it again."""

    @abstractmethod
    def stats(self) -> dict:
        """Adapter-level figures: at least `reconnects` and `unreachable_fast_fails`."""

    @abstractmethod
    def close(self) -> None:
        """Stop the threads and the client, waiting a bounded time (`close_wait_s`) for
        tasks still running (a hung store must not hang the daemon's shutdown)."""


def _ignore(res: TaskResult) -> None:
    """A `late` callback for callers that hold no buffers."""


def _outcome(t: "_Task") -> TaskResult:
    """The result of a finished task (one cancelled by close: failed)."""
    if t.future.cancelled():
        return TaskResult(False, (FAILED,) * t.items, 0.0, "the remote adapter closed before the task ran")
    return t.future.result()


@dataclass
class _Task:
    future: Future
    items: int
    taken: bool = False
    callback: Optional[Callable[[TaskResult], None]] = None


@dataclass
class _Reach:
    ok: bool = True
    reconnects: int = 0
    fast_fails: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class BlockingAdapter(RemoteAdapter):
    """The task machinery over a blocking client: subclasses implement `stat_now`,
    `get_now`, `put_now`, `remove_now` (one batch each, returning a code per item) and
    `probe_now` (True when the store answers), and may implement `get_one_now` /
    `put_one_now` (one object in one range; by default a batch of one). Those run on
    `workers` threads, or inline (`call`, `get_one`, `put_one`); a batch whose codes
    include UNREACHABLE or TIMED_OUT marks the store unreachable (module contract)."""

    close_wait_s = 5.0  # how long close() waits for running tasks

    def __init__(self, workers: int = 4, probe_interval_s: float = 0.5) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore-remote")
        self._tasks: dict[int, _Task] = {}
        self._lock = threading.Lock()
        self._next = 1
        self._reach = _Reach()
        self._probe_interval = probe_interval_s
        self._stop = threading.Event()
        self._closing = False  # `_stop` as a plain flag, for the inline paths
        self._prober: Optional[threading.Thread] = None
        # `call`'s inline path, made once: it runs per operation, often with caches just
        # flushed by a transfer, where every extra Python call costs microseconds
        self._inline = {"stat": self.stat_now, "get": self.get_now, "put": self.put_now, "remove": self.remove_now}

    # -------------------------------------------------------------- the blocking calls
    @abstractmethod
    def stat_now(self, names: Sequence[str]) -> list[int]:
        """Sizes per name (NOT_FOUND when absent); blocking."""

    @abstractmethod
    def get_now(self, items: Sequence[GetItem]) -> list[int]:
        """Bytes read per item; blocking."""

    @abstractmethod
    def put_now(self, items: Sequence[PutItem]) -> list[int]:
        """Bytes written per item; blocking."""

    @abstractmethod
    def remove_now(self, names: Sequence[str]) -> list[int]:
        """0 per removed name; blocking."""

    @abstractmethod
    def probe_now(self) -> bool:
        """True when the store answers a cheap request; blocking."""

    def get_one_now(self, name: str, addr: int, size: int, landed: Optional[Callable[[int], None]]) -> int:
        """Bytes read of one object into one range (`get_one`); blocking."""
        return self.get_now([GetItem(name, ((addr, size),), landed)])[0]

    def put_one_now(self, name: str, addr: int, size: int) -> int:
        """Bytes written of one object from one range (`put_one`); blocking."""
        return self.put_now([PutItem(name, ((addr, size),))])[0]

    # -------------------------------------------------------------- the interface
    def submit_stat(self, names: Sequence[str]) -> int:
        return self._submit(self.stat_now, list(names), len(names))

    def submit_get(self, items: Sequence[GetItem]) -> int:
        return self._submit(self.get_now, list(items), len(items))

    def submit_put(self, items: Sequence[PutItem]) -> int:
        return self._submit(self.put_now, list(items), len(items))

    def submit_remove(self, names: Sequence[str]) -> int:
        return self._submit(self.remove_now, list(names), len(names))

    def call(self, op: str, batch: Sequence, timeout_s: float,
             late: Optional[Callable[[TaskResult], None]] = None) -> TaskResult:
        bound = self.inline_bound_s
        if bound is None or bound > timeout_s or self._closing:
            return super().call(op, batch, timeout_s, late)
        fn = self._inline.get(op)
        if fn is None:
            raise InvalidRequest(f"unknown remote operation {op!r}")
        n = len(batch)
        if not self._reach.ok:
            with self._reach.lock:
                self._reach.fast_fails += 1
            return TaskResult(False, (UNREACHABLE,) * n, 0.0, "the remote store is unreachable")
        return self._run(fn, list(batch), n)  # the client's own timeouts bound it (inline_bound_s)

    def get_one(self, name: str, addr: int, size: int, timeout_s: float,
                landed: Optional[Callable[[int], None]] = None,
                late: Optional[Callable[[TaskResult], None]] = None) -> int:
        bound = self.inline_bound_s
        if bound is None or bound > timeout_s or self._closing:
            return super().get_one(name, addr, size, timeout_s, landed, late)
        return self._one_inline("get_one_now", lambda: self.get_one_now(name, addr, size, landed))

    def put_one(self, name: str, addr: int, size: int, timeout_s: float,
                late: Optional[Callable[[TaskResult], None]] = None) -> int:
        bound = self.inline_bound_s
        if bound is None or bound > timeout_s or self._closing:
            return super().put_one(name, addr, size, timeout_s, late)
        return self._one_inline("put_one_now", lambda: self.put_one_now(name, addr, size))

    def _one_inline(self, what: str, call: Callable[[], int]) -> int:
        """A one-object operation on the caller's thread: the fast failure while the
        store is unreachable, an exception reported as FAILED (as `_run` does), an
        unreachable or timed-out answer marking the store unreachable."""
        if not self._reach.ok:
            return self._fast_fail()
        try:
            code = int(call())
        except Exception as exc:  # noqa: BLE001 - reported as a code, as `_run` does
            log.warning("remote %s failed: %s", what, exc)
            return FAILED
        if code == UNREACHABLE or code == TIMED_OUT:
            self._mark_unreachable()
        return code

    def _fast_fail(self) -> int:
        with self._reach.lock:
            self._reach.fast_fails += 1
        return UNREACHABLE

    def _submit(self, fn: Callable[[list], list[int]], batch: list, n: int) -> int:
        if not self.reachable():
            with self._reach.lock:
                self._reach.fast_fails += 1
            fut: Future = Future()
            fut.set_result(TaskResult(False, (UNREACHABLE,) * n, 0.0, "the remote store is unreachable"))
        else:
            try:
                fut = self._pool.submit(self._run, fn, batch, n)
            except RuntimeError:  # the adapter was closed
                fut = Future()
                fut.set_result(TaskResult(False, (FAILED,) * n, 0.0, "the remote adapter is closed"))
        with self._lock:
            tid = self._next
            self._next += 1
            self._tasks[tid] = _Task(fut, n)
        return tid

    def _run(self, fn: Callable[[list], list[int]], batch: list, n: int) -> TaskResult:
        t0 = time.perf_counter()
        try:
            codes = list(map(int, fn(batch)))
            if len(codes) != n:
                raise RemoteError(f"the remote client answered {len(codes)} results for a batch of {n}")
            err = ""
        except Exception as exc:  # noqa: BLE001 - a task reports its failure, never raises
            log.warning("remote %s failed: %s", getattr(fn, "__name__", "operation"), exc)
            codes, err = [FAILED] * n, f"{type(exc).__name__}: {exc}"
        if not n or min(codes) >= 0:  # the common case: everything succeeded
            return TaskResult(True, tuple(codes), time.perf_counter() - t0, err)
        if UNREACHABLE in codes or TIMED_OUT in codes:
            self._mark_unreachable()
            err = err or ("the remote store did not answer in time" if TIMED_OUT in codes
                          else "the remote store is unreachable")
        ok = all(c >= 0 or c == NOT_FOUND for c in codes)
        return TaskResult(ok, tuple(codes), time.perf_counter() - t0, err, timed_out=TIMED_OUT in codes)

    def _finished(self, tid: int) -> None:
        with self._lock:
            t = self._tasks.get(tid)
            if t is None or t.callback is None or t.taken:
                return
            t.taken = True
            del self._tasks[tid]
        self._deliver(t.callback, _outcome(t))

    @staticmethod
    def _deliver(fn: Callable[[TaskResult], None], res: TaskResult) -> None:
        try:
            fn(res)
        except Exception:  # noqa: BLE001 - a callback must not kill an adapter thread
            log.exception("remote task callback failed")

    def wait(self, task_id: int, timeout_s: float) -> Optional[TaskResult]:
        with self._lock:
            t = self._tasks.get(task_id)
            if t is None or t.taken or t.callback is not None:
                raise RemoteError(f"remote task {task_id} is unknown or its result was already delivered")
        try:
            t.future.exception(timeout=max(0.0, timeout_s))  # waits; never raises the task's own error
        except TimeoutError:
            return None
        except CancelledError:
            pass
        res = _outcome(t)
        with self._lock:
            if t.taken:
                raise RemoteError(f"remote task {task_id}'s result was already delivered")
            t.taken = True
            self._tasks.pop(task_id, None)
        return res

    def add_done_callback(self, task_id: int, fn: Callable[[TaskResult], None]) -> None:
        with self._lock:
            t = self._tasks.get(task_id)
            if t is None or t.taken or t.callback is not None:
                raise RemoteError(f"remote task {task_id} is unknown or its result was already delivered")
            t.callback = fn
        # runs _finished now when the task has ended, else on the adapter thread that ends it
        t.future.add_done_callback(lambda f, tid=task_id: self._finished(tid))

    # -------------------------------------------------------------- reachability
    def reachable(self) -> bool:
        return self._reach.ok

    def suspect(self) -> None:
        self._mark_unreachable()

    def _mark_unreachable(self) -> None:
        with self._reach.lock:
            if not self._reach.ok or self._stop.is_set():
                return
            self._reach.ok = False
            log.warning("the remote store is unreachable or not answering; local tiers keep serving, probing "
                        "every %.1f s", self._probe_interval)
            self._prober = threading.Thread(target=self._probe_loop, name="kvstore-remote-probe", daemon=True)
            self._prober.start()

    def _probe_loop(self) -> None:
        while not self._stop.wait(self._probe_interval):
            try:
                up = self.probe_now()
            except Exception as exc:  # noqa: BLE001 - keep probing
                log.debug("remote probe failed: %s", exc)
                up = False
            if up:
                with self._reach.lock:
                    self._reach.ok = True
                    self._reach.reconnects += 1
                log.warning("the remote store is reachable again")
                return

    def stats(self) -> dict:
        with self._reach.lock:
            return {"reconnects": self._reach.reconnects, "unreachable_fast_fails": self._reach.fast_fails}

    def close(self) -> None:
        self._closing = True
        self._stop.set()
        with self._lock:
            running = [t.future for t in self._tasks.values() if not t.future.done()]
        self._pool.shutdown(wait=False, cancel_futures=True)
        _, stuck = futures_wait(running, timeout=self.close_wait_s)
        if stuck:
            log.warning("closing the remote adapter with %d task(s) still running after %.1f s (the store is not "
                        "answering); not waiting for them", len(stuck), self.close_wait_s)
        if self._prober is not None:
            self._prober.join(timeout=1.0)

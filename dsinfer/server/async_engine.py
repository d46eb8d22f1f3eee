"""AsyncEngine: the engine loop on its own thread, one asyncio queue per request.

The event loop never runs model code. Commands (add, abort) cross to the engine thread through
a thread-safe inbox; outputs cross back with `call_soon_threadsafe`. A request whose client
went away is aborted, and its KV blocks return to the pool on the next step.

Containment: a request that fails inside a step is failed alone by the engine (its stream gets
RequestFailedError → HTTP 500 with an error id). A fault that is not a request's (out of
memory, a dead tensor-parallel rank, a bug in the loop itself) restarts the engine on this
thread: requests that had produced nothing yet are queued again on the new engine, the others
get EngineRestartingError (→ 503 + Retry-After). Too many restarts in a short time, or a
restart that fails, stop the engine for good (EngineDeadError → 503, /health 503).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from dsinfer.device.host_threads import release_openmp_pool
from dsinfer.engine.core import EngineCore
from dsinfer.engine.llm_engine import EngineStats
from dsinfer.engine.outputs import RequestOutput
from dsinfer.sampling import SamplingParams

logger = logging.getLogger(__name__)

# More restarts than this within the window means the fault is not transient: stop for good.
MAX_RESTARTS = 3
RESTART_WINDOW_S = 300.0


class EngineDeadError(RuntimeError):
    """The engine stopped and will not come back without a process restart."""


class EngineRestartingError(EngineDeadError):
    """The engine restarted under this request; the client may retry at once."""

    retry_after = 1


class RequestFailedError(RuntimeError):
    """This request alone failed inside the engine; `error_id` is in the server log."""

    def __init__(self, error_id: str, message: str, client_error: bool = False) -> None:
        super().__init__(message)
        self.error_id = error_id
        self.client_error = client_error  # the request's input is at fault: a 400


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    prompt_ids: list[int]
    params: SamplingParams
    added: bool = False  # taken from the inbox into the engine
    started: bool = False  # an output was delivered (a restart cannot replay it)


class RequestStream:
    """One request's outputs (deltas) as an async iterator. Registered with the engine when
    created — not when first iterated — so admission counts it at once; `close()` (idempotent)
    aborts it if it has not finished."""

    def __init__(self, owner: AsyncEngine, request_id: str, stream: _Stream) -> None:
        self._owner, self.request_id, self._stream = owner, request_id, stream
        self.finished = self.closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._owner._streams.pop(self.request_id, None)
        if not self.finished:
            self._owner._send("abort", self.request_id)


class AsyncEngine:
    """Owns one engine (an EngineCore: LLMEngine, or a scripted one in protocol tests) on a
    dedicated thread.

    Pass a factory rather than a built engine where you can: the engine is then built on the
    thread that will run it, and can be rebuilt there after a fault. Every thread that runs
    parallel regions gets an OpenMP pool of its own, and with more pools than CPUs every region
    pays a futex wake-up (device/host_threads.py; loading on the main thread and stepping on
    another was once measured at 124 vs 230 us a 576x3072 GEMV): the engine thread is to be
    the process's only pool, so it loads here and, when idle, lets its pool go.
    """

    def __init__(self, engine: EngineCore | Callable[[], EngineCore]) -> None:
        # A factory is a plain callable; an engine is not (it has a step method).
        self._factory = engine if not hasattr(engine, "step") else None
        self.engine: EngineCore = None if self._factory else engine  # type: ignore[assignment]
        self._ready = threading.Event()
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.dead: BaseException | None = None
        self.restarting = False
        self.restarts = 0
        self.last_fault: str | None = None
        self._fault_times: deque[float] = deque()
        self._thread = threading.Thread(target=self._run, name="dsinfer-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.engine is None:
            raise self.dead if self.dead is not None else RuntimeError("engine failed to start")

    # -- public, called from the event loop ---------------------------------------------------
    @property
    def num_pending(self) -> int:
        """Requests accepted and not yet finished (queued, running, or about to be added)."""
        return len(self._streams)

    @property
    def num_running(self) -> int:
        engine = self.engine
        return engine.num_running if engine is not None else 0

    def stats(self) -> EngineStats | None:
        """The engine's figures now; None while it is being (re)built."""
        engine = self.engine
        return engine.stats() if engine is not None else None

    @property
    def device(self) -> Any:
        engine = self.engine
        return engine.device if engine is not None else None

    @property
    def state(self) -> str:
        """ "ok", "restarting" or "dead", for /health."""
        return "dead" if self.dead is not None else "restarting" if self.restarting else "ok"

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> RequestStream:
        """Queue a request now and return its output stream (call from the event loop)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead}")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), prompt_ids, params)
        self._streams[request_id] = stream
        self._send("add", request_id)
        return RequestStream(self, request_id, stream)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs (deltas) until finished; aborts the request if the consumer
        stops early (client disconnect, cancellation)."""
        stream = self.submit(prompt_ids, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        if self.engine is not None:
            self.engine.shutdown()  # tensor-parallel workers, if any

    def _send(self, kind: str, payload: object) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    # -- engine thread --------------------------------------------------------------------------
    def _add(self, rid: str, stream: _Stream) -> None:
        stream.added = True
        try:
            self.engine.add_request(stream.prompt_ids, stream.params, request_id=rid)
        except ValueError as e:
            self._deliver(rid, e)
        except Exception as e:  # a request the engine cannot take must not stop the loop
            logger.exception("request %s refused by the engine", rid)
            self._deliver(rid, RequestFailedError("add", f"{type(e).__name__}: {e}"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                stream = self._streams.get(str(payload))
                if stream is not None:  # else the client left before we saw it
                    self._add(str(payload), stream)
            elif kind == "abort":
                self.engine.abort_request(str(payload))

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(rid, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand each item to its request's stream: one call into each event loop for all of a
        step's outputs (at 16 streams, one wake-up of the loop a step instead of 16)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is None:
                continue
            if isinstance(item, RequestOutput) and item.error is not None:
                err = item.error
                item = RequestFailedError(err.error_id, err.message, err.client_error)
            stream.started = True
            if isinstance(item, BaseException) or item.finished:
                self._streams.pop(rid, None)  # counted as pending no longer, even if never read
            by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # that loop is closed: nobody is left to read these
                logger.debug("outputs for %d stream(s) of a closed event loop dropped", len(puts))

    def _build(self) -> bool:
        """Build the engine from the factory on this thread; False (and dead) if it fails."""
        try:
            self.engine = self._factory()  # type: ignore[misc]
            return True
        except BaseException as e:  # reported to the constructor's caller, or via /health
            logger.exception("the engine could not be built")
            self.dead = e
            return False

    def _run(self) -> None:
        if self._factory is not None and not self._build():
            self._ready.set()
            return
        self._ready.set()
        while not self._stop.is_set():
            try:
                self._loop()
            except BaseException as e:
                logger.exception("engine fault")
                if not self._restart(e):
                    self._die(e)
                    return

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                # Idle: this thread's OpenMP workers go, so that another engine of this
                # server (a second model or version) is the only pool while it steps
                # (device/host_threads.py); the next step starts a pool again (~50 µs).
                release_openmp_pool()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                self.engine.step()  # flush finished ids to the runner while idle
                continue
            t0 = time.perf_counter()
            outputs = self.engine.step()
            self._deliver_all([(out.request_id, out) for out in outputs])
            logger.debug("step %.1f ms, %d outputs", 1e3 * (time.perf_counter() - t0), len(outputs))

    def _restart(self, fault: BaseException) -> bool:
        """Rebuild the engine after a fault; False when it must stay down."""
        self.restarts += 1
        self.last_fault = f"{type(fault).__name__}: {fault}"
        now = time.monotonic()
        self._fault_times.append(now)
        while self._fault_times and now - self._fault_times[0] > RESTART_WINDOW_S:
            self._fault_times.popleft()
        if self._factory is None or len(self._fault_times) > MAX_RESTARTS:
            return False
        self.restarting = True
        logger.error("restarting the engine (restart %d) after: %s", self.restarts, self.last_fault)
        requeue = []
        for rid, stream in list(self._streams.items()):
            if stream.added and not stream.started:
                requeue.append((rid, stream))
            elif stream.added:
                self._deliver(rid, EngineRestartingError(f"the engine restarted: {fault}"))
        old, self.engine = self.engine, None  # type: ignore[assignment]
        try:
            old.shutdown()
        except Exception:
            logger.exception("shutting down the failed engine")
        del old
        gc.collect()  # free its KV pool and weights before the new engine allocates its own
        if not self._build():
            return False
        for rid, stream in requeue:
            if rid in self._streams:  # the client may have left during the restart
                self._add(rid, stream)
        self.restarting = False
        logger.info("engine restarted; %d request(s) queued again", len(requeue))
        return True

    def _die(self, fault: BaseException) -> None:
        self.restarting = False
        self.dead = self.dead or fault
        err = EngineDeadError(f"the engine stopped: {self.dead}")
        self._deliver_all([(rid, err) for rid in list(self._streams)])


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in puts:
        q.put_nowait(item)

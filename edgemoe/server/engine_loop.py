"""The engine loop: one thread owns the LLMEngine (which is not thread-safe) and runs its steps.

    event loop (HTTP handlers)                      engine thread
    submit(handle) --┐                              load the model (/health says 503 until then)
    abort(handle) ---┼--> inbox (SimpleQueue) ---->  between steps: add_request / abort
    stop() ----------┘                              step() -> outputs
    handle.outputs() <-- call_soon_threadsafe <---  per request, one list of (choice, output) per step

Admission control happens in `submit`, on the event loop, under one lock: the server holds at most
`max_running + max_queue` unfinished sequences (the engine runs `max_running` of them, the rest wait);
beyond that a request gets 429 at once instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from edgemoe.engine.engine import LLMEngine
from edgemoe.engine.sequence import RequestOutput
from edgemoe.errors import EdgeMoEError
from edgemoe.sampling_params import SamplingParams
from edgemoe.server.metrics import Metrics
from edgemoe.server.protocol import RequestError

log = logging.getLogger("edgemoe.server")


def _unavailable(message: str) -> RequestError:
    return RequestError(503, message, code="unavailable", type="server_error", headers={"Retry-After": "1"})


class RequestHandle:
    """One HTTP request's link to the engine: `n` sequences of one prompt. Created and read on the event loop;
    the engine thread only pushes into it through `call_soon_threadsafe`."""

    def __init__(self, prompt_ids: list[int], params: list[SamplingParams]) -> None:
        self.id = uuid.uuid4().hex
        self.prompt_ids, self.params = prompt_ids, params
        self.arrival = time.perf_counter()
        self.loop = asyncio.get_running_loop()
        self.accepted: asyncio.Future[None] = self.loop.create_future()  # resolved once add_request ran
        self.finals: list[RequestOutput | None] = [None] * len(params)
        self._queue: asyncio.Queue[list[tuple[int, RequestOutput]] | RequestError] = asyncio.Queue()
        self._open = len(params)

    @property
    def done(self) -> bool:
        return self._open == 0

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as the engine produces them, until every choice has finished."""
        while self._open:
            item = await self._queue.get()
            if isinstance(item, RequestError):
                raise item
            for index, out in item:
                if out.finish_reason:
                    self._open -= 1
                    self.finals[index] = out
                yield index, out

    # engine thread -> event loop

    def _call(self, fn: Callable, *args: object) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def push(self, item: list[tuple[int, RequestOutput]] | RequestError) -> None:
        self._call(self._queue.put_nowait, item)

    def resolve(self, error: RequestError | None = None) -> None:
        self._call(_settle, self.accepted, error)


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if not future.done():  # the handler may have been cancelled meanwhile
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


@dataclass
class _Choice:
    """Engine-thread state of one sequence."""

    handle: RequestHandle
    index: int
    tokens: int = 0
    last: float | None = None  # when its previous token came out


class EngineLoop:
    def __init__(
        self, make_engine: Callable[[], LLMEngine], max_running: int, max_queue: int, metrics: Metrics
    ) -> None:
        self._make_engine = make_engine
        self.capacity = max_running + max_queue
        self.metrics = metrics
        self.engine: LLMEngine | None = None
        self.error: str | None = None  # why the model could not be loaded
        self._inbox: queue.SimpleQueue[tuple[str, RequestHandle | None]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _live and _accepting
        self._live = 0  # sequences submitted and not finished, wherever they are
        self._accepting = True
        self._choices: dict[str, _Choice] = {}  # engine thread only
        self._moe_stats_read: float | None = None  # when the hit rate was last read; None: not counted
        self._thread = threading.Thread(target=self._run, name="edgemoe-engine", daemon=True)

    # ------------------------------------------------------------------ event loop side

    @property
    def ready(self) -> bool:
        return self.engine is not None and self._accepting

    @property
    def live(self) -> int:
        return self._live

    def start(self) -> None:
        self._thread.start()

    def submit(self, handle: RequestHandle) -> None:
        """Queue a request or refuse it now: 503 (loading, stopping) or 429 (full)."""
        n = len(handle.params)
        with self._lock:
            if not self._accepting:
                raise _unavailable("the server is shutting down")
            if self.engine is None:
                raise _unavailable("the model is still loading")
            if n > self.capacity:
                raise RequestError(400, f"n must be at most {self.capacity} on this server", "n", "invalid_value")
            if self._live + n > self.capacity:
                raise RequestError(
                    429,
                    f"the server is full ({self._live} sequences in flight, room for {self.capacity}); retry later",
                    code="rate_limit_exceeded",
                    type="rate_limit_error",
                    headers={"Retry-After": "1"},
                )
            self._live += n
            self._inbox.put(("submit", handle))  # under the lock: never behind a "stop"

    def abort(self, handle: RequestHandle) -> None:
        """Free the request's sequences at the next step boundary (the client has gone)."""
        self._inbox.put(("abort", handle))

    def begin_drain(self) -> None:
        """Refuse new requests; those in flight carry on."""
        with self._lock:
            self._accepting = False
        self.metrics.ready.set(0)

    def stop(self) -> None:
        """Refuse new requests and end those in flight with a 503 error; the thread then exits."""
        with self._lock:
            self._accepting = False
            self._inbox.put(("stop", None))

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            self.engine = self._make_engine()
        except (EdgeMoEError, OSError) as exc:  # OSError: a file of the model that cannot be read
            self.error = str(exc)
            return
        except Exception as exc:  # noqa: BLE001 - any load failure must reach the CLI as one line (a bug: a traceback)
            log.exception("loading the model failed")
            self.error = f"cannot load the model: {type(exc).__name__}: {exc}"
            return
        try:
            self.engine.moe_stats()
            self._moe_stats_read = 0.0  # the engine counts expert-cache hits: export the hit rate
        except EdgeMoEError:
            pass
        self.metrics.ready.set(1)
        self._serve()
        self.metrics.ready.set(0)
        self._fail_all(_unavailable("the server is shutting down"))
        while True:  # submissions that raced the stop: nobody will run them
            try:
                kind, handle = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._release(len(handle.params))
                handle.resolve(_unavailable("the server is shutting down"))
        self._update_gauges()

    def _serve(self) -> None:
        while True:
            try:
                self._update_gauges()
                if not self._handle_commands(block=not self.engine.has_unfinished()):
                    return
                if self.engine.has_unfinished():
                    self._step()
            except EdgeMoEError as exc:  # a step the engine refused to finish (the RAM tier's store failed a read)
                log.error("engine step failed: %s; failing the requests in flight", exc)
                self._fail_all(RequestError(500, str(exc), type="server_error"))
            except Exception:  # noqa: BLE001 - a bug must fail the requests in flight, not hang them forever
                log.exception("engine loop failed; failing the requests in flight")
                self._fail_all(RequestError(500, "internal error in the engine loop", type="server_error"))

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued submissions and aborts; False once told to stop."""
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for kind, handle in commands:
            if kind == "stop":
                return False
            if kind == "submit":
                self._admit(handle)
            else:
                self._abort(handle, "abort")
        return True

    def _admit(self, handle: RequestHandle) -> None:
        added = []
        try:
            for i, params in enumerate(handle.params):
                rid = f"{handle.id}-{i}"
                self.engine.add_request(handle.prompt_ids, params, request_id=rid)
                added.append(rid)
                self._choices[rid] = _Choice(handle, i)
        except Exception as exc:  # noqa: BLE001 - EdgeMoEError: e.g. the sequence cannot fit the KV cache
            for rid in added:
                self.engine.abort(rid)
                del self._choices[rid]
            self._release(len(handle.params))
            if isinstance(exc, EdgeMoEError):
                handle.resolve(RequestError(400, str(exc), code="invalid_value"))
            else:
                log.exception("add_request failed")
                handle.resolve(RequestError(500, "internal error while admitting the request", type="server_error"))
            return
        self.metrics.prompt_tokens.inc(len(handle.prompt_ids))
        handle.resolve()

    def _abort(self, handle: RequestHandle, reason: str) -> None:
        for i in range(len(handle.params)):
            rid = f"{handle.id}-{i}"
            if self._choices.pop(rid, None) is not None:
                self.engine.abort(rid)
                self.metrics.finished.labels(reason).inc()
                self._release(1)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:  # noqa: BLE001 - an engine bug must not take the server down
            log.exception("engine step failed; failing the requests in flight")
            self._fail_all(RequestError(500, "internal error in the engine step", type="server_error"))
            return
        now = time.perf_counter()
        batches: dict[RequestHandle, list[tuple[int, RequestOutput]]] = {}
        for out in outputs:
            choice = self._choices.get(out.request_id)
            if choice is None:
                continue
            self.metrics.generation_tokens.inc(len(out.token_ids) - choice.tokens)
            choice.tokens = len(out.token_ids)
            if choice.last is None:
                self.metrics.ttft.observe(now - choice.handle.arrival)
            else:
                self.metrics.itl.observe(now - choice.last)
            choice.last = now
            if out.finish_reason:
                self.metrics.e2e.observe(now - choice.handle.arrival)
                self.metrics.finished.labels(out.finish_reason).inc()
                del self._choices[out.request_id]
                self._release(1)
            batches.setdefault(choice.handle, []).append((choice.index, out))
        self._update_gauges()  # before the outputs go out: a client that got its last token sees the gauges after
        for handle, items in batches.items():
            handle.push(items)

    def _fail_all(self, error: RequestError) -> None:
        handles = {c.handle for c in self._choices.values()}
        for handle in handles:
            self._abort(handle, "error")
            handle.push(error)

    def _release(self, n: int) -> None:
        with self._lock:
            self._live -= n

    def _update_gauges(self) -> None:
        running = len(self.engine.scheduler.running)
        self.metrics.running.set(running)
        self.metrics.waiting.set(max(0, self._live - running))
        kv = self.engine.kv
        self.metrics.kv_usage.set(1 - kv.num_free / kv.num_blocks)
        self.metrics.prefix_cache(kv.queried_tokens, kv.hit_tokens)
        spec = self.engine.speculative
        if spec.steps:
            self.metrics.speculative(spec.steps, spec.drafted, spec.accepted)
        now = time.monotonic()
        # the counters live on the device: read them at most once a second while busy, and once more when idle
        if self._moe_stats_read is not None and (now - self._moe_stats_read >= 1 or not running):
            self._moe_stats_read = now
            total = self.engine.moe_stats()["total"]
            self.metrics.expert_cache_hit_rate().set(total["hit_rate"])
            self.metrics.expert_cache_misses().labels("copy").set(total["misses"] - total["cpu_computed"])
            self.metrics.expert_cache_misses().labels("cpu").set(total["cpu_computed"])
            if "refused_draft_bytes" in total:
                self.metrics.refused_draft_bytes().set(total["refused_draft_bytes"])

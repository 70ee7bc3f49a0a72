"""The engine thread and its asyncio face.

One thread owns the model (mlx-lm's server pattern): HTTP handlers never touch the engine; they
put commands on the thread's inbox and read their own per-request asyncio queue, which the thread
fills through ``loop.call_soon_threadsafe``. ``AsyncEngine`` implements
``sfcl.engine.protocol.EngineClient`` for the HTTP layer and the CLI.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import os
import queue
import re
import threading
import uuid
from typing import AsyncIterator, Callable

from sfcl.engine.engine import LLMEngine
from sfcl.engine.events import EngineEvent, ErrorEvent, Finished
from sfcl.engine.host_memory import return_freed_memory
from sfcl.engine.protocol import EngineBusyError
from sfcl.engine.request import SamplingParams
from sfcl.engine.scheduler import QueueFullError
from sfcl.engine.threads import run_on_scratch_thread, set_thread_count
from sfcl.engine.token_bound import max_token_chars

log = logging.getLogger("sfcl.engine")

# encode_chat runs in worker threads, several at once. The HF fast tokenizer implements
# ``split_special_tokens`` by setting one shared attribute of the Rust tokenizer before encoding,
# so concurrent calls could encode a client's "<|im_end|>" as the control token or split the
# template's own ones. Tokenizing is serialised.
_TOKENIZE_LOCK = threading.Lock()


def _encode_chat_locked(tok, msgs: list[dict], contents: list[str], nonce: str) -> list[int]:
    """The tokenizing half of ``AsyncEngine.encode_chat``; call it holding ``_TOKENIZE_LOCK``."""
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
    if len(parts) != 2 * len(msgs) + 1:  # the template dropped or duplicated a message
        log.warning("chat template did not render each message once; tokenizing without the guard")
        for m, c in zip(msgs, contents):
            m["content"] = c
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return list(tok(text, add_special_tokens=False)["input_ids"])
    ids: list[int] = []
    for j, piece in enumerate(parts):
        if j % 2 == 0:
            if piece:
                ids += tok(piece, add_special_tokens=False)["input_ids"]
        elif contents[int(piece)]:
            ids += tok(contents[int(piece)], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids


def encode_chat(tokenizer, messages: list[dict], system: str | None = None) -> list[int]:
    """Chat template (generation prompt added) -> token ids, with message text that can never
    become a control token: a client's ``<|im_start|>`` stays plain text.

    Each message's content is rendered as a unique sentinel, the rendered template is split at
    the sentinels, template pieces are tokenized with special tokens and content pieces with
    ``split_special_tokens=True``. Module level so that a process holding only the tokenizer
    (the Ray Serve ingress, ``sfcl.cluster``) tokenizes exactly as the engine's owner does.
    """
    msgs = ([{"role": "system", "content": system}] if system else []) + [dict(m) for m in messages]
    nonce = uuid.uuid4().hex[:12]
    contents = []
    for i, m in enumerate(msgs):
        contents.append(str(m.get("content", "")))
        m["content"] = f"\ue000{nonce}:{i}\ue001"
    with _TOKENIZE_LOCK:
        return _encode_chat_locked(tokenizer, msgs, contents, nonce)


Sink = Callable[[EngineEvent], None]


class QueueSink:
    """A sink that fills an asyncio queue on ``loop``. The engine thread hands a step's events for
    all such sinks of one loop over in ONE ``call_soon_threadsafe`` (``EngineThread._emit``)
    instead of one per event: at 16 streams that is one event-loop wake-up (a self-pipe write)
    per step instead of 16 or more. Served throughput at 16 streams did not change measurably
    with it (within the ~5% spread between server starts)."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop, q: asyncio.Queue):
        self.loop, self.queue = loop, q

    def __call__(self, ev: EngineEvent) -> None:
        _post(self.loop, [(self.queue, [ev])])


def _deliver(batch: list[tuple[asyncio.Queue, list[EngineEvent]]]) -> None:
    """On the event loop: put each queue's events, in order."""
    for q, evs in batch:
        for ev in evs:
            q.put_nowait(ev)


def _post(loop: asyncio.AbstractEventLoop, batch: list[tuple[asyncio.Queue, list[EngineEvent]]]) -> None:
    try:
        loop.call_soon_threadsafe(_deliver, batch)
    except RuntimeError:  # the loop is gone (shutdown); nothing to deliver to
        pass


class EngineThread:
    """Runs ``engine.step()`` in a loop on a dedicated thread."""

    def __init__(self, engine: LLMEngine, num_threads: int | None = None, stat_logger=None):
        self.engine = engine
        self.stat_logger = stat_logger  # sfcl.metrics.PrometheusStatLogger or None
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sinks: dict[str, Sink] = {}
        self._stop = threading.Event()
        self._num_threads = num_threads
        self.thread = threading.Thread(target=self._run, name="sfcl-engine", daemon=True)
        self.steps = 0

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.inbox.put(("wake",))
        self.thread.join(timeout)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        """Called from any thread. Raises EngineBusyError when the waiting queue is full.

        Capacity = free KV slots + ``max_waiting``: requests still in the inbox will first fill
        free slots, so only the excess counts against the waiting bound. (Reads of the
        scheduler's counters from this thread are racy by one or two; the scheduler's own bound
        is exact and answers overloaded_error in the stream if a race slips through.)"""
        sched = self.engine.scheduler
        free = max(0, sched.cfg.max_num_seqs - sched.num_running)
        if sched.num_waiting + self.inbox.qsize() >= sched.cfg.max_waiting + free:
            raise EngineBusyError(retry_after_s=1)
        self.inbox.put(("add", request_id, prompt_ids, params, sink))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    def cut_all(self) -> None:
        """Ask the thread to end every request now with an ``overloaded_error`` (graceful-shutdown deadline;
        ``LLMEngine.cut_all``)."""
        self.inbox.put(("cut_all",))

    def _emit(self, events) -> None:
        """Deliver (request id, event) pairs in order: QueueSinks batched per loop (one wake-up
        each), other sinks called per event."""
        batches: dict[int, tuple[asyncio.AbstractEventLoop, dict[int, tuple[asyncio.Queue, list]]]] = {}
        for rid, ev in events:
            sink = self.sinks.get(rid)
            if isinstance(sink, QueueSink):
                per_q = batches.setdefault(id(sink.loop), (sink.loop, {}))[1]
                per_q.setdefault(id(sink.queue), (sink.queue, []))[1].append(ev)
            elif sink is not None:
                sink(ev)
            if isinstance(ev, (Finished, ErrorEvent)):
                self.sinks.pop(rid, None)
        for loop, per_q in batches.values():
            _post(loop, list(per_q.values()))

    def _handle(self, cmd) -> None:
        if cmd[0] == "add":
            _, rid, ids, params, sink = cmd
            self.sinks[rid] = sink
            try:
                self._emit(self.engine.add_request(rid, ids, params))
                return
            except QueueFullError:
                err = ErrorEvent("the engine queue is full; retry later", "overloaded_error", tag=params.tag)
            except ValueError as e:
                err = ErrorEvent(str(e), "invalid_request_error", tag=params.tag)
            except Exception:  # never let one request's intake end the engine thread
                log.exception("could not add request %s", rid)
                err = ErrorEvent("internal error while queueing the request", "api_error", tag=params.tag)
            self._emit([(rid, err)])
            if self.stat_logger is not None:  # a refused request ended too: counted as an error
                self.stat_logger.log_events([(rid, err)])
        elif cmd[0] == "swap":  # anchor library reload: between steps, on this thread
            _, lib, snap, fut = cmd
            try:
                self.engine.swap_library(lib, snap)
                fut.set_result(None)
            except Exception as e:  # pragma: no cover - swap_library only assigns
                fut.set_exception(e)
        elif cmd[0] == "cut_all":
            self._emit(self.engine.cut_all())
        elif cmd[0] == "ping":  # health check: answered between two steps, so a stuck step shows
            cmd[1].set_result(self.steps)
        elif cmd[0] == "abort":
            self.sinks.pop(cmd[1], None)
            st = self.engine.requests.get(cmd[1])
            if self.engine.abort(cmd[1]) and self.stat_logger is not None:
                self.stat_logger.aborted(st.seq.params.tag if st is not None else None)

    def _run(self) -> None:
        if self._num_threads:
            set_thread_count(self._num_threads)  # for good: see sfcl.engine.threads
        while not self._stop.is_set():
            try:
                block = not self.engine.has_work()
                cmd = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
                self._handle(cmd)
                while True:  # drain everything that arrived, then step
                    self._handle(self.inbox.get_nowait())
            except queue.Empty:
                pass
            if self._stop.is_set() or not self.engine.has_work():
                continue
            try:
                events = self.engine.step()
                self._emit(events)
                self.steps += 1
                if self.stat_logger is not None:
                    self.stat_logger.log(self.engine.last_stats, events)
            except Exception:  # keep serving: fail the requests of this step, not the server
                log.exception("engine step failed")  # details in the server log, not to clients
                self._fail_running("internal engine error; the request was stopped")

    def _fail_running(self, message: str) -> None:
        sched = self.engine.scheduler
        for seq in [s for s in sched.running if s is not None]:
            ev = [(seq.request_id, ErrorEvent(message, "api_error", tag=seq.params.tag))]
            self._emit(ev)
            self.engine.abort(seq.request_id)
            if self.stat_logger is not None:
                self.stat_logger.log_events(ev)


def _rss_bytes() -> int:
    """Resident set size of this process in bytes (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _task_count() -> int | None:
    """asyncio tasks alive on the calling thread's loop (None outside a loop)."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:
        return None


class AsyncEngine:
    """EngineClient over an EngineThread (see ``sfcl.engine.protocol``)."""

    def __init__(self, engine: LLMEngine, *, model_name: str, max_model_len: int, tokenizer,
                 metrics, extra_health: dict | None = None, num_threads: int | None = None,
                 reloader: Callable | None = None):
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.max_token_chars = max_token_chars(tokenizer)
        self.snapshots_available = engine.runner.snapshotter is not None
        self._extra_health = extra_health or {}
        self.metrics = metrics  # sfcl.metrics.PrometheusStatLogger, built by the caller (sfcl.engine_stack)
        sched = engine.scheduler
        self.metrics.watch_queue(lambda: sched.num_running, lambda: sched.num_waiting)
        self.metrics.watch_requests(lambda rid: (st := engine.requests.get(rid)) and st.seq.params.snapshot_mode)
        self.thread = EngineThread(engine, num_threads, self.metrics)
        self._reloader = reloader  # path | None -> (AnchorLibrary, Snapshotter), validated; see sfcl.engine_stack
        self._reload_lock = threading.Lock()
        if engine.library is not None:
            self._set_library_info(engine.library)
        self.thread.start()

    def _set_library_info(self, lib) -> dict:
        from sfcl.snapshot.snapshotter import library_version

        info = {"path": str(lib.path), "version": library_version(lib), "n_anchors": lib.n_anchors,
                "layer": lib.layer, "created": lib.manifest.get("created"), "model_name": lib.manifest.get("model_name")}
        self._extra_health["anchors"] = info
        self.metrics.set_library(info)
        return info

    def reload_anchors(self, path: str | None = None, timeout_s: float = 60.0) -> dict:
        """Load and validate the library at ``path`` (default: the configured one) on the calling
        thread, then swap it in on the engine thread between two steps. Requests admitted from then
        on use it; in-flight ones finish on the version they started with, and the old memory map
        is released when the last of them ends. Returns the new library's summary (path, version,
        n_anchors, layer, created, model_name, previous_version).
        Raises NotImplementedError (no reloader), AnchorLibraryError / ValueError (missing, damaged,
        other model, other snapshot layer: the old library stays), TimeoutError.
        """
        from sfcl.library.store import AnchorLibraryError

        if self._reloader is None:
            raise NotImplementedError("this engine was built without a library reloader")
        with self._reload_lock:
            # on a thread that exits: the index build's OpenMP pool must not outlive it (sfcl.engine.threads)
            lib, snap = run_on_scratch_thread(self._reloader, path, name="sfcl-reload")
            if lib.layer != self.engine.runner.tap_layer:
                raise AnchorLibraryError(f"anchor library {lib.path} is for snapshot layer {lib.layer}, but this "
                                         f"server taps layer {self.engine.runner.tap_layer}; restart to change layers")
            prev = (self._extra_health.get("anchors") or {}).get("version")
            fut: cf.Future = cf.Future()
            self.thread.inbox.put(("swap", lib, snap, fut))
            fut.result(timeout=timeout_s)
            # the old library (unless running requests still hold it) and the index build's
            # temporaries are free now: give their pages back instead of keeping them for the step
            return_freed_memory()
            self.snapshots_available = True
            self.metrics.snapshots_enabled.set(1)
            log.warning("anchor library reloaded: %s", lib.path)
            return {**self._set_library_info(lib), "previous_version": prev}

    def encode_chat(self, messages: list[dict], system: str | None = None) -> list[int]:
        """See ``encode_chat`` (module level) with this engine's tokenizer."""
        return encode_chat(self.tokenizer, messages, system)

    async def stream(self, prompt_ids: list[int], params: SamplingParams,
                     request_id: str | None = None) -> AsyncIterator[EngineEvent]:
        rid = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self.thread.submit(rid, prompt_ids, params, QueueSink(loop, q))
        done = False
        try:
            while True:
                ev = await q.get()
                if isinstance(ev, (Finished, ErrorEvent)):
                    done = True
                yield ev
                if done:
                    return
        finally:
            if not done:
                self.thread.abort(rid)

    def health(self) -> dict:
        sched = self.engine.scheduler
        return {"model": self.model_name, "snapshots_available": self.snapshots_available,
                "running": sched.num_running, "waiting": sched.num_waiting,
                "max_model_len": self.max_model_len, "engine_steps": self.thread.steps,
                "rss_bytes": _rss_bytes(), "threads": threading.active_count(), "tasks": _task_count(),
                "torch_threads": {"decode": self.engine.runner.decode_threads or self.thread._num_threads,
                                  "prefill": self.engine.runner.prefill_threads or self.thread._num_threads},
                "overlap_lookup": self.engine.runner.overlap_lookup,
                **self._extra_health}

    def cut_all(self) -> None:
        self.thread.cut_all()

    async def check_engine_thread(self, timeout_s: float = 20.0) -> int:
        """Health check of the engine thread itself (not only the event loop): it must be alive and
        answer a ping between two steps within ``timeout_s``. Returns the steps run so far.
        Raises RuntimeError (thread gone) or TimeoutError (a step ran longer than ``timeout_s``)."""
        if not self.thread.thread.is_alive():
            raise RuntimeError("the engine thread is not running")
        fut: cf.Future = cf.Future()
        self.thread.inbox.put(("ping", fut))
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)

    def shutdown(self) -> None:
        self.thread.stop()
        if not self.thread.thread.is_alive():  # a step still running past the stop timeout keeps it
            self.thread.engine.runner.close()

"""Test doubles for the HTTP layer (not used in production).

``FakeEngine`` implements ``sfcl.engine.protocol.EngineClient`` with a scripted event stream: it
"generates" the words of a fixed reply (one word = one token), emits a ``SnapshotEvent`` every
``snapshot_every`` tokens (every token in "always" mode, none in "off"), honours ``max_tokens``
and (crudely) stop sequences, and can be told to raise ``EngineBusyError`` or to emit an
``ErrorEvent`` mid-stream. It records every request (params, whether it finished, whether its
iterator was closed) so tests can check that a client disconnect aborts the request.

``serve_in_thread(app)`` runs an app under uvicorn on 127.0.0.1 (free port) in a daemon thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

from sfcl.engine.events import (AnchorHit, EngineEvent, ErrorEvent, Finished, SnapshotEvent,
                                Started, TextDelta)
from sfcl.engine.protocol import EngineBusyError
from sfcl.engine.request import SamplingParams

DEFAULT_REPLY = ("The quick brown fox jumps over the lazy dog. Anchors keep the story "
                 "faithful to its sources, one token at a time.")


@dataclass
class FakeRequest:
    request_id: str | None
    prompt_ids: list[int]
    params: SamplingParams
    generated: int = 0
    finished: bool = False
    closed: bool = False


@dataclass
class FakeEngine:
    """Scripted ``EngineClient``.

    reply: the text generated (split into word tokens, whitespace attached to the word before).
    snapshot_every: in "triggered" mode, a snapshot after every n-th token.
    busy: ``stream`` raises ``EngineBusyError(retry_after_s)`` on the first read.
    error_after: emit ``ErrorEvent(error_message, error_type)`` after this many tokens.
    token_delay_s / start_delay_s: sleep before each token / before ``Started``.
    """

    model_name: str = "fake-model"
    max_model_len: int = 512
    snapshots_available: bool = True
    max_token_chars: int | None = None  # no bound: its word tokens have any length
    reply: str = DEFAULT_REPLY
    snapshot_every: int = 4
    busy: bool = False
    retry_after_s: int = 2
    error_after: int | None = None
    error_type: str = "api_error"
    error_message: str = "scripted engine failure"
    token_delay_s: float = 0.0
    start_delay_s: float = 0.0
    requests: list[FakeRequest] = field(default_factory=list)
    encoded: list[tuple[list[dict], str | None]] = field(default_factory=list)

    # -- EngineClient -------------------------------------------------------------------------

    def encode_chat(self, messages: list[dict], system: str | None = None) -> list[int]:
        """One id per whitespace-separated piece of a toy template (role markers count as one)."""
        self.encoded.append(([dict(m) for m in messages], system))
        pieces: list[str] = []
        if system:
            pieces += ["<|system|>", *system.split()]
        for m in messages:
            pieces += [f"<|{m['role']}|>", *str(m["content"]).split()]
        pieces.append("<|assistant|>")
        return [zlib.crc32(p.encode("utf-8")) % 32000 for p in pieces]

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> AsyncIterator[EngineEvent]:
        return self._run(list(prompt_ids), params, request_id)

    def health(self) -> dict:
        active = sum(1 for r in self.requests if not (r.finished or r.closed))
        return {"model": self.model_name, "max_model_len": self.max_model_len,
                "snapshots_available": self.snapshots_available, "active_requests": active}

    # -- script -------------------------------------------------------------------------------

    def tokens(self) -> list[str]:
        return re.findall(r"\S+\s*", self.reply)

    def _snapshot(self, snapshot_id: int, index: int, token: str, mode: str) -> SnapshotEvent:
        trigger = "always" if mode == "always" else "entity_low_confidence"
        hits = [AnchorHit(anchor_id=100 + index + k, score=0.9 - 0.1 * k, kind="domain",
                          span={"doc_id": f"doc{k}", "start": 10 * k, "end": 10 * k + 9,
                                "text": f"anchor text {k}"}) for k in range(3)]
        return SnapshotEvent(snapshot_id=snapshot_id, token_index=index, trigger=trigger,
                             triggers=[trigger], anchor_id=hits[0].anchor_id, confidence=0.75,
                             token=token, token_logprob=-1.5, entropy=2.25, top=hits,
                             lookup_ms=0.4)

    async def _run(self, prompt_ids: list[int], params: SamplingParams,
                   request_id: str | None) -> AsyncIterator[EngineEvent]:
        if self.busy:
            raise EngineBusyError(self.retry_after_s)
        req = FakeRequest(request_id, prompt_ids, params)
        self.requests.append(req)
        try:
            if self.start_delay_s:
                await asyncio.sleep(self.start_delay_s)
            yield Started(request_id=request_id or "fake", prompt_tokens=len(prompt_ids))
            sent, snaps = "", 0
            triggers: dict[str, int] = {}
            stop_reason, stop_seq = "end_turn", None
            for i, tok in enumerate(self.tokens()):
                if req.generated >= params.max_tokens:
                    stop_reason = "max_tokens"
                    break
                if self.error_after is not None and i == self.error_after:
                    yield ErrorEvent(self.error_message, self.error_type)
                    return
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                req.generated += 1
                text = sent + tok
                hit = min(((text.find(s), s) for s in params.stop if s in text), default=None)
                if hit is not None:  # crude: cut at the stop string, never send it
                    cut = text[:hit[0]][len(sent):]
                    if cut:
                        yield TextDelta(cut, i)
                    stop_reason, stop_seq = "stop_sequence", hit[1]
                    break
                sent = text
                yield TextDelta(tok, i)
                mode = params.snapshot_mode
                if mode == "always" or (mode == "triggered" and (i + 1) % self.snapshot_every == 0):
                    ev = self._snapshot(snaps, i, tok.strip(), mode)
                    triggers[ev.trigger] = triggers.get(ev.trigger, 0) + 1
                    snaps += 1
                    yield ev
            summary = {"mode": params.snapshot_mode, "lookups": snaps, "triggers": triggers,
                       "top_anchors": []}
            req.finished = True
            yield Finished(stop_reason=stop_reason, stop_sequence=stop_seq,
                           prompt_tokens=len(prompt_ids), completion_tokens=req.generated,
                           snapshot_summary=summary, ttft_ms=1.0)
        finally:
            req.closed = True


def parse_sse(text: str) -> list[dict]:
    """Split an SSE body into frames: ``[{"event", "id", "data", "comments": [...]}, ...]``."""
    frames = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        frame: dict = {"event": None, "id": None, "data": None, "comments": []}
        data: list[str] = []
        for line in block.split("\n"):
            if line.startswith(":"):
                frame["comments"].append(line[1:].strip())
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                data.append(value)
            elif name in ("event", "id"):
                frame[name] = value
        frame["data"] = "\n".join(data) if data else None
        frames.append(frame)
    return frames


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port; yields the base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()

"""Scheduler: decides, each engine step, which sequences prefill, which decode, and where their KV
lives. Pure Python (no torch): ints, lists and ``Sequence`` records, unit-tested in milliseconds.

Policy (issue #2 baseline, extended by the throughput work):
- FCFS waiting queue, bounded (``max_waiting``); the engine refuses new work when it is full.
  Requests tagged with one of ``priority_tags`` (e.g. ``high-risk``) jump ahead of untagged
  ones, FCFS among themselves, so their latency SLO can be held separately under load.
- KV slots: running sequences occupy cache slots [0, n_running). When a sequence leaves, the
  highest slot moves into the hole (a ``KVMove`` the runner performs before the forward), so the
  decode batch always attends to contiguous views, never a gather.
- Each step admits at most ``max_prefill_seqs`` waiting sequences (whole-prompt prefill, within
  ``max_prefill_tokens``) and decodes every other running sequence as one batch. A long prompt
  therefore delays the running streams by one prefill forward; chunked prefill is the next step.

Called only from the engine thread.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from sfcl.engine.request import RequestStatus, SamplingParams


@dataclass(slots=True)
class Sequence:
    """One request as the engine sees it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_s: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    slot: int = -1  # KV cache slot while RUNNING, else -1
    finish_reason: str | None = None  # "end_turn" | "max_tokens" | "stop_sequence" | "aborted"
    first_token_s: float | None = None
    scheduled_s: float | None = None  # when it left the waiting queue (queue time = this - arrival)
    last_token_s: float | None = None
    token_gaps_s: list[float] = field(default_factory=list)  # gaps between consecutive output tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]


@dataclass(slots=True)
class KVMove:
    src: int  # slot to copy from
    dst: int  # slot to copy into (free)
    length: int  # positions [0, length) hold valid KV


@dataclass(slots=True)
class SchedulerOutput:
    """The plan of one step; the runner turns it into tensors."""

    moves: list[KVMove]  # performed first, in order
    prefill: list[Sequence]  # each prefills its whole prompt into ``seq.slot``
    decode: list[Sequence]  # one new token each; slots are exactly 0..len(decode)-1 in order
    finished: list[Sequence]  # removed since the last step (aborted while waiting/running)

    @property
    def is_empty(self) -> bool:
        return not (self.prefill or self.decode)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 16  # KV slots = largest decode batch
    max_model_len: int = 8192  # prompt + generated tokens per sequence
    max_waiting: int = 256  # bounded waiting queue
    max_prefill_seqs: int = 1  # new sequences admitted per step
    max_prefill_tokens: int = 8192  # prompt tokens admitted per step (one long prompt always fits)
    priority_tags: tuple[str, ...] = ()  # requests with these tags are admitted before all others

    def __post_init__(self) -> None:
        for f in ("max_num_seqs", "max_model_len", "max_waiting", "max_prefill_seqs", "max_prefill_tokens"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1")


class QueueFullError(Exception):
    pass


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # index i holds the sequence in slot i
        self._removed: list[Sequence] = []
        self._holes: list[int] = []  # slots freed since the last compaction

    # -- intake -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence. Raises QueueFullError when ``max_waiting`` are already waiting and
        ValueError when it cannot fit the context window."""
        if len(self.waiting) >= self.cfg.max_waiting:
            raise QueueFullError()
        if len(seq.prompt_ids) < 1:
            raise ValueError("prompt must have at least one token")
        if len(seq.prompt_ids) + seq.params.max_tokens > self.cfg.max_model_len:
            raise ValueError(
                f"prompt ({len(seq.prompt_ids)} tokens) + max_tokens ({seq.params.max_tokens}) exceeds "
                f"the context window of {self.cfg.max_model_len} tokens"
            )
        seq.status = RequestStatus.WAITING
        if seq.params.tag is not None and seq.params.tag in self.cfg.priority_tags:
            # ahead of every non-priority request, behind earlier priority ones (FCFS among them)
            i = 0
            while i < len(self.waiting) and self.waiting[i].params.tag in self.cfg.priority_tags:
                i += 1
            self.waiting.insert(i, seq)
        else:
            self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Remove a request wherever it is; its slot is reclaimed at the next schedule()."""
        for seq in [*self.waiting, *self.running]:
            if seq is not None and seq.request_id == request_id:
                self.finish(seq, "aborted")
                return True
        return False

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        moves = self._compact()
        decode = list(self.running)
        prefill: list[Sequence] = []
        budget = self.cfg.max_prefill_tokens
        while (self.waiting and len(self.running) < self.cfg.max_num_seqs
               and len(prefill) < self.cfg.max_prefill_seqs):
            seq = self.waiting[0]
            if prefill and len(seq.prompt_ids) > budget:
                break
            self.waiting.popleft()
            budget -= len(seq.prompt_ids)
            seq.slot = len(self.running)
            seq.status = RequestStatus.RUNNING
            seq.scheduled_s = time.monotonic()
            self.running.append(seq)
            prefill.append(seq)
        removed, self._removed = self._removed, []
        return SchedulerOutput(moves=moves, prefill=prefill, decode=decode, finished=removed)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark a sequence finished, waiting or running (engine update, abort, shutdown); a running
        sequence leaves a slot hole that the next schedule() compacts."""
        if seq.status is RequestStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is RequestStatus.RUNNING and 0 <= seq.slot < len(self.running) and self.running[seq.slot] is seq:
            self.running[seq.slot] = None  # type: ignore[call-overload]  # a hole until compaction
            self._holes.append(seq.slot)
        seq.status = RequestStatus.FINISHED
        seq.finish_reason = reason
        seq.slot = -1
        self._removed.append(seq)

    def _compact(self) -> list[KVMove]:
        """Fill holes with the highest running slots so that slots stay [0, n)."""
        moves: list[KVMove] = []
        if not self._holes:
            return moves
        self._holes.clear()
        live = self.running
        lo, hi = 0, len(live) - 1
        while True:
            while hi >= 0 and live[hi] is None:
                live.pop()
                hi -= 1
            while lo < hi and live[lo] is not None:
                lo += 1
            if lo >= hi:
                break
            seq = live.pop()
            hi -= 1
            moves.append(KVMove(src=seq.slot, dst=lo, length=seq.num_tokens))
            seq.slot = lo
            live[lo] = seq
        return moves

    # -- queries --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return sum(1 for s in self.running if s is not None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._removed)

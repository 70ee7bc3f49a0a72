"""Scheduler: decides, each engine step, which sequences prefill (and how much), which decode, where
their KV lives, and which prefix-cache blocks are restored or saved. Pure Python (no torch): ints,
lists and ``Sequence`` records, unit-tested in milliseconds.

Policy:
- FCFS waiting queue, bounded (``max_waiting``); the engine refuses new work when it is full.
  Requests tagged with one of ``priority_tags`` (e.g. ``high-risk``) jump ahead of untagged
  ones, FCFS among themselves, so their latency SLO can be held separately under load.
- Continuous batching with chunked prefill (Agrawal et al. 2024, Sarathi-Serve): every step
  decodes all running sequences whose prompt is complete, and spends the rest of a token budget
  (``max_num_batched_tokens``) on prompt chunks of prefilling sequences, oldest first, except that
  prompts with at most ``short_prefill_tokens`` left go first (vLLM v1 caps a long prefill's share
  for the same reason, ``long_prefill_token_threshold``): a short request admitted while a long
  document prefills finishes its prompt in its first step instead of after all of the document's
  chunks. A long prompt therefore delays running streams by at most one chunk forward per step
  instead of one whole-prompt forward. Chunks end on KV-block boundaries except at the prompt's end.
- Prefix caching (``sfcl.engine.block_manager``): on admission the longest cached chain of the
  prompt's full blocks (leaving at least one token to compute) is restored instead of prefilled;
  prompt blocks are saved to the cache as their chunk completes. A waiting request whose next
  uncached block is being computed by a running sequence (the same document, asked again before
  its first prefill finished) waits until that block is saved and then restores it, rather than
  computing the same prefix a second time; requests behind it are admitted meanwhile, but not
  into the slot or prefill seat it will need. A request steering with ``knn`` waits only for an
  owner that also steers with ``knn`` (the runner records context anchors while computing).
- Shared-prefix decode attention (``decode_groups``): decoding sequences whose rows hold the same
  prefix-cache blocks (restored from, or saved to, the same pool blocks: identical KV) are
  grouped, and attention reads that prefix once per group instead of once per row (cascade /
  shared-prefix attention: Juravsky et al. 2024, "Hydragen"; FlashInfer's cascade inference).
- KV slots: decoding sequences occupy cache slots [0, n_decode), prefilling ones the slots above,
  so the decode batch always attends to contiguous views, never a gather. When a sequence leaves
  or completes its prompt, ``KVMove`` records (performed by the runner before the forward) restore
  that layout; slot ``max_num_seqs`` is a scratch row for swaps. A slot that no longer holds a
  sequence's KV (its sequence left, was moved away, or the scratch row after a swap) is listed
  in ``release`` once, so the KV cache can give its memory back (``KVCache.release``).

Called only from the engine thread.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from sfcl.engine.block_manager import PrefixCache, block_hashes
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
    num_computed: int = 0  # prompt tokens whose KV is in the slot (restored or prefilled)
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache
    block_table: list[int] = field(default_factory=list)  # prefix-cache block per full prompt block (prefix)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full prompt blocks
    exact_blocks: int = 0  # leading block_table entries whose pool content is this row's KV bit for bit
    # (restored from the pool or saved from this row; not a block another sequence computed alongside)

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= len(self.prompt_ids)

    @property
    def kv_len(self) -> int:
        """Positions [0, kv_len) of the slot hold valid KV."""
        return self.num_computed + max(0, len(self.output_ids) - 1) if self.prefill_done else self.num_computed

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
class BlockCopy:
    """Prefix-cache transfer for one sequence: pool blocks <-> its slot row, block-aligned."""

    slot: int
    first_block: int  # logical block index in the sequence (positions first_block * block_size ...)
    pool_blocks: list[int]  # consecutive logical blocks first_block, first_block + 1, ...


@dataclass(slots=True)
class PrefillChunk:
    seq: Sequence
    start: int  # prompt positions [start, end) are computed this step
    end: int

    @property
    def is_last(self) -> bool:
        return self.end >= len(self.seq.prompt_ids)


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows whose KV positions [0, shared) are identical (the same exact prefix-cache
    blocks): attention may read those positions once, from row ``rows[0]``, for all of them."""

    rows: list[int]  # indices into SchedulerOutput.decode (== their slots), ascending
    shared: int  # positions, a whole number of blocks


# A group pays a few extra operators per layer (~0.1 ms on the 2-core AVX2 EPYC): it is formed only
# when it spares reading at least this many cached positions per layer ((rows - 1) x shared).
MIN_SHARED_SAVING = 512


def decode_groups(decode: list[Sequence], block_size: int, min_saving: int | None = None) -> list[DecodeGroup]:
    """Disjoint groups of ``decode`` rows that share exact prefix-cache blocks, chosen to maximise
    the cached positions not read twice, sum over groups of (rows - 1) x shared (a prefix trie over
    the rows' exact block ids: at each branch, one group at the common depth or the best groups of
    the branches, whichever spares more). Groups sparing fewer than ``min_saving`` positions are
    left out (None: ``MIN_SHARED_SAVING``). Pure Python; a few hundred comparisons for 16 rows of
    ~100 blocks."""
    min_saving = MIN_SHARED_SAVING if min_saving is None else min_saving
    members = [(i, tuple(s.block_table[:s.exact_blocks])) for i, s in enumerate(decode) if s.exact_blocks]

    def best(ms: list[tuple[int, tuple[int, ...]]], d: int) -> tuple[int, list[DecodeGroup]]:
        depth = d  # every member shares ids [0, depth)
        while all(len(t) > depth for _, t in ms) and len({t[depth] for _, t in ms}) == 1:
            depth += 1
        saving = (len(ms) - 1) * depth * block_size
        one = (saving, [DecodeGroup(sorted(i for i, _ in ms), depth * block_size)]) if saving >= min_saving else (0, [])
        ends = [m for m in ms if len(m[1]) == depth]
        kids: dict[int, list] = {}
        for m in ms:
            if len(m[1]) > depth:
                kids.setdefault(m[1][depth], []).append(m)
        split_val, split = 0, []
        if len(ends) > 1 and (len(ends) - 1) * depth * block_size >= min_saving:
            split_val, split = (len(ends) - 1) * depth * block_size, [DecodeGroup(sorted(i for i, _ in ends), depth * block_size)]
        for kid in kids.values():
            if len(kid) > 1:
                v, g = best(kid, depth + 1)
                split_val, split = split_val + v, split + g
        return one if one[0] >= split_val else (split_val, split)

    return sorted(best(members, 0)[1], key=lambda g: g.rows[0]) if len(members) > 1 else []


@dataclass(slots=True)
class SchedulerOutput:
    """The plan of one step; the runner turns it into tensors. Order: moves, restores, forwards
    (decode batch, prefill chunks), saves."""

    moves: list[KVMove]  # performed first, in order
    prefill: list[PrefillChunk]  # prompt chunks; the sequence samples its first token on its last chunk
    decode: list[Sequence]  # one new token each; slots are exactly 0..len(decode)-1 in order
    finished: list[Sequence]  # removed since the last step (aborted while waiting/running)
    restores: list[BlockCopy] = field(default_factory=list)  # prefix-cache hits: pool -> slot, before forwards
    saves: list[BlockCopy] = field(default_factory=list)  # prompt blocks completed this step: slot -> pool
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache this step
    prefix_hits: int = 0  # of which restored
    release: list[int] = field(default_factory=list)  # slots whose KV nobody holds any more: after the moves
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # decode rows sharing identical prefix KV

    @property
    def is_empty(self) -> bool:
        return not (self.prefill or self.decode or self.restores or self.release)

    @property
    def sampled(self) -> list[Sequence]:
        """Sequences that get a new token this step (decode rows first, then last prompt chunks),
        in the runner's row order."""
        return list(self.decode) + [c.seq for c in self.prefill if c.is_last]


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 16  # KV slots = largest decode batch
    max_model_len: int = 8192  # prompt + generated tokens per sequence
    max_waiting: int = 256  # bounded waiting queue
    max_num_batched_tokens: int = 512  # tokens per step: decode rows + prompt chunk tokens
    max_prefill_seqs: int = 4  # sequences prefilling at once
    # a prefilling sequence with at most this many prompt tokens left gets its chunk before older ones
    # (None: max_num_batched_tokens // 4), so short requests are not queued behind a long prompt's chunks
    short_prefill_tokens: int | None = None
    block_size: int = 16  # KV block (prefix-cache and INT8-scale granularity), tokens
    prefix_cache_blocks: int = 0  # prefix-cache pool size in blocks (0: prefix caching off)
    priority_tags: tuple[str, ...] = ()  # requests with these tags are admitted before all others
    shared_prefix_attention: bool = True  # plan decode_groups (rows that share prefix-cache blocks)

    def __post_init__(self) -> None:
        for f in ("max_num_seqs", "max_model_len", "max_waiting", "max_prefill_seqs", "max_num_batched_tokens",
                  "block_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1")
        if self.prefix_cache_blocks < 0:
            raise ValueError("prefix_cache_blocks must be >= 0")
        if self.short_prefill_tokens is not None and self.short_prefill_tokens < 0:
            raise ValueError("short_prefill_tokens must be >= 0")
        if self.max_num_batched_tokens < self.block_size + self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens must be >= block_size + max_num_seqs "
                             f"({self.block_size + self.max_num_seqs}) so that prefill always progresses")
        self.priority_tags = tuple(self.priority_tags)


class QueueFullError(Exception):
    pass


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.prefix = PrefixCache(cfg.prefix_cache_blocks, cfg.block_size)
        self._removed: list[Sequence] = []
        self._free_slots: list[int] = list(range(cfg.max_num_seqs))
        self.scratch_slot = cfg.max_num_seqs  # the KV cache has max_num_seqs + 1 rows
        self._vacated: set[int] = set()  # slots left by a sequence since the last plan (-> release)

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
            if seq.request_id == request_id:
                self.finish(seq, "aborted")
                return True
        return False

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg, bs = self.cfg, self.cfg.block_size
        self.prefix.discard_pending()  # a step that failed never wrote its saves
        queries = hits = 0
        admitted: list[Sequence] = []
        # admit: while a slot is free and few enough sequences are prefilling
        n_decode = sum(1 for s in self.running if s.prefill_done)
        n_prefilling = len(self.running) - n_decode
        deferred = 0
        for seq in list(self.waiting):
            if not self._free_slots or n_prefilling >= cfg.max_prefill_seqs or deferred > 2 * cfg.max_num_seqs:
                break  # (a bounded scan: a long queue of deferred requests costs no more than this per step)
            hashes: list[int] = []
            if self.prefix.enabled:
                if not seq.block_hashes:  # once per request (it may wait several steps)
                    n_full = (len(seq.prompt_ids) - 1) // bs  # the last prompt token is always computed
                    seq.block_hashes = block_hashes(seq.prompt_ids, bs, n_full)
                hashes = seq.block_hashes
                if self._prefix_in_flight(hashes, seq):
                    deferred += 1
                    continue  # restore it once it is saved; later requests go ahead meanwhile
            if deferred and (len(self._free_slots) <= deferred or n_prefilling + deferred >= cfg.max_prefill_seqs):
                break  # a later request may not take the slot or prefill seat a deferred one will need
            self.waiting.remove(seq)
            seq.status = RequestStatus.RUNNING
            seq.scheduled_s = time.monotonic()
            # lowest free slot above the decode region: the oldest prefilling sequence then usually
            # sits at slot n_decode when its prompt completes and joins the batch without a move
            above = [f for f in self._free_slots if f >= n_decode]
            seq.slot = min(above) if above else min(self._free_slots)
            self._free_slots.remove(seq.slot)
            seq.num_computed = seq.cached_tokens = seq.exact_blocks = 0
            if self.prefix.enabled:
                seq.block_hashes = hashes
                q0, h0 = self.prefix.queries, self.prefix.hits
                seq.block_table = self.prefix.match(seq.block_hashes, seq.prompt_ids)
                seq.exact_blocks = len(seq.block_table)  # restored: copies of the pool blocks
                queries += self.prefix.queries - q0
                hits += self.prefix.hits - h0
            self.running.append(seq)
            admitted.append(seq)
            n_prefilling += 1
        decode = [s for s in self.running if s.prefill_done]
        prefilling = [s for s in self.running if not s.prefill_done]
        moves = self._layout(decode, prefilling)  # admitted sequences have no KV yet: moved free
        # vacated slots, unless KV was moved into them: released after the moves, before any write
        # (a sequence admitted into one has computed nothing yet: num_computed is set below)
        filled = {s.slot for s in self.running if s.kv_len > 0}
        release = sorted(self._vacated - filled)
        self._vacated = set()
        restores: list[BlockCopy] = []
        for seq in admitted:  # restore into the final slot, after the moves
            if seq.block_table:
                seq.num_computed = seq.cached_tokens = len(seq.block_table) * bs
                restores.append(BlockCopy(seq.slot, 0, list(seq.block_table)))
        # prompt chunks within the step's token budget: prompts that finish within short_prefill_tokens
        # first (a short request admitted while a long prompt prefills is not held for all of that
        # prompt's chunks), then oldest first
        budget = cfg.max_num_batched_tokens - len(decode)
        short = cfg.max_num_batched_tokens // 4 if cfg.short_prefill_tokens is None else cfg.short_prefill_tokens
        first = [q for q in prefilling if len(q.prompt_ids) - q.num_computed <= short] if len(prefilling) > 1 else []
        chunks: list[PrefillChunk] = []
        saves: list[BlockCopy] = []
        for seq in first + [q for q in prefilling if q not in first]:
            n_prompt = len(seq.prompt_ids)
            # With prefix caching the prompt's tail (after its last full cacheable block) is always
            # its own chunk: a later request restoring the blocks computes that tail as its own
            # chunk too. (The step's GEMMs run over all its rows, whose count differs between the
            # cold and the repeated request, so in bf16 a repeat may still round differently and part
            # from the cold answer at a near tie: docs/engine.md.)
            boundary = len(seq.block_hashes) * bs if self.prefix.enabled else 0
            while budget > 0 and seq.num_computed < n_prompt:
                start = seq.num_computed
                end = min(n_prompt, start + budget)
                if start < boundary:
                    end = min(end, boundary)
                if end < n_prompt:
                    end = start + (end - start) // bs * bs  # block-aligned unless it completes the prompt
                    if end <= start:
                        break
                chunks.append(PrefillChunk(seq, start, end))
                budget -= end - start
                seq.num_computed = end
            if self.prefix.enabled:
                saves.extend(self._plan_saves(seq))
            if budget <= 0:
                break
        removed, self._removed = self._removed, []
        groups = decode_groups(decode, bs) if cfg.shared_prefix_attention and self.prefix.enabled else []
        return SchedulerOutput(moves=moves, prefill=chunks, decode=decode, finished=removed, restores=restores,
                               saves=saves, prefix_queries=queries, prefix_hits=hits, release=release,
                               decode_groups=groups)

    def _prefix_in_flight(self, hashes: list[int], seq: Sequence) -> bool:
        """Is the first block of this prompt that the cache cannot restore now being computed by a
        running sequence (the same chained hash at the same index of a prompt still prefilling)?
        A request that steers with ``knn`` records its prompt's states as context anchors while it
        computes them (``ModelRunner``), so it waits only for an owner that records them too."""
        i = self.prefix.ready_blocks(hashes, seq.prompt_ids)
        if i >= len(hashes):
            return False
        knn = "knn" in seq.params.steer
        return any(not s.prefill_done and len(s.block_hashes) > i and s.block_hashes[i] == hashes[i]
                   and (not knn or "knn" in s.params.steer) for s in self.running)

    def step_done(self) -> None:
        """The runner executed the last plan (its saves are written)."""
        self.prefix.commit()

    def _plan_saves(self, seq: Sequence) -> list[BlockCopy]:
        """Allocate cache blocks for the full prompt blocks that are now computed."""
        bs = self.cfg.block_size
        n_done = min(len(seq.block_hashes), seq.num_computed // bs)
        out: list[BlockCopy] = []
        while len(seq.block_table) < n_done:
            i = len(seq.block_table)
            got = self.prefix.allocate(seq.block_hashes[i], tuple(seq.prompt_ids[i * bs:(i + 1) * bs]))
            if got is None:  # every block is referenced by a running sequence: stop caching this prompt
                seq.block_hashes = seq.block_hashes[:i]
                break
            bid, needs_save = got
            seq.block_table.append(bid)
            if needs_save and seq.exact_blocks == i:  # the pool block will be a copy of this row
                seq.exact_blocks = i + 1
            if needs_save:
                if out and out[-1].first_block + len(out[-1].pool_blocks) == i:
                    out[-1].pool_blocks.append(bid)
                else:
                    out.append(BlockCopy(seq.slot, i, [bid]))
        return out

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark a sequence finished, waiting or running (engine update, abort, shutdown); a running
        sequence frees its slot and its prefix-cache block references."""
        if seq.status is RequestStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is RequestStatus.RUNNING and seq in self.running:
            self.running.remove(seq)
            self._free_slots.append(seq.slot)
            self._vacated.add(seq.slot)
            if seq.block_table:
                self.prefix.release(seq.block_table)
                seq.block_table = []
        seq.status = RequestStatus.FINISHED
        seq.finish_reason = reason
        seq.slot = -1
        self._removed.append(seq)

    def _layout(self, decode: list[Sequence], prefilling: list[Sequence]) -> list[KVMove]:
        """Moves that put decoding sequences in slots [0, n_decode) (any order) and prefilling ones
        at or above n_decode; decode is then sorted by slot. Swaps go through the scratch row."""
        n = len(decode)
        moves: list[KVMove] = []
        misplaced = [s for s in decode if s.slot >= n]
        if misplaced:
            occupant = {s.slot: s for s in prefilling}
            targets = sorted(set(range(n)) - {s.slot for s in decode})
            free = set(self._free_slots)
            for seq, t in zip(misplaced, targets):
                old = seq.slot
                other = occupant.get(t)
                if other is not None:  # a prefilling sequence sits there: swap (via the scratch row)
                    if other.kv_len:
                        moves.append(KVMove(src=t, dst=self.scratch_slot, length=other.kv_len))
                    moves.append(KVMove(src=old, dst=t, length=seq.kv_len))
                    if other.kv_len:
                        moves.append(KVMove(src=self.scratch_slot, dst=old, length=other.kv_len))
                    # the scratch row after a swap; or ``old``, left to a sequence without KV yet
                    self._vacated.add(self.scratch_slot if other.kv_len else old)
                    other.slot, seq.slot = old, t
                    occupant[old] = other
                else:
                    moves.append(KVMove(src=old, dst=t, length=seq.kv_len))
                    free.discard(t)
                    free.add(old)
                    self._vacated.add(old)
                    seq.slot = t
            self._free_slots = sorted(free)
        decode.sort(key=lambda s: s.slot)
        return moves

    # -- queries --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._removed)

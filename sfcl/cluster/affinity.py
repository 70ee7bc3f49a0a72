"""Prefix-cache affinity: which engine replica holds the longest cached prefix of a prompt.

Pure Python (no Ray, no torch), unit-tested on its own; ``sfcl.cluster.router`` is its Ray Serve
adapter. A prompt is described by the chained hashes of its full KV blocks, the same hashes the
engine's prefix cache keys its blocks by (``sfcl.engine.block_manager.block_hashes``: block i's
hash covers tokens 0 .. (i+1)*block_size, so holding hash i means holding the whole prefix up to
there). What a replica holds is known two ways:

* reported: the replica's own list of cached block hashes (``EngineReplica.record_routing_stats``,
  pulled by the Serve controller every ``report_interval_s`` and broadcast to every router). It is
  the truth, evictions included, but arrives late;
* routed: the hashes of the requests this router sent to the replica in the last ``routed_ttl_s``
  seconds. Known at once, so the second question about a document follows the first even before
  the next report; forgotten after the TTL, when the reports have caught up.

``choose`` returns the replica with the longest match, unless that match covers no more than
``min_match_ratio`` of the prompt's blocks (a shared chat-template header or system prompt alone
must not pull every request to one replica) or the holder's ongoing requests exceed the least
loaded replica's by more than ``max_queue_gap``; then None, and the caller falls back to power of
two choices. The same rule as SGLang's cache-aware router (match rate above a threshold first,
shortest queue when the load is imbalanced), on block hashes instead of characters.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

MAX_ROUTED_BLOCKS = 1 << 16  # per replica; oldest routed hashes are forgotten first beyond it


@dataclass(slots=True)
class AffinityConfig:
    max_queue_gap: int = 4  # ongoing requests the holder may have beyond the least loaded replica
    routed_ttl_s: float = 60.0  # lifetime of the router's own record of a routed prefix
    min_match_ratio: float = 0.5  # the holder must hold more than this share of the prompt's blocks

    def __post_init__(self) -> None:
        if self.max_queue_gap < 0 or self.routed_ttl_s < 0:
            raise ValueError("max_queue_gap and routed_ttl_s must be >= 0")
        if not 0.0 <= self.min_match_ratio < 1.0:
            raise ValueError("min_match_ratio must be in [0, 1)")


class PrefixAffinity:
    """Prefix holdings per replica (keyed by any hashable replica id) and the routing rule."""

    def __init__(self, cfg: AffinityConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg or AffinityConfig()
        self.clock = clock
        self._reported: dict[object, frozenset[int]] = {}
        self._routed: dict[object, OrderedDict[int, float]] = {}  # hash -> time routed, oldest first

    def report(self, replica: object, hashes: Iterable[int]) -> None:
        """Replace what ``replica`` reported holding (its whole list of cached block hashes)."""
        self._reported[replica] = frozenset(hashes)

    def routed(self, replica: object, hashes: Sequence[int]) -> None:
        """A request with these prefix hashes was sent to ``replica``."""
        rec = self._routed.setdefault(replica, OrderedDict())
        now = self.clock()
        for h in hashes:
            rec[h] = now
            rec.move_to_end(h)
        while len(rec) > MAX_ROUTED_BLOCKS:
            rec.popitem(last=False)

    def forget(self, replica: object) -> None:
        """The replica is gone (died, scaled down): nothing is held there any more."""
        self._reported.pop(replica, None)
        self._routed.pop(replica, None)

    def matched_blocks(self, replica: object, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` that ``replica`` holds (reported or recently routed)."""
        reported = self._reported.get(replica, frozenset())
        rec = self._routed.get(replica)
        if rec:
            cutoff = self.clock() - self.cfg.routed_ttl_s
            while rec and next(iter(rec.values())) < cutoff:  # expire the oldest first
                rec.popitem(last=False)
        n = 0
        for h in hashes:
            if h not in reported and not (rec and h in rec):
                break
            n += 1
        return n

    def choose(self, hashes: Sequence[int], queue_lens: Mapping[object, int | None]) -> object | None:
        """The replica (a key of ``queue_lens``) holding the longest prefix of ``hashes``, or None
        when no replica holds more than ``min_match_ratio`` of its blocks or the best holder is
        overloaded. queue_lens: ongoing requests per candidate replica (None: unknown, treated as
        not overloaded)."""
        best, best_n = None, 0
        for replica, q in queue_lens.items():
            n = self.matched_blocks(replica, hashes)
            if n > best_n or (n == best_n and n and _shorter(q, queue_lens[best])):
                best, best_n = replica, n
        if best is None or best_n <= self.cfg.min_match_ratio * len(hashes):
            return None
        known = [q for q in queue_lens.values() if q is not None]
        q_best = queue_lens[best]
        if q_best is not None and known and q_best - min(known) > self.cfg.max_queue_gap:
            return None
        return best


def _shorter(a: int | None, b: int | None) -> bool:
    return a is not None and (b is None or a < b)

"""Prefix cache block manager: fixed-size KV blocks keyed by chained hashes. Pure Python, no torch.

Follows vLLM's automatic prefix caching (hash of a full block chained to the previous block's
hash, reference counts, LRU eviction of unreferenced cached blocks; Kwon et al. 2023,
"Efficient Memory Management for LLM Serving with PagedAttention"), adapted to SFCL's storage:

- A running sequence's *working* KV lives in one contiguous cache row (its slot), so that CPU
  decode attends to plain views without a per-step gather of blocks (on 2 CPU cores a block gather
  of the whole KV each step costs about as much as the attention itself).
- The prefix cache is a pool of ``num_blocks`` physical blocks of ``block_size`` positions
  (``sfcl.model.kv_cache.KVCache.pool_*``). Each sequence has a *block table*: logical prompt
  block i -> pool block id. On admission the longest cached chain of the prompt's full blocks is
  *restored* (pool -> row copy, ~23 KB/token for SmolLM2-135M in bf16, instead of recomputing the
  prefill); when a prompt block has been computed it is *saved* (row -> pool copy) under its hash.

A block id is referenced (``ref > 0``) while some running sequence's block table holds it, and is
then never evicted. Unreferenced blocks keep their hash and content on an LRU list and are reused
(evicted) oldest first. A block allocated in this step becomes matchable only after the runner
executed the step (``commit``), so that no one restores a block before its content is written.

Counters (tokens): ``queries`` = prompt tokens looked up, ``hits`` = prompt tokens restored.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    hash: int | None = None  # chained hash of the tokens it holds (None: empty)
    tokens: tuple[int, ...] = ()  # kept to rule out hash collisions on a match
    ref: int = 0
    ready: bool = False  # content written (the step that saved it has run)


def block_hashes(token_ids: list[int], block_size: int, n_blocks: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (at most ``n_blocks``).

    hash_i = hash((hash_{i-1}, tokens of block i)), hash_{-1} = 0. Python's hash of a tuple of ints
    is deterministic across processes (PYTHONHASHSEED only salts str/bytes)."""
    n = len(token_ids) // block_size if n_blocks is None else min(n_blocks, len(token_ids) // block_size)
    out: list[int] = []
    h = 0
    for i in range(n):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return out


class PrefixCache:
    """Block pool bookkeeping. ``num_blocks`` may be 0 (prefix caching disabled)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 0 or block_size < 1:
            raise ValueError("num_blocks must be >= 0 and block_size >= 1")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.by_hash: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # ref == 0
        self._pending: list[int] = []
        self.queries = 0  # tokens looked up (cumulative)
        self.hits = 0  # tokens found (cumulative)

    @property
    def enabled(self) -> bool:
        return bool(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.lru)

    def cached_hashes(self) -> list[int]:
        """Hashes of the blocks whose content is written (matchable now). Safe to call from another
        thread than the owner's: the dict is copied in one C-level step before filtering."""
        return [h for h, bid in self.by_hash.copy().items() if self.blocks[bid].ready]

    def ready_blocks(self, hashes: list[int], token_ids: list[int]) -> int:
        """How many leading blocks of a prompt ``match`` would restore now (no references taken,
        nothing counted)."""
        bs = self.block_size
        n = 0
        for i, h in enumerate(hashes):
            bid = self.by_hash.get(h)
            if bid is None or not self.blocks[bid].ready or self.blocks[bid].tokens != tuple(token_ids[i * bs:(i + 1) * bs]):
                break
            n += 1
        return n

    def match(self, hashes: list[int], token_ids: list[int]) -> list[int]:
        """Longest chain of ready cached blocks for a prompt; references them. Returns block ids
        (block i of the result holds prompt tokens [i*bs, (i+1)*bs)). Counts queries/hits."""
        self.queries += len(token_ids)
        found = [self.by_hash[h] for h in hashes[:self.ready_blocks(hashes, token_ids)]]
        for bid in found:
            self._ref(bid)
        self.hits += len(found) * self.block_size
        return found

    def allocate(self, h: int, tokens: tuple[int, ...]) -> tuple[int, bool] | None:
        """A block for new content with hash ``h``, referenced once: (block id, needs_save), or
        None when every block is in use. If a block with this hash already exists (another
        sequence computed the same prefix) that block is referenced and needs no save."""
        bid = self.by_hash.get(h)
        if bid is not None and self.blocks[bid].tokens == tokens:
            self._ref(bid)
            return bid, False
        if not self.lru:
            return None
        bid, _ = self.lru.popitem(last=False)  # least recently used
        self._forget(bid)  # evict
        b = self.blocks[bid]
        b.hash, b.tokens, b.ref, b.ready = h, tokens, 1, False
        self.by_hash[h] = bid
        self._pending.append(bid)
        return bid, True

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; unreferenced blocks stay cached, most recent last."""
        for bid in block_ids:
            b = self.blocks[bid]
            if b.ref <= 0:
                raise RuntimeError(f"block {bid} released more often than referenced")
            b.ref -= 1
            if b.ref == 0:
                if b.ready:
                    self.lru[bid] = None
                else:  # never written (its sequence ended before the save ran): forget it
                    self._forget(bid)
                    self.lru[bid] = None
                    self.lru.move_to_end(bid, last=False)  # reuse empty blocks first

    def commit(self) -> None:
        """The step that wrote the blocks allocated since the last commit has executed: make them
        matchable."""
        for bid in self._pending:
            self.blocks[bid].ready = self.blocks[bid].hash is not None
        self._pending.clear()

    def discard_pending(self) -> None:
        """The step that should have written the pending blocks did not run (it failed): unhash
        them so that nobody restores unwritten content. Owners keep their reference."""
        for bid in self._pending:
            self._forget(bid)
        self._pending.clear()

    def _forget(self, bid: int) -> None:
        """Drop a block's hash and content record (it becomes an empty block)."""
        b = self.blocks[bid]
        if b.hash is not None and self.by_hash.get(b.hash) == bid:
            del self.by_hash[b.hash]
        b.hash, b.tokens, b.ready = None, (), False

    def _ref(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.ref == 0:
            self.lru.pop(bid, None)
        b.ref += 1

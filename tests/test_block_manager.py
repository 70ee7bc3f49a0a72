"""Prefix-cache block pool: chained hashes, references, LRU eviction, commit discipline."""

import pytest

from sfcl.engine.block_manager import PrefixCache, block_hashes


def test_hashes_are_chained_so_a_block_depends_on_everything_before_it():
    a = block_hashes(list(range(12)), 4)
    b = block_hashes([99] + list(range(1, 12)), 4)
    assert len(a) == 3 and len(set(a)) == 3
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]  # same tokens in blocks 1, 2; different prefix
    assert block_hashes(list(range(13)), 4) == a  # a partial block has no hash
    assert block_hashes(list(range(12)), 4, n_blocks=2) == a[:2]


def test_match_needs_committed_blocks_and_equal_tokens():
    pc = PrefixCache(4, 2)
    toks = [1, 2, 3, 4, 5]
    hs = block_hashes(toks, 2)
    ids = [pc.allocate(h, tuple(toks[i * 2:i * 2 + 2]))[0] for i, h in enumerate(hs)]
    assert pc.match(hs, toks) == []  # written only when the step runs
    pc.commit()
    got = pc.match(hs, toks)
    assert got == ids and pc.hits == 4 and pc.queries == 10
    assert [pc.blocks[i].ref for i in ids] == [2, 2]
    # a colliding hash with other tokens is not a hit
    pc.blocks[ids[0]].tokens = (7, 7)
    assert pc.match(hs, toks) == []


def test_allocate_shares_a_block_that_already_holds_the_same_content():
    pc = PrefixCache(2, 2)
    h = block_hashes([1, 2], 2)[0]
    bid, new = pc.allocate(h, (1, 2))
    assert new
    bid2, new2 = pc.allocate(h, (1, 2))
    assert bid2 == bid and not new2 and pc.blocks[bid].ref == 2


def test_unreferenced_blocks_stay_cached_and_are_evicted_lru_first():
    pc = PrefixCache(2, 1)
    a = pc.allocate(11, (1,))[0]
    b = pc.allocate(22, (2,))[0]
    pc.commit()
    assert pc.allocate(33, (3,)) is None  # all referenced
    pc.release([a])
    pc.release([b])
    assert pc.num_free == 2 and pc.match([11], [1]) == [a]  # still cached; referenced again
    pc.release([a])  # now a is the most recently used
    c = pc.allocate(33, (3,))[0]
    assert c == b and 22 not in pc.by_hash and 11 in pc.by_hash  # b was least recently used
    with pytest.raises(RuntimeError):
        pc.release([a])


def test_discarded_pending_blocks_are_never_matched_and_are_reused_first():
    pc = PrefixCache(3, 1)
    x = pc.allocate(5, (5,))[0]
    pc.discard_pending()
    pc.commit()
    assert pc.match([5], [5]) == [] and 5 not in pc.by_hash
    pc.release([x])
    assert next(iter(pc.lru)) == x  # empty blocks are handed out before cached ones


def test_disabled_pool():
    pc = PrefixCache(0, 16)
    assert not pc.enabled and pc.allocate(1, (1,)) is None
    with pytest.raises(ValueError):
        PrefixCache(-1, 16)

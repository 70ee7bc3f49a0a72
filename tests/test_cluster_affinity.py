"""sfcl.cluster.affinity: the prefix-affinity routing rule, on plain ints (no Ray, no model)."""

from __future__ import annotations

import pytest

from sfcl.cluster.affinity import AffinityConfig, PrefixAffinity
from sfcl.engine.block_manager import PrefixCache, block_hashes

BS = 16


def doc_prompt(doc: int, question: int, doc_tokens: int = 160) -> list[int]:
    """Token ids of a document (shared by its questions) followed by one question."""
    return [1000 * doc + i for i in range(doc_tokens)] + [900_000 + 100 * question + i for i in range(20)]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_reported_holdings_route_to_the_replica_with_the_longest_prefix():
    aff = PrefixAffinity()
    a, b = block_hashes(doc_prompt(1, 0), BS), block_hashes(doc_prompt(2, 0), BS)
    aff.report("r1", a)
    aff.report("r2", a[:3] + b)  # r2 holds a short piece of doc 1 only
    q = block_hashes(doc_prompt(1, 3), BS)  # another question about doc 1
    assert aff.matched_blocks("r1", q) == 10 and aff.matched_blocks("r2", q) == 3
    assert aff.choose(q, {"r1": 0, "r2": 0}) == "r1"
    assert aff.choose(block_hashes(doc_prompt(2, 1), BS), {"r1": 0, "r2": 0}) == "r2"


def test_the_engines_prefix_cache_hashes_are_the_ones_matched():
    """What a replica reports (PrefixCache.cached_hashes) is what the ingress hashes."""
    ids = doc_prompt(5, 0)
    cache = PrefixCache(num_blocks=64, block_size=BS)
    for h, i in zip(block_hashes(ids, BS), range(len(ids) // BS)):
        cache.allocate(h, tuple(ids[i * BS:(i + 1) * BS]))
    assert cache.cached_hashes() == []  # not written yet: not matchable, not reported
    cache.commit()
    aff = PrefixAffinity()
    aff.report("r1", cache.cached_hashes())
    assert aff.matched_blocks("r1", block_hashes(doc_prompt(5, 4), BS)) == 10


def test_no_holder_or_a_short_shared_header_falls_back_to_power_of_two():
    aff = PrefixAffinity(AffinityConfig(min_match_ratio=0.5))
    header = list(range(32))  # two blocks every prompt shares (chat template, system prompt)
    aff.report("r1", block_hashes(header + list(range(100, 164)), BS))
    assert aff.choose(block_hashes(doc_prompt(9, 0), BS), {"r1": 0, "r2": 0}) is None  # nothing held
    other = block_hashes(header + list(range(500, 548)), BS)  # 5 blocks, 2 held: 40% <= 50%
    assert aff.matched_blocks("r1", other) == 2
    assert aff.choose(other, {"r1": 0, "r2": 0}) is None
    assert PrefixAffinity(AffinityConfig(min_match_ratio=0.3)).choose(other, {"r1": 0}) is None  # nothing reported
    low = PrefixAffinity(AffinityConfig(min_match_ratio=0.3))
    low.report("r1", block_hashes(header + list(range(100, 164)), BS))
    assert low.choose(other, {"r1": 0, "r2": 0}) == "r1"


def test_a_holder_whose_queue_is_too_long_is_skipped():
    aff = PrefixAffinity(AffinityConfig(max_queue_gap=4))
    q = block_hashes(doc_prompt(1, 0), BS)
    aff.report("r1", q)
    assert aff.choose(q, {"r1": 6, "r2": 2}) == "r1"  # gap 4: still the holder
    assert aff.choose(q, {"r1": 7, "r2": 2}) is None  # gap 5: least loaded instead
    assert aff.choose(q, {"r1": 7, "r2": None}) == "r1"  # unknown load elsewhere: no evidence of imbalance


def test_equal_matches_prefer_the_shorter_queue():
    aff = PrefixAffinity()
    q = block_hashes(doc_prompt(1, 0), BS)
    aff.report("r1", q)
    aff.report("r2", q)
    assert aff.choose(q, {"r1": 3, "r2": 1}) == "r2"
    assert aff.choose(q, {"r1": 1, "r2": 3}) == "r1"


def test_routed_requests_count_until_their_ttl_then_only_reports():
    clock = Clock()
    aff = PrefixAffinity(AffinityConfig(routed_ttl_s=60.0), clock=clock)
    q1 = block_hashes(doc_prompt(3, 0), BS)
    aff.routed("r2", q1)  # sent there a moment ago: no report yet
    q2 = block_hashes(doc_prompt(3, 1), BS)
    assert aff.choose(q2, {"r1": 0, "r2": 0}) == "r2"
    clock.t = 61.0
    assert aff.choose(q2, {"r1": 0, "r2": 0}) is None  # the record expired and r2 never reported it
    aff.report("r2", q1)
    assert aff.choose(q2, {"r1": 0, "r2": 0}) == "r2"


def test_a_report_replaces_the_previous_one_and_forget_drops_a_replica():
    aff = PrefixAffinity(AffinityConfig(routed_ttl_s=0.0))
    q = block_hashes(doc_prompt(4, 0), BS)
    aff.report("r1", q)
    aff.report("r1", [])  # evicted since
    assert aff.matched_blocks("r1", q) == 0
    aff.report("r1", q)
    aff.forget("r1")  # died or scaled down
    assert aff.choose(q, {"r2": 0}) is None


def test_config_is_validated():
    for bad in ({"max_queue_gap": -1}, {"routed_ttl_s": -1.0}, {"min_match_ratio": 1.0}, {"min_match_ratio": -0.1}):
        with pytest.raises(ValueError):
            AffinityConfig(**bad)

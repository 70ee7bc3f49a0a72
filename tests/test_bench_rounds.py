"""``sfcl bench`` interleaved rounds: how requests split into whole waves, and rounds at the edges
(one round, more rounds than requests)."""

import pytest


@pytest.mark.parametrize("n,rounds,wave", [(1, 1, 1), (1, 5, 1), (3, 10, 2), (5, 10, 1), (48, 2, 16),
                                           (47, 3, 16), (8, 3, 2), (100, 7, 4), (2, 0, 1), (4, 2, 0), (96, 4, 16)])
def test_split_invariants(n, rounds, wave):
    """Rounds are whole waves (multiples of the level's concurrency), as equal as whole waves
    allow; the requests that do not fill a wave ride with the last round."""
    from sfcl.bench.run import _split

    parts = _split(n, rounds, wave)
    w = max(1, wave)
    assert sum(parts) == n and 1 <= len(parts) <= max(1, rounds)
    assert all(p % w == 0 for p in parts[:-1]) and all(p >= w for p in parts if n >= w)
    waves = [p // w for p in parts]
    assert max(waves) - min(waves) <= 1


@pytest.mark.parametrize("rounds", [1, 5])
def test_bench_interleaved_rounds_edges(serve, rounds):
    """rounds=1 (one pass per mode) and rounds larger than the requests (falls back to fewer
    rounds): every request is sent once and pooled into its mode's rows."""
    from sfcl.bench import clients, workloads
    from sfcl.bench.run import Plan, Results, bench_interleaved

    url, eng = serve()
    targets = [(clients.Target(f"sfcl-{m}", url, model="fake-model", headers={"x-sfcl-snapshot": m}), k)
               for k, m in enumerate(("off", "always"))]
    plan = Plan(workloads=("single", "concurrent"), levels=(3,), single_requests=3, requests_per_level=4,
                max_tokens=2, longdoc_max_tokens=2, prompts=workloads.short_prompts(4), rounds=rounds)
    res = Results()
    bench_interleaved(targets, plan, res, None)
    assert len(eng.encoded) == 2 * (3 + 4)
    assert len(res.samples["sfcl-off|single|c1"]) == 3 and len(res.samples["sfcl-always|concurrent|c3"]) == 4
    assert all(s.error is None for v in res.samples.values() for s in v)

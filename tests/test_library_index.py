"""sfcl.library.index.AnchorIndex: dense and IVF top-k search (the IVF pass both as
the kernel module's anchor_search and as its torch operators), the exact re-scoring contract, the exact
fallback of short rows, input handling."""

import numpy as np
import pytest
import torch
from test_library_store import make_arrays, save

from sfcl.library import index as index_module
from sfcl.library.index import (
    GROUPED_MIN_CELLS,
    IVF_GROUP_PROBE,
    IVF_LIST_SIZE,
    IVF_MIN_ANCHORS,
    SQ4_CLIP,
    AnchorIndex,
    candidates,
    ivf_search_torch,
    sq4_query,
    sq4_rows,
    sq4_unpack,
)
from sfcl.library.store import load_library_dir
from sfcl.model import decode_kernel
from sfcl.snapshot.triggers import anchor_confidence_each


def _lib(tmp_path, n, d, vectors=None, seed=0):
    a = make_arrays(n=n, d=d, seed=seed)
    if vectors is not None:
        a["vectors"] = vectors
    return load_library_dir(save(tmp_path / f"lib-{n}-{d}-{seed}", a))


def _clustered(n, d, n_centres=300, noise=0.35, seed=0):
    """Unit vectors around random centres: structure like a library of k-means anchors."""
    g = torch.Generator().manual_seed(seed)
    c = torch.nn.functional.normalize(torch.randn(n_centres, d, generator=g), dim=-1)
    return torch.nn.functional.normalize(c[torch.randint(0, n_centres, (n,), generator=g)]
                                         + noise * torch.randn(n, d, generator=g) / d ** 0.5, dim=-1)


def _near(lib, n: int, noise: float, g: torch.Generator) -> torch.Tensor:
    """n queries (n, D) float32: random library vectors plus Gaussian noise of norm ~``noise``."""
    q = lib.vectors[torch.randint(0, lib.n_anchors, (n,), generator=g)].float()
    return q + noise * torch.randn(q.shape, generator=g) / q.shape[1] ** 0.5


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A library just above IVF_MIN_ANCHORS (IVF-searched with approximate=True) and its exact index."""
    n, d = IVF_MIN_ANCHORS + 904, 32
    lib = _lib(tmp_path_factory.mktemp("big"), n, d, vectors=_clustered(n, d))
    return lib, AnchorIndex(lib)


def _brute(vectors16: torch.Tensor, q: np.ndarray, k: int):
    v = vectors16.float().numpy().astype(np.float64)
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    s = qn @ v.T
    ids = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(s, ids, 1), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 3, 10, 500])
def test_dense_search_matches_brute_force(tmp_path, dtype, k):
    n, d = 300, 32
    lib = _lib(tmp_path, n, d, seed=1)
    index = AnchorIndex(lib, dtype=dtype, approximate=True)  # below IVF_MIN_ANCHORS: dense anyway
    assert index.kind == "dense" and index.nprobe == 0
    rng = np.random.default_rng(7)
    q = rng.normal(size=(9, d)) * rng.uniform(0.01, 50, size=(9, 1))  # unnormalised
    scores, ids = index.search(torch.from_numpy(q).to(torch.float64), k=k)
    kk = min(k, n)
    assert scores.shape == (9, kk) and ids.shape == (9, kk)
    assert scores.dtype == torch.float32 and ids.dtype == torch.int64
    ref_s, ref_ids = _brute(lib.vectors, q, kk)
    np.testing.assert_allclose(scores.numpy(), ref_s, atol=1e-5)
    assert (np.diff(scores.numpy(), axis=1) <= 1e-7).all()  # best first
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    own = np.take_along_axis(qn @ lib.vectors.float().numpy().T, ids.numpy(), 1)
    np.testing.assert_allclose(own, ref_s, atol=1e-5)  # returned ids really have those scores
    assert (ids.numpy()[:, 0] == ref_ids[:, 0]).all()
    if kk == n:
        assert all(sorted(row) == list(range(n)) for row in ids.tolist())


@pytest.fixture(scope="module")
def kernel():
    if not decode_kernel.load():
        pytest.skip(f"SFCL's native kernels could not be built here: {decode_kernel.why_unavailable()}")


@pytest.mark.parametrize("native", [False, True])
def test_ivf_recall_and_exact_scores(big, native, request):
    lib, exact = big
    if native:
        request.getfixturevalue("kernel")
    ivf = AnchorIndex(lib, approximate=True, native=native)
    assert ivf.native is native
    assert ivf.kind == "ivf" and ivf.vectors is None and ivf.nprobe >= 1 and ivf.memory_bytes() > 0
    g = torch.Generator().manual_seed(1)
    near = lib.vectors[torch.randint(0, lib.n_anchors, (200,), generator=g)].float()
    q = near + 0.3 * torch.randn(near.shape, generator=g) / near.shape[1] ** 0.5
    s_ref, i_ref = exact.search(q, 3)
    s, i = ivf.search(q, 3)
    recall = np.mean([len(set(a) & set(b)) / 3 for a, b in zip(i.tolist(), i_ref.tolist())])
    assert recall >= 0.95
    # every returned score is the float32 score of the stored float16 vector (up to summation
    # order), best first
    qn = torch.nn.functional.normalize(q, dim=-1)
    own = torch.bmm(lib.vectors[i].float(), qn[:, :, None])[:, :, 0]
    torch.testing.assert_close(s, own, atol=2e-6, rtol=0)
    assert (s[:, :-1] >= s[:, 1:]).all()
    hit = (i == i_ref).all(1)
    torch.testing.assert_close(s[hit], s_ref[hit], atol=1e-6, rtol=0)


@pytest.mark.parametrize("native", [False, None])
def test_ivf_short_rows_fall_back_to_exact(big, native, monkeypatch):
    """nprobe 1 and k = 300 (with the exact-above-IVF_MAX_K rule lifted): the one scanned cell holds
    fewer than 300 anchors, so every row is searched exactly; results equal the exact index."""
    lib, exact = big
    monkeypatch.setattr(index_module, "IVF_MAX_K", 1000)
    ivf = AnchorIndex(lib, approximate=True, nprobe=1, native=native)
    q = torch.randn(5, lib.hidden_size, generator=torch.Generator().manual_seed(2))
    s_ref, i_ref = exact.search(q, 300)
    s, i = ivf.search(q, 300)
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(s, s_ref, atol=1e-6, rtol=0)


def test_ivf_searches_above_ivf_max_k_are_exact(big, monkeypatch):
    """k > IVF_MAX_K goes straight to exact search (the candidate lists' insertion would be
    quadratic in k, and so many anchors per query is a scan of most cells anyway)."""
    lib, exact = big
    ivf = AnchorIndex(lib, approximate=True, nprobe=1)
    monkeypatch.setattr(ivf, "_native_search", None)  # the IVF pass must not run
    monkeypatch.setattr(index_module, "ivf_search_torch", None)
    q = torch.randn(5, lib.hidden_size, generator=torch.Generator().manual_seed(2))
    s_ref, i_ref = exact.search(q, 300)
    s, i = ivf.search(q, 300)
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(s, s_ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16, torch.float64])
def test_ivf_query_dtypes_norms_and_non_finite(big, dt):
    lib, exact = big
    ivf = AnchorIndex(lib, approximate=True)
    q = lib.vectors[:4].float() + 0.01
    for scale in (1.0, 1e-20, 1e15):
        qq = (q * scale).to(dt)
        s_ref, i_ref = exact.search(qq, 3)
        s, ids = ivf.search(qq, 3)
        torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=0, equal_nan=True)  # fp16 * 1e15: inf -> NaN both
        assert torch.equal(ids, i_ref) or not bool(s_ref.abs().sum() > 0)


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("scale", [1e30, 1e-30])
def test_float32_queries_of_extreme_norm_find_the_same_anchors(big, approximate, scale):
    """Break-it pass: the dense search normalised in float32, so a 1e30-norm query overflowed to
    inf, became zero, and scored 0 against everything (the IVF path took its norm in float64)."""
    lib, exact = big
    index = AnchorIndex(lib, approximate=approximate)
    q = lib.vectors[:4].float() + 0.01
    s_ref, i_ref = exact.search(q, 3)
    s, ids = index.search(q * scale, 3)
    assert torch.equal(ids, i_ref)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=0)


def test_ivf_zero_and_non_contiguous_queries(big):
    lib, exact = big
    ivf = AnchorIndex(lib, approximate=True)
    s, ids = ivf.search(torch.zeros(2, lib.hidden_size), 3)
    assert torch.equal(s, torch.zeros(2, 3)) and ((ids >= 0) & (ids < lib.n_anchors)).all()
    q = lib.vectors[:3].float().T.contiguous().T  # (3, D) with stride (1, 3)
    assert not q.is_contiguous()
    assert torch.equal(ivf.search(q, 3)[1], exact.search(q, 3)[1])


def test_ivf_is_deterministic_per_library(big):
    lib, _ = big
    q = torch.randn(50, lib.hidden_size, generator=torch.Generator().manual_seed(3))
    a, b = AnchorIndex(lib, approximate=True), AnchorIndex(lib, approximate=True)
    assert torch.equal(a.search(q, 5)[1], b.search(q, 5)[1])


def test_ivf_search_leaves_the_calling_threads_torch_thread_count(big):
    """BUG: faiss's omp_set_num_threads(1) bound to torch's libgomp, so a search on the engine
    thread (in-step lookups, steered rows) left it decoding on one thread for good."""
    import sys
    import threading
    import time

    lib, _ = big
    ivf = AnchorIndex(lib, approximate=True)
    seen = []

    def engine_like():
        torch.get_num_threads()  # this thread's lazy init first, as sfcl.engine.threads.set_thread_count does
        torch.set_num_threads(2)
        ivf.search(torch.randn(4, lib.hidden_size), 3)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=engine_like)
    t.start()
    t.join()
    assert seen == [2]


def test_ties_and_duplicate_anchors(tmp_path):
    """Identical anchors (ties): same scores as exact, no anchor returned twice."""
    g = torch.Generator().manual_seed(3)
    v = torch.randn(1, 16, generator=g).repeat(40, 1)
    v[20:] = torch.randn(20, 16, generator=g)
    lib = _lib(tmp_path, 40, 16, vectors=v)
    for dtype in (torch.float32, torch.bfloat16):
        s, ids = AnchorIndex(lib, dtype=dtype).search(v[:2] + 0.01, 25)
        s_ref, _ = AnchorIndex(lib).search(v[:2] + 0.01, 25)
        torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=0)
        assert (ids.sort(1).values.diff(dim=1) > 0).all()


def test_self_query_and_input_dtypes(tmp_path):
    lib = _lib(tmp_path, 40, 16)
    index = AnchorIndex(lib)
    q = lib.vectors[:5].clone() * 7
    for qq in (q, q.float(), q.to(torch.bfloat16)):
        scores, ids = index.search(qq, k=1)
        assert ids[:, 0].tolist() == [0, 1, 2, 3, 4]
        assert torch.allclose(scores[:, 0], torch.ones(5), atol=1e-2)


def test_bad_arguments(tmp_path):
    lib = _lib(tmp_path, 40, 16)
    index = AnchorIndex(lib)
    with pytest.raises(ValueError, match="16"):
        index.search(torch.randn(2, 15))
    with pytest.raises(ValueError):
        index.search(torch.randn(16))
    with pytest.raises(ValueError):
        index.search(torch.randn(1, 16), k=0)
    with pytest.raises(ValueError, match="nprobe"):
        AnchorIndex(lib, approximate=True, nprobe=0)
    with pytest.raises(ValueError, match="list_size"):
        AnchorIndex(lib, approximate=True, list_size=0)
    with pytest.raises(ValueError, match="dtype"):
        AnchorIndex(lib, dtype=torch.int8)


def test_native_pass_equals_the_torch_pass(big, kernel):
    """The native anchor_search and ivf_search_torch: the same cells, candidates and re-score, so
    the same anchors (a near tie at the candidate cut may differ; none here) and the same scores up
    to float32 summation order; short and non-finite rows come back -1 from both."""
    lib, _ = big
    ivf = AnchorIndex(lib, approximate=True, native=True)
    c = ivf.cells
    q = _near(lib, 64, 0.3, torch.Generator().manual_seed(5))
    q[3] = float("nan")
    q[7, 0] = float("inf")
    for k in (1, 3, 10):
        args = c.arrays()
        s_n, i_n, c_n = decode_kernel.module().anchor_search(q, ivf.stored, *args, ivf.nprobe, k, candidates(k, ivf.n))
        s_t, i_t = ivf_search_torch(c, ivf.stored, q, ivf.nprobe, k, candidates(k, ivf.n))
        assert torch.equal(i_n, i_t)
        torch.testing.assert_close(s_n, s_t, atol=2e-6, rtol=0)
        assert (i_n[3] == -1).all() and (i_n[7] == -1).all() and (i_n[[0, 1, 2, 4]] >= 0).all()
        assert torch.isnan(c_n).all()  # no weights, no confidences
    s_n, i_n, _ = decode_kernel.module().anchor_search(q[:2], ivf.stored, *args, 1, 200, 200)  # one cell < 200 anchors
    assert (i_n == -1).all() and torch.isinf(s_n).all()


def test_native_pass_confidences_are_the_snapshot_rule(big, kernel):
    """With per-anchor weights and decays the native pass returns anchor_confidence_each of what it
    found (the numpy epilogue it replaces in Snapshotter.lookup), NaN where a row found nothing."""
    lib, _ = big
    ivf = AnchorIndex(lib, approximate=True, native=True)
    c = ivf.cells
    g = torch.Generator().manual_seed(11)
    q = _near(lib, 32, 0.5, g)
    q[5] = float("nan")
    w = torch.rand(lib.n_anchors, generator=g) * 1.5  # above 1 too: the rule clips at 1
    lam = torch.rand(lib.n_anchors, generator=g) * 20
    args = (*c.arrays(), ivf.nprobe, 3, candidates(3, ivf.n))
    s, i, conf = decode_kernel.module().anchor_search(q, ivf.stored, *args, w, lam)
    ok = torch.ones(len(q), dtype=torch.bool)
    ok[5] = False
    want = anchor_confidence_each(s[ok].numpy(), w.numpy()[i[ok].numpy()], lam.numpy()[i[ok].numpy()])
    np.testing.assert_allclose(conf[ok].numpy(), want, rtol=2e-6, atol=1e-7)
    assert torch.isnan(conf[5]).all() and (conf[ok] <= 1).all() and (conf[ok] > 0).any()
    scores, ids, got = ivf.search_confidence(q[ok], 3, w, lam)  # through the index
    assert torch.equal(ids, i[ok]) and torch.equal(got, conf[ok])
    assert ivf.search_confidence(q, 3, w, lam)[2] is None  # a row searched exactly: the caller's epilogue
    with pytest.raises(RuntimeError, match="weights"):
        decode_kernel.module().anchor_search(q, ivf.stored, *args, w[:-1], lam[:-1])
    with pytest.raises(RuntimeError, match="both"):
        decode_kernel.module().anchor_search(q, ivf.stored, *args, w, None)


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """A library with GROUPED_MIN_CELLS cells (8,192 anchors): the cells come in groups. D = 160:
    several blocks of 4-bit codes (``big``, D = 32: one)."""
    n, d = GROUPED_MIN_CELLS * IVF_LIST_SIZE, 160
    lib = _lib(tmp_path_factory.mktemp("grouped"), n, d, vectors=_clustered(n, d, n_centres=900, seed=3))
    return lib, AnchorIndex(lib)


def test_grouped_cells_recall_and_the_two_passes_agree(grouped, kernel):
    """Cells grouped by the second k-means level: each group's cells are contiguous, a query ranks
    only its group_probe best groups' centroids, recall@3 holds against exact search, and the native
    pass and ivf_search_torch pick the same anchors (fewer cells in the groups than nprobe: only those
    are scanned, by both)."""
    lib, exact = grouped
    ivf = AnchorIndex(lib, approximate=True, native=True)
    c = ivf.cells
    assert c.ngroups == round(c.nlist ** 0.5) and ivf.group_probe == IVF_GROUP_PROBE
    assert c.group_offsets[0] == 0 and c.group_offsets[-1] == c.nlist and (c.group_offsets.diff() >= 0).all()
    q = _near(lib, 200, 0.3, torch.Generator().manual_seed(4))
    _, i_ref = exact.search(q, 3)
    _, i = ivf.search(q, 3)
    assert np.mean([len(set(a) & set(b)) / 3 for a, b in zip(i.tolist(), i_ref.tolist())]) >= 0.95
    args = c.arrays()
    for nprobe, gp in ((ivf.nprobe, ivf.group_probe), (200, 1), (12, c.ngroups)):
        s_n, i_n, _ = decode_kernel.module().anchor_search(q, ivf.stored, *args, nprobe, 3, candidates(3, ivf.n),
                                                           None, None, *c.groups(), gp)
        s_t, i_t = ivf_search_torch(c, ivf.stored, q, nprobe, 3, candidates(3, ivf.n), gp)
        assert torch.equal(i_n, i_t)
        torch.testing.assert_close(s_n, s_t, atol=2e-6, rtol=0)
        for r in (0, 1, 77, 199):  # a row searched with 199 others (sharing their cells' reads) finds what it finds alone
            s_1, i_1, _ = decode_kernel.module().anchor_search(q[r:r + 1], ivf.stored, *args, nprobe, 3,
                                                               candidates(3, ivf.n), None, None, *c.groups(), gp)
            assert torch.equal(i_1[0], i_n[r]) and torch.equal(s_1[0], s_n[r])
    ungrouped = decode_kernel.module().anchor_search(q, ivf.stored, *args, 12, 3, 19)[1]
    all_groups = decode_kernel.module().anchor_search(q, ivf.stored, *args, 12, 3, 19, None, None, *c.groups(),
                                                      c.ngroups)[1]
    assert torch.equal(ungrouped, all_groups)  # every group probed: every centroid ranked
    with pytest.raises(RuntimeError, match="together"):
        decode_kernel.module().anchor_search(q, ivf.stored, *args, 12, 3, 19, None, None, c.group_centroids)
    bad = c.group_offsets.clone()
    bad[3] = 10**9
    with pytest.raises(RuntimeError, match="group_offsets"):
        decode_kernel.module().anchor_search(q, ivf.stored, *args, 12, 3, 19, None, None, c.group_centroids,
                                             c.group_scale, bad, 4)
    with pytest.raises(ValueError, match="group_probe"):
        AnchorIndex(lib, approximate=True, group_probe=0)


def test_search_lists_is_search_confidence_as_lists(grouped, kernel):
    """The served lookup's native call (AnchorLookup: Python lists, no tensor) returns what
    search_confidence returns; None where it does not apply, so the caller takes the tensor path."""
    lib, _ = grouped
    ivf = AnchorIndex(lib, approximate=True, native=True)
    g = torch.Generator().manual_seed(6)
    q = lib.vectors[torch.randint(0, lib.n_anchors, (5,), generator=g)].float() + 0.01
    w, lam = torch.rand(lib.n_anchors, generator=g), torch.rand(lib.n_anchors, generator=g) * 10
    s, i, c = ivf.search_confidence(q, 3, w, lam)
    assert ivf.search_lists(q, 3, w, lam) == (s.tolist(), i.tolist(), c.tolist())
    q[2] = float("nan")  # a row for the exact fallback
    assert ivf.search_lists(q, 3, w, lam) is None
    assert ivf.search_lists(q[:2].double(), 3, w, lam) is None
    assert ivf.search_lists(q[:2], 65, w, lam) is None  # above IVF_MAX_K: exact search
    assert AnchorIndex(lib, approximate=True, native=False).search_lists(q[:2], 3, w, lam) is None


def test_rows_searched_together_find_what_they_find_alone_even_among_tied_anchors(tmp_path, kernel):
    """A library of anchors stored three times each (every candidate list full of tied scores) and a
    batch with repeated and near-identical rows: each row's ids and scores equal its search alone,
    and the torch pass finds the same anchors."""
    n, d = GROUPED_MIN_CELLS * IVF_LIST_SIZE // 3 + 1, 96
    base = _clustered(n, d, n_centres=200, seed=5)
    lib = _lib(tmp_path, 3 * n, d, vectors=base.repeat(3, 1))
    ivf = AnchorIndex(lib, approximate=True, native=True)
    c = ivf.cells
    g = torch.Generator().manual_seed(12)
    q = _near(lib, 6, 0.2, g)
    q = torch.cat([q, q[:3], q[:2] + 1e-4 * torch.randn(2, d, generator=g)])  # 11 rows: repeats and near repeats
    tail = (ivf.nprobe, 3, candidates(3, ivf.n), None, None, *c.groups(), ivf.group_probe)
    s_n, i_n, _ = decode_kernel.module().anchor_search(q, ivf.stored, *c.arrays(), *tail)
    s_t, i_t = ivf_search_torch(c, ivf.stored, q, ivf.nprobe, 3, candidates(3, ivf.n), ivf.group_probe)
    assert torch.equal(i_n.sort(1).values, i_t.sort(1).values)  # the same anchors (topk orders exact ties its own way)
    torch.testing.assert_close(s_n, s_t, atol=2e-6, rtol=0)
    for r in range(len(q)):
        s_1, i_1, _ = decode_kernel.module().anchor_search(q[r:r + 1], ivf.stored, *c.arrays(), *tail)
        assert torch.equal(i_1[0], i_n[r]) and torch.equal(s_1[0], s_n[r]), r
    assert torch.equal(i_n[6:9], i_n[:3])


def test_candidates_tied_across_cells_are_kept_in_the_rows_probe_order(kernel):
    """Eight anchors in two cells whose members all score the same (identical centroid vectors,
    all-zero residual codes), cell 1 ranked first by its centroid's codes: a row's 2 candidates are
    the first two of its own scan in its probe order (cell 1's anchors 4 and 5, not cell 0's), and the
    re-score then picks 5. Alone and beside other rows probing the same cells. (A scan that read the
    cells in ascending order for all rows at once and kept ties by arrival failed this.)"""
    d = 64
    q = torch.ones(1, d)
    stored = torch.zeros(8, d)
    stored[0] = 1.0  # the exact best overall, in the cell scanned second
    stored[4, :32] = 1.0
    stored[5, :48] = 1.0
    args = (stored.half(), torch.tensor([[0] * 32, [0x11] * 32], dtype=torch.uint8), torch.ones(d),
            torch.zeros(2, d).half(), torch.tensor([0, 4, 8]), torch.arange(8, dtype=torch.int32),
            torch.zeros(8, 32, dtype=torch.uint8), torch.ones(d), 2, 1, 2)
    _, ids, _ = decode_kernel.module().anchor_search(q, *args)
    assert ids.tolist() == [[5]]
    _, ids, _ = decode_kernel.module().anchor_search(torch.cat([q, 2 * q, q + 0.5]), *args)
    assert ids.tolist() == [[5], [5], [5]]


def test_anchor_lookup_reuses_its_buffers_and_holds_its_index(grouped, kernel):
    """AnchorLookup (the served call: the index's arguments converted and checked once) finds what
    anchor_search finds for every call of a sequence of batch sizes (its buffers are reused between
    calls, smaller and larger), holds the index's tensors after every other reference is gone, checks
    its index arguments when built and each query's shape and dtype when called."""
    import gc

    lib, _ = grouped
    ivf = AnchorIndex(lib, approximate=True, native=True)
    c = ivf.cells
    g = torch.Generator().manual_seed(11)
    w, lam = torch.rand(lib.n_anchors, generator=g), torch.rand(lib.n_anchors, generator=g) * 10
    index_args = [ivf.stored.clone(), *(t.clone() for t in c.arrays())]
    tail = (ivf.nprobe, 3, candidates(3, ivf.n), w.clone(), lam.clone(), *(t.clone() for t in c.groups()), ivf.group_probe)
    lookup = decode_kernel.module().AnchorLookup(*index_args, *tail)
    expected = {}
    for n in (5, 1, 7, 0, 3, 5):
        q = _near(lib, n, 0.3, g) if n else torch.empty(0, lib.hidden_size)
        s, i, cf = decode_kernel.module().anchor_search(q, *index_args, *tail)
        expected[n] = (q, (s.tolist(), i.tolist(), cf.tolist(), bool((i < 0).any())))
    del index_args, tail
    gc.collect()
    for n, (q, want) in expected.items():
        assert lookup(q) == want, n
    with pytest.raises(RuntimeError, match="queries"):
        lookup(expected[5][0].double())
    with pytest.raises(RuntimeError, match="queries"):
        lookup(expected[5][0][:, :-1].contiguous())
    off = c.offsets.clone()
    off[5] = 10**9
    with pytest.raises(RuntimeError, match="offsets"):
        decode_kernel.module().AnchorLookup(ivf.stored, *c.arrays()[:3], off, *c.arrays()[4:], 12, 3, 19)
    with pytest.raises(RuntimeError, match="both"):
        decode_kernel.module().AnchorLookup(ivf.stored, *c.arrays(), 12, 3, 19, w, None)
    for bad_id in (-1, lib.n_anchors):  # a tester's find: both were accepted when built (one raised later, one gave -1s)
        members = c.members.clone()
        members[7] = bad_id
        with pytest.raises(RuntimeError, match="member id"):
            decode_kernel.module().AnchorLookup(ivf.stored, *c.arrays()[:4], members, *c.arrays()[5:], 12, 3, 19)


def test_ivf_cells_partition_the_library(big):
    lib, _ = big
    c = AnchorIndex(lib, approximate=True, native=False).cells
    assert sorted(c.members.tolist()) == list(range(lib.n_anchors))
    assert c.offsets[0] == 0 and c.offsets[-1] == lib.n_anchors and (c.offsets.diff() >= 0).all()
    assert c.codes.dtype == torch.uint8 and c.codes.shape == (lib.n_anchors, -(-lib.hidden_size // 64) * 32)
    assert c.centroids.shape == (c.nlist, c.codes.shape[1]) and c.code_step.shape == (2 * c.codes.shape[1],)


def test_anchor_search_rejects_inconsistent_arguments(big, kernel):
    lib, _ = big
    ivf = AnchorIndex(lib, approximate=True, native=True)
    c = ivf.cells
    q = torch.randn(2, lib.hidden_size)
    good = dict(queries=q, stored=ivf.stored, centroids=c.centroids, centroid_step=c.centroid_step,
                centroid_vectors=c.centroid_vectors, offsets=c.offsets, members=c.members, codes=c.codes, code_step=c.code_step)
    bad = {"queries": q.double(), "stored": ivf.stored.float(), "centroids": c.centroids.to(torch.int8),
           "centroid_step": c.centroid_step[:-1], "centroid_vectors": c.centroid_vectors.float(), "offsets": c.offsets[:-1], "members": c.members.long(),
           "codes": c.codes[:-1], "code_step": c.code_step.double()}
    for name, value in bad.items():
        args = dict(good, **{name: value})
        with pytest.raises(RuntimeError, match="anchor_search"):
            decode_kernel.module().anchor_search(*args.values(), 12, 3, 19)
    for bad_entry in (-10**9, 10**9):  # a decreasing entry inside (break-it pass: it was a segfault)
        off = c.offsets.clone()
        off[5] = bad_entry
        with pytest.raises(RuntimeError, match="offsets"):
            decode_kernel.module().anchor_search(*dict(good, offsets=off).values(), c.nlist, 3, 19)
    with pytest.raises(RuntimeError, match="anchor_search"):
        decode_kernel.module().anchor_search(*good.values(), 12, 3, 2)  # fewer candidates than k
    with pytest.raises(RuntimeError, match="anchor_search"):
        decode_kernel.module().anchor_search(*good.values(), 0, 3, 19)
    with pytest.raises(RuntimeError, match="anchor_search"):
        decode_kernel.module().anchor_search(q[:, :-1].contiguous(), *list(good.values())[1:], 12, 3, 19)


def test_native_search_keeps_the_gil(big, kernel):
    """The native pass is a pybind11 function that holds the GIL for its whole call: a Python thread
    spinning beside it is stopped from the call's start for at least the call's own length (a torch
    operator releases the GIL, and taking it back from a busy event loop cost served lookups up to
    the 5 ms switch interval). The spinner logs each stretch in which it did not run (>= 1 ms between
    two of its iterations). (Counting its iterations between two reads around the call failed under
    load: the GIL can change hands right after the call, before the second read.)"""
    import sys
    import threading
    import time

    lib, _ = big
    ivf = AnchorIndex(lib, approximate=True, native=True)
    assert ivf.native
    q = torch.randn(4000, lib.hidden_size, generator=torch.Generator().manual_seed(9))  # a call of tens of ms
    gaps, stop, started = [], threading.Event(), threading.Event()

    def spin():
        started.set()
        prev = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            if now - prev > 1e-3:
                gaps.append((prev, now))
            prev = now

    c = ivf.cells
    args = (ivf.stored, *c.arrays(), ivf.nprobe, 3,
            candidates(3, ivf.n))
    search = decode_kernel.module().anchor_search
    search(q[:1], *args)  # warm
    solo = []
    for _ in range(3):
        t0 = time.perf_counter()
        search(q, *args)
        solo.append(time.perf_counter() - t0)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # the spinner may not force the GIL away during the call
    t = threading.Thread(target=spin, daemon=True)
    try:
        t.start()
        started.wait()
        time.sleep(0.01)  # the spinner runs
        t0 = time.perf_counter()
        search(q, *args)
        time.sleep(0.01)  # the spinner runs again and logs the stretch it was stopped
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)
    assert min(solo) > 0.005
    stopped = [b - t0 for a, b in gaps if a <= t0 <= b]  # how long after the call's start the spinner ran again
    assert stopped and stopped[0] >= 0.8 * min(solo), (min(solo), gaps)


def test_sq4_rows_pack_codes_of_each_dimension_range():
    """sq4_rows: 4-bit codes of each dimension's clipped range, two per byte in the documented order
    (block of 64 dimensions: byte j low = dimension j, high = dimension 32 + j), the width padded
    to a multiple of 64 with step 0 and code 0, and every value inside its range within half a step."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 100, generator=g) * torch.linspace(0.1, 3, 100)
    packed, step = sq4_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (300, 64) and step.shape == (128,)
    codes = sq4_unpack(packed)  # (300, 128)
    assert codes.max() <= 15 and (codes[:, 100:] == 0).all() and (step[100:] == 0).all()
    byte = packed[:, 5]  # block 0, byte 5: dimensions 5 (low nibble) and 37 (high)
    assert torch.equal(byte & 15, codes[:, 5]) and torch.equal(byte >> 4, codes[:, 37])
    assert torch.equal(packed[:, 32 + 7] & 15, codes[:, 64 + 7])  # block 1, byte 7: dimension 71
    lo = torch.quantile(x, SQ4_CLIP, dim=0)
    hi = torch.quantile(x, 1 - SQ4_CLIP, dim=0)
    assert torch.allclose(step[:100], (hi - lo) / 15, rtol=1e-5)
    inside = (x >= lo) & (x <= hi)
    err = (lo + codes[:, :100].float() * step[:100] - x).abs()
    assert (err[inside] <= (step[:100] / 2 + 1e-5).expand_as(err)[inside]).all()
    assert inside.float().mean() > 0.95  # the clip leaves out about 2% per dimension


def test_sq4_query_ranks_rows_as_their_inner_products():
    """The integer sums of sq4_query's codes against rows' 4-bit codes rank the rows as q . x of the
    rows the codes reconstruct (up to the query's int8 rounding): the IVF pass's approximate score."""
    g = torch.Generator().manual_seed(4)
    x = torch.nn.functional.normalize(torch.randn(2000, 192, generator=g), dim=1)
    packed, step = sq4_rows(x)
    q = torch.nn.functional.normalize(torch.randn(1, 192, generator=g), dim=1)
    q8, scale = sq4_query(q, step)
    approx = scale * (sq4_unpack(packed).float() @ q8.float()[0])  # (2000,) q . x up to q . lo
    exact = x @ q[0]
    top = set(torch.topk(exact, 20).indices.tolist())
    assert len(top & set(torch.topk(approx, 40).indices.tolist())) >= 18
    assert torch.corrcoef(torch.stack([approx, exact]))[0, 1] > 0.97
    lo = torch.quantile(x, SQ4_CLIP, dim=0)  # the constant sq4_query leaves out
    err = (approx + q[0] @ lo - exact).abs()
    assert err.mean() < 0.01 and err.max() < 0.05  # 4-bit steps of ~0.02 per dimension

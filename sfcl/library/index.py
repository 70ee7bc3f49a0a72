"""Nearest-anchor search over a library's unit vectors, on the CPU: the snapshot lookup.

Owns :class:`AnchorIndex`. Built by ``sfcl.snapshot.snapshotter.Snapshotter`` once per library
version (at server start and at each reload) from an ``sfcl.library.store.AnchorLibrary``; the
snapshot lookup calls :meth:`AnchorIndex.search` for the rows whose trigger fired, on the runner's
lookup thread (one torch thread) or on the engine thread. ``sfcl.snapshot.device_search`` mirrors
the dense search on a GPU. The index lives in process memory and is rebuilt at every load: it is
not part of the library format (see "Build" below for what that costs).

Two ways to search, both scoring against the library's stored float16 vectors in float32:

- **dense** (libraries under ``IVF_MIN_ANCHORS`` anchors, and every index built with
  ``approximate=False``): one matmul of the queries against a search copy of all vectors. A
  float32 copy is exact outright; a 16-bit copy (bfloat16 / float16) picks ``max(4k, k + 16)``
  candidates, re-scored in float32 against the stored vectors.
- **ivf** (``approximate=True`` and at least ``IVF_MIN_ANCHORS`` anchors): a faiss
  ``IndexIVFScalarQuantizer`` with float16 cell lists (inverted file over ``nlist`` k-means cells,
  inner product; Jégou et al., "Product quantization for nearest neighbor search", TPAMI 2011,
  section on the inverted file) scans the ``nprobe`` cells nearest to each query and returns the
  top k directly: its lists hold the stored float16 vectors themselves, so its scores are theirs.
  Before 2026-12-04 the lists were float32 (``IndexIVFFlat``) and max(4k, k + 16) candidates were
  re-scored in torch; the same cells give the same top k, and dropping the re-score and half the
  list bytes took a one-row search right after 64 MB of other memory traffic (the cache state
  after a forward) from 0.59 to 0.40 ms p50, 0.22 to 0.10 ms warm (``scripts/lookup_parts.py``,
  AVX-512 BF16 EPYC, docs/benchmarks.md).

The returned scores and their order are exact for the stored vectors (up to float32 summation
order); what the approximate pass can do is miss a true top-k anchor. A row whose result comes back
short (fewer anchors in its cells than asked for) or whose query is not finite is searched exactly
over all anchors instead.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from sfcl.library.store import AnchorLibrary

IVF_MIN_ANCHORS = 4096  # below this a dense scan is about as fast as a cell scan: no index to build
IVF_LIST_SIZE = 32  # anchors per IVF cell on average: nlist = N / IVF_LIST_SIZE
# Cells scanned per query. On real NDA states (``scripts/anchor_search_bench.py --nprobe 24 12 8``,
# 3,135 queries about dev NDAs 53-60, AVX2 EPYC, 2026-12-03; docs/benchmarks.md): recall@3 against
# exact search over 32,768 anchors of NDAs 0-15 0.990 / 0.974 / 0.959, over the 17,069 of the default
# library 0.987 / 0.968 / 0.951; one-row lookup p50 1.44 / 0.79 / 0.65 ms on one thread (32,768; float32
# lists and a re-score then, see the module docstring).
# 12 keeps recall@3 >= 0.95 with margin at about half the time of 24.
IVF_NPROBE = 12
IVF_TRAIN_ITERS = 10  # k-means iterations of the cell centroids
EXACT_CHUNK = 8192  # anchors per float32 block of the exact fallback
_TINY = float(np.finfo(np.float64).tiny)  # the norm floor: only an all-zero query is not scaled to norm 1


def candidates(k: int, n: int) -> int:
    """Candidates re-scored per query for a top-``k`` search over ``n`` anchors."""
    return min(n, max(4 * k, k + 16))


class AnchorIndex:
    """Top-k inner-product (cosine) search over ``lib``'s unit vectors (module docstring).

    dtype: the dense search copy: float32 (N*D*4 bytes; 75.5 MiB for N = 32,768, D = 576),
    bfloat16 (half that) or float16 (the memory-mapped library tensor itself, no copy); the
    default ``fast_float_dtype()`` of the caller picks what this CPU multiplies fastest.
    approximate: use the IVF pass for libraries of at least ``IVF_MIN_ANCHORS`` anchors; the
    index then holds the IVF (N*D*2 bytes of float16 cell lists plus ``nlist`` float32 centroids) and no
    dense copy. nprobe: cells scanned per query (default ``IVF_NPROBE``). Building the IVF trains
    the cell centroids (faiss k-means, seeded: the same library gives the same cells on one
    machine) and takes ``build_s`` seconds. Raises ValueError for another dtype or nprobe < 1.
    """

    def __init__(self, lib: AnchorLibrary, dtype: torch.dtype = torch.float32, approximate: bool = False,
                 nprobe: int | None = None, seed: int = 0):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        if nprobe is not None and nprobe < 1:
            raise ValueError(f"nprobe must be >= 1, got {nprobe}")
        t0 = time.perf_counter()
        self.stored = lib.vectors  # (N, D) float16, memory-mapped: what every score is computed against
        self.n, self.dim = (int(s) for s in self.stored.shape)
        self.dtype = dtype
        self.kind = "ivf" if approximate and self.n >= IVF_MIN_ANCHORS else "dense"
        self.vectors = None  # (N, D) dense search copy (dense kind only)
        self.ivf = None
        if self.kind == "dense":
            self.vectors = self.stored if dtype == torch.float16 else self.stored.to(dtype)
        else:
            self.ivf = _build_ivf(self.stored.float().numpy(), seed)
            self.ivf.nprobe = min(nprobe or IVF_NPROBE, self.ivf.nlist)
        self.build_s = time.perf_counter() - t0

    @property
    def nprobe(self) -> int:
        """Cells scanned per query (0 for a dense index)."""
        return int(self.ivf.nprobe) if self.ivf is not None else 0

    def memory_bytes(self) -> int:
        """Bytes this index holds beyond the library's mapped vectors."""
        if self.ivf is not None:
            return int(self.n * self.dim * 2 + self.ivf.nlist * self.dim * 4 + self.n * 8)
        return 0 if self.vectors is self.stored else self.vectors.numel() * self.vectors.element_size()

    def search(self, queries: torch.Tensor, k: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k anchors by cosine similarity for each query.

        queries: (B, D), any float dtype, any (non-zero) norm; normalised here. Zero queries score
        0. Returns (scores (B, k') float32, ids (B, k') int64), best first, k' = min(k, N).
        Raises ValueError if queries are not 2-D with D = library hidden size, or k < 1.
        """
        if queries.dim() != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"queries must have shape (B, {self.dim}), got {tuple(queries.shape)}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        k = min(k, self.n)
        q = unit_rows(queries)  # (B, D) float32
        if self.kind == "dense":
            if self.dtype == torch.float32:
                return torch.topk(q @ self.vectors.T, k, dim=1)
            _, cand = torch.topk(q.to(self.dtype) @ self.vectors.T, candidates(k, self.n), dim=1)  # (B, c)
            return _rescore(self.stored, q, cand, k)
        qn = q.numpy()  # (B, D) float32, contiguous, shares q's memory
        with _faiss_one_thread():
            s_np, i_np = self.ivf.search(qn, k)  # (B, k) float32 / int64, best first; id -1 where a row ran short
        scores, ids = torch.from_numpy(s_np), torch.from_numpy(i_np)
        short_np = (i_np < 0).any(1) | ~np.isfinite(qn).all(1)  # (B,), numpy: a few us less than torch per lookup
        if short_np.any():
            short = torch.from_numpy(short_np)
            scores[short], ids[short] = _exact(self.stored, q[short], k)
        return scores, ids


def unit_rows(queries: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """queries (B, D), any float dtype -> (B, D) float32 rows of norm 1 on ``device``: the one
    normalisation of every anchor search (this index and ``sfcl.snapshot.device_search``). The
    norm is taken in float64, so neither 1e30 nor 1e-30 over/underflows (in float32 a 1e30 query
    became zero); zero rows stay zero; non-finite rows come out non-finite."""
    q = queries.detach().to(device, torch.float32)
    norm = torch.linalg.vector_norm(q, dim=1, keepdim=True, dtype=torch.float64)  # (B, 1)
    return (q / norm.clamp_min(_TINY)).float()


@contextlib.contextmanager
def _faiss_one_thread():
    """faiss on one OpenMP thread for the calling thread (the cores belong to the engine's forward),
    and torch's intra-op thread count of that thread unchanged.

    Why the second half: faiss's ``omp_set_num_threads`` may bind to the libgomp torch loaded
    (measured here: after ``faiss.omp_set_num_threads(1)`` on a thread, ``torch.get_num_threads()``
    on it was 1). A search on the engine thread (every search with the in-step lookup, the
    default, and every steered one) then left the engine decoding and prefilling on one thread for
    good: served single-stream TPOT 25.5 vs 16.6-22.1 ms and long-document cold TTFT 10.2 vs
    5.6-6.4 s on the AVX-512 BF16 EPYC, ``sfcl-off`` requests included."""
    import faiss

    n = torch.get_num_threads()
    faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


def _rescore(stored: torch.Tensor, q: torch.Tensor, cand: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-score candidates ``cand`` (B, c) int64 in float32 against ``stored`` (N, D) float16 for
    unit queries ``q`` (B, D); returns the k best (scores (B, k) float32, ids (B, k) int64)."""
    exact = torch.bmm(stored[cand].float(), q.unsqueeze(2)).squeeze(2)  # (B, c)
    scores, pos = torch.topk(exact, k, dim=1)
    return scores, torch.gather(cand, 1, pos)


def _exact(stored: torch.Tensor, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k over all anchors in float32 blocks of ``EXACT_CHUNK`` (the fallback)."""
    sims = torch.cat([q @ stored[s : s + EXACT_CHUNK].float().T for s in range(0, stored.shape[0], EXACT_CHUNK)], 1)
    return torch.topk(sims, k, dim=1)  # (B, N) -> (B, k)


def _build_ivf(x: np.ndarray, seed: int):
    """faiss ``IndexIVFScalarQuantizer`` (``QT_fp16``, inner product) over unit rows ``x`` (N, D)
    float32 that are float16 values (the library's stored vectors), nlist = N / ``IVF_LIST_SIZE``
    cells trained by faiss k-means (``IVF_TRAIN_ITERS`` iterations, seeded). The cell lists hold
    the vectors in float16, which is exactly what the library stores, so the scan's inner products
    are the float32 scores of the stored vectors (up to summation order): nothing to re-score."""
    import faiss

    n, d = x.shape
    nlist = max(1, n // IVF_LIST_SIZE)
    quantizer = faiss.IndexFlatIP(d)
    # encode_residual False: the lists hold the vectors themselves, not their offsets from the centroid
    ivf = faiss.IndexIVFScalarQuantizer(quantizer, d, nlist, faiss.ScalarQuantizer.QT_fp16,
                                        faiss.METRIC_INNER_PRODUCT, False)
    ivf.cp.niter, ivf.cp.seed, ivf.cp.spherical = IVF_TRAIN_ITERS, seed, True
    ivf.cp.min_points_per_centroid = 1  # N / nlist = IVF_LIST_SIZE points per cell by design: no warning
    ivf.train(x)
    ivf.add(x)
    return ivf

"""Nearest-anchor search over a library's unit vectors, on the CPU: the snapshot lookup.

Owns :class:`AnchorIndex`. Built by ``sfcl.snapshot.snapshotter.Snapshotter`` once per library
version (at server start and at each reload) from an ``sfcl.library.store.AnchorLibrary``; the
snapshot lookup calls :meth:`AnchorIndex.search` for the rows whose trigger fired, on the engine
thread (or the runner's lookup thread with ``--overlap-lookup``). ``sfcl.snapshot.device_search``
mirrors the dense search on a GPU. The index lives in process memory and is rebuilt at every load:
it is not part of the library format (see "Build" below for what that costs).

Two ways to search, both scoring against the library's stored float16 vectors in float32:

- **dense** (libraries under ``IVF_MIN_ANCHORS`` anchors, and every index built with
  ``approximate=False``): one matmul of the queries against a search copy of all vectors. A
  float32 copy is exact outright; a 16-bit copy (bfloat16 / float16) picks ``candidates(k, N)``
  candidates, re-scored in float32 against the stored vectors.
- **ivf** (``approximate=True`` and at least ``IVF_MIN_ANCHORS`` anchors): an inverted file
  (Jégou et al., "Product quantization for nearest neighbor search", TPAMI 2011, section on the
  inverted file) over ``nlist = N / IVF_LIST_SIZE`` cells (spherical k-means, faiss), with 4-bit
  codes (``sq4_rows``: per-dimension ranges, two codes per byte) of the cell centroids and of the
  anchors' residuals from their cell's centroid (as faiss's IndexIVFScalarQuantizer with
  ``by_residual``), cell by cell; from
  ``GROUPED_MIN_CELLS`` cells on, the cells are grouped by a second k-means over their centroids
  (~sqrt(nlist) groups, their centroids as int8 codes, ``int8_rows``; the two-level tree of Muja &
  Lowe, "Scalable nearest neighbor algorithms for high dimensional data", TPAMI 2014). A query scores
  the groups' centroids (its int8 codes against theirs), then the centroids of the
  ``IVF_GROUP_PROBE`` best groups' cells (every centroid when ungrouped; the rows of one call share
  the reads: each group some row chose has its cells' codes read once for all of them), scans the
  ``nprobe`` best cells' codes, keeps ``candidates(k, N)`` (12 for k = 3) and re-scores them in
  float32 against the stored float16 vectors, so the returned scores are the stored vectors' own.
  Against 4-bit codes the query is the int8 codes q8 (scale s) of its product with the codes'
  per-dimension steps (``sq4_query``): with x ~ lo + code * step, q . x = q . lo + s sum_d q8_d
  code_d, and q . lo is the same for every row of a query, so the integer sums (exact) rank the
  centroids; an anchor in cell c, x = c + r, scores q . c (the centroid's float16 vector, float32
  sums) + s sum_d q8_d code(r)_d. Residuals span a narrower range than the vectors, so their 4-bit steps are finer:
  recall@3 on the 32,731 anchors of the 61 dev NDAs was 0.971 with 4-bit codes of the vectors
  against 0.983 with int8 codes (``scripts/anchor_search_bench.py``, 2026-12-05). The kernel module's
  ``anchor_search`` / ``AnchorLookup`` (``sfcl/model/csrc/anchor_search.cpp``, one call, one
  thread, the GIL held) runs these steps when SFCL's native kernels are built
  (``sfcl.model.decode_kernel.load``), and also computes the found anchors' snapshot confidences;
  :func:`ivf_search_torch` is the same steps in torch operators, used without them. Why codes,
  groups and one call: a served lookup follows a decode step's forward, which has evicted the
  caches, and the search's time was memory traffic (float32 centroids and float16 lists, ~1 MB
  per query; int8 codes of every centroid, 0.6 MB for 32,768 anchors, before the groups; 4-bit codes
  since the twentieth session: a lookup of several rows after a decode step cost ~0.045 ms per row
  for ~0.4 MB of int8 codes) and
  Python-level operations at tens of microseconds each (docs/performance-journal.md, twelfth and
  fifteenth sessions; creating three small tensors cost ~0.05 ms, so ``search_lists``, the served
  lookup's call, returns Python lists). Why the GIL held: a torch operator releases it, and taking
  it back from the server's busy event loop thread could cost up to the interpreter's 5 ms switch
  interval (thirteenth session).

The returned scores and their order are exact for the stored vectors (up to float32 summation
order); what the approximate pass can do is miss a true top-k anchor (a cell not scanned, or an
anchor whose 4-bit score fell outside the candidates). A row whose scanned cells hold fewer than k
anchors, or whose query is not finite, is searched exactly over all anchors instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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
# 12 keeps recall@3 >= 0.95 with margin at about half the time of 24. With the int8 pass (2026-12-05,
# AVX-512 BF16 EPYC, 1,314 states of 3 NDAs): nprobe 12 / 8 0.9706 / 0.9515 on the default library,
# 0.9853 / 0.9762 on the 32,731 anchors of all 61 dev NDAs; 12 and 8 now differ by ~10% in time.
# With the query quantised too and the groups (2026-12-05, Intel Xeon AMX, same states): nprobe 12 /
# 8 0.9678 / 0.9521 on the default library, 0.9741 (12) on the 61 NDAs' anchors. With 4-bit codes of
# the centroids and of the residuals (twentieth session, same machine and states): nprobe 12 / 16
# 0.9670 / 0.9769 on the default library (int8 codes in the same run: 0.9696 at 12), 0.9754 / 0.9795
# on the 61 NDAs' 32,731 anchors (int8: 0.9825 at 12).
IVF_NPROBE = 12
IVF_TRAIN_ITERS = 10  # k-means iterations of the cell centroids
# Groups of cells (a second k-means level over the cell centroids, ~sqrt(nlist) groups): a query
# ranks only the centroids of its IVF_GROUP_PROBE best groups. GROUPED_MIN_CELLS: fewer cells are
# all ranked (the groups would save little). recall@3 at nprobe 12 (``scripts/anchor_search_bench.py
# --group-probe 4 6 8 12 99``, same states, Intel Xeon AMX): 32,731 anchors in 1,022 cells and 32
# groups 0.9546 / 0.9685 / 0.9741 / 0.9797 / 0.9817 (all groups); default library (533 cells, 23
# groups) 0.9670 (6) / 0.9678 (8) / 0.9696 (all). 8 keeps the margin; below it the time barely moves.
IVF_GROUP_PROBE = 8
GROUPED_MIN_CELLS = 256
EXACT_CHUNK = 8192  # anchors per float32 block of the exact fallback
IVF_MAX_K = 64  # above this many anchors per query the IVF pass saves nothing: exact search
SQ4_BLOCK = 64  # dimensions per block of packed 4-bit codes (sq4_rows); D is padded to a multiple of it
# Quantiles that bound each dimension's 4-bit range (sq4_rows). recall@3 of the IVF pass against
# exact search (1,314 NDA answer and prompt states, default library, a scratch study with float
# queries, 2026-12-05 Intel Xeon AMX): int8 codes 0.9708; 4-bit codes of the vectors with full
# ranges 0.9518, clipped to the 0.1% / 99.9% quantiles 0.9609, to the 1% / 99% ones 0.9675 (the
# centroids' clip, SQ4_CLIP). Of the residuals (SQ4_RESIDUAL_CLIP) 0.9708 / 0.9693 / 0.9701 clipped
# at 0.1 / 0.3 / 1%, and on the 32,731 anchors of the 61 NDAs 0.9881 / 0.9883 / 0.9883 (int8: 0.9886;
# 4-bit codes of the vectors: 0.9805).
SQ4_CLIP = 0.01
SQ4_RESIDUAL_CLIP = 0.001
SQ4_QUANTILE_ROWS = 16384  # rows (a strided sample) whose quantiles set the ranges
TORCH_PASS_ROWS = 8  # queries per chunk of ivf_search_torch (its float32 copy of the scanned codes)
_TINY = float(np.finfo(np.float64).tiny)  # the norm floor: only an all-zero query is not scaled to norm 1


def candidates(k: int, n: int) -> int:
    """Candidates re-scored per query for a top-``k`` search over ``n`` anchors: 12 for the
    snapshot's top 3. Each is a random read of a stored float16 row after the approximate pass;
    against 19 (``k + 16``, before the twenty-first session) recall@3 on real NDA states read 0.9635
    against 0.9647 (default library) and 0.9739 against 0.9751 (61 NDAs), and a lookup of one / five
    rows after a decode step's memory traffic 5-9% less time (docs/benchmarks.md)."""
    return min(n, max(4 * k, k + 9))


@dataclass(frozen=True)
class IvfCells:
    """The inverted file of an ``ivf`` :class:`AnchorIndex` (module docstring), C cells over N anchors.

    centroids (C, Dp / 2) uint8 and centroid_step (Dp,) float32: the cells' unit centroids as 4-bit
    codes (``sq4_rows``; Dp = D rounded up to a multiple of 64) and each dimension's step;
    centroid_vectors (C, D) float16: the same centroids; offsets (C + 1,) int64: cell c's anchors
    are members[offsets[c]:offsets[c + 1]] (members (N,) int32 anchor ids, cell by cell); codes
    (N, Dp / 2) uint8 and code_step (Dp,) float32: those anchors' residuals from their cell's
    centroid_vectors row, in the same order, as 4-bit codes and steps. group_centroids (G, D) int8,
    group_scale (G,) float32 and group_offsets (G + 1,) int64: cells grouped by the nearest of G
    unit centroids of the cell centroids, group g holding cells group_offsets[g]:group_offsets[g + 1]
    (cells are numbered group by group); None below ``GROUPED_MIN_CELLS`` cells."""

    centroids: torch.Tensor
    centroid_step: torch.Tensor
    centroid_vectors: torch.Tensor
    offsets: torch.Tensor
    members: torch.Tensor
    codes: torch.Tensor
    code_step: torch.Tensor
    group_centroids: torch.Tensor | None = None
    group_scale: torch.Tensor | None = None
    group_offsets: torch.Tensor | None = None

    @property
    def nlist(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def ngroups(self) -> int:
        return 0 if self.group_centroids is None else int(self.group_centroids.shape[0])

    def groups(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(group_centroids, group_scale, group_offsets): the native pass's group arguments."""
        return self.group_centroids, self.group_scale, self.group_offsets

    def arrays(self) -> tuple[torch.Tensor, ...]:
        """(centroids, centroid_step, centroid_vectors, offsets, members, codes, code_step): the
        native pass's cell arguments, in its order."""
        return (self.centroids, self.centroid_step, self.centroid_vectors, self.offsets, self.members, self.codes,
                self.code_step)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.arrays(), *self.groups()) if t is not None)


class AnchorIndex:
    """Top-k inner-product (cosine) search over ``lib``'s unit vectors (module docstring).

    dtype: the dense search copy: float32 (N*D*4 bytes; 75.5 MiB for N = 32,768, D = 576),
    bfloat16 (half that) or float16 (the memory-mapped library tensor itself, no copy); the
    default ``fast_float_dtype()`` of the caller picks what this CPU multiplies fastest.
    approximate: use the IVF pass for libraries of at least ``IVF_MIN_ANCHORS`` anchors; the
    index then holds its :class:`IvfCells` (about N*D/2 bytes of 4-bit codes; 4.7 MiB for the
    17,069 anchors of the default library) and no dense copy. nprobe: cells scanned per query (default
    ``IVF_NPROBE``); list_size: anchors per cell on average (default ``IVF_LIST_SIZE``). native:
    run the IVF pass with the kernel module's ``anchor_search`` when SFCL's native kernels load (None
    or True; they are built first if this machine kind has no build, and ``self.native`` says
    whether they loaded), or (False) always with the torch operators of ``ivf_search_torch``.
    A search for more than ``IVF_MAX_K`` anchors per query is exact.
    Building the IVF trains the cell centroids (faiss k-means, seeded: the same library gives the
    same cells on one machine) and takes ``build_s`` seconds. Recall depends on the library's
    shape: cells are chosen by their centroids, so a library of a few dense blobs loses more than
    one of many clusters (0.97-0.99 recall@3 on real NDA libraries, ``scripts/anchor_search_bench.py``).
    Raises ValueError for another dtype, nprobe < 1 or list_size < 1.
    """

    def __init__(self, lib: AnchorLibrary, dtype: torch.dtype = torch.float32, approximate: bool = False,
                 nprobe: int | None = None, seed: int = 0, native: bool | None = None, list_size: int | None = None,
                 group_probe: int | None = None):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        if nprobe is not None and nprobe < 1:
            raise ValueError(f"nprobe must be >= 1, got {nprobe}")
        if list_size is not None and list_size < 1:
            raise ValueError(f"list_size must be >= 1, got {list_size}")
        if group_probe is not None and group_probe < 1:
            raise ValueError(f"group_probe must be >= 1, got {group_probe}")
        t0 = time.perf_counter()
        self.stored = lib.vectors  # (N, D) float16, memory-mapped: what every score is computed against
        self.n, self.dim = (int(s) for s in self.stored.shape)
        self.dtype = dtype
        self.kind = "ivf" if approximate and self.n >= IVF_MIN_ANCHORS else "dense"
        self.vectors = None  # (N, D) dense search copy (dense kind only)
        self.cells: IvfCells | None = None
        self.native = False  # whether the IVF pass runs natively (the kernel module's anchor_search)
        self._native_search = self._native_lookup = None
        self._lookup_args: tuple | None = None  # search_lists' (k, weights, decay, bound AnchorLookup)
        self._nprobe = self._group_probe = 0
        if self.kind == "dense":
            self.vectors = self.stored if dtype == torch.float16 else self.stored.to(dtype)
        else:
            if not (self.stored.dtype == torch.float16 and self.stored.is_contiguous()):
                self.stored = self.stored.to(torch.float16).contiguous()
            self.cells = build_cells(self.stored.float().numpy(), seed, list_size or IVF_LIST_SIZE)
            self._nprobe = min(nprobe or IVF_NPROBE, self.cells.nlist)
            self._group_probe = min(group_probe or IVF_GROUP_PROBE, self.cells.ngroups)  # 0: no groups
            if native is not False:
                from sfcl.model import decode_kernel  # the one native library (built once per machine kind)

                if decode_kernel.load():
                    self._native_search = decode_kernel.module().anchor_search
                    self._native_lookup = decode_kernel.module().AnchorLookup
                self.native = self._native_search is not None
        self.build_s = time.perf_counter() - t0

    @property
    def nprobe(self) -> int:
        """Cells scanned per query (0 for a dense index)."""
        return self._nprobe

    @property
    def group_probe(self) -> int:
        """Groups of cells whose centroids a query ranks (0: no groups, every centroid is ranked)."""
        return self._group_probe

    def memory_bytes(self) -> int:
        """Bytes this index holds beyond the library's mapped vectors."""
        if self.cells is not None:
            return self.cells.nbytes()
        return 0 if self.vectors is self.stored else self.vectors.numel() * self.vectors.element_size()

    def search(self, queries: torch.Tensor, k: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k anchors by cosine similarity for each query.

        queries: (B, D), any float dtype, any (non-zero) norm; normalised here. Zero queries score
        0. Returns (scores (B, k') float32, ids (B, k') int64), best first, k' = min(k, N).
        Raises ValueError if queries are not 2-D with D = library hidden size, or k < 1.
        """
        scores, ids, _ = self.search_confidence(queries, k)
        return scores, ids

    def search_lists(self, query: torch.Tensor, k: int, weights: torch.Tensor,
                     decay: torch.Tensor) -> tuple[list[list[float]], list[list[int]], list[list[float]]] | None:
        """The served lookup's call: :meth:`search_confidence` of ``query`` (B, D) float32 contiguous
        as Python lists (scores, anchor ids, confidences; B lists of k), from one native call that
        creates no tensor; None where that call does not apply (no native IVF pass, another dtype or
        layout, ``k`` above ``IVF_MAX_K`` or the library size, or a row needing the exact fallback):
        the caller then uses :meth:`search_confidence`.

        The call's arguments other than the query are bound (converted and checked) once per (k,
        weights, decay) in the kernel module's ``AnchorLookup``, and the query's dtype and layout
        are left to the native pass to check: right after a decode step each Python-level operation
        here costs microseconds (twenty-first session), and converting the 16 other arguments on
        each call ~15-20 us (twenty-fifth session)."""
        bound = self._lookup_args
        if bound is None or bound[0] != k or bound[1] is not weights or bound[2] is not decay:
            if self._native_lookup is None or not 1 <= k <= min(self.n, IVF_MAX_K):
                return None
            c = self.cells
            bound = self._lookup_args = (k, weights, decay, self._native_lookup(
                self.stored, *c.arrays(), self._nprobe, k, candidates(k, self.n), weights, decay, *c.groups(),
                self._group_probe))
        try:
            s_l, i_l, c_l, short = bound[3](query)
        except RuntimeError:  # not a contiguous (B, D) float32 query: the tensor path converts it
            return None
        return None if short else (s_l, i_l, c_l)

    def search_confidence(self, queries: torch.Tensor, k: int = 3, weights: torch.Tensor | None = None,
                          decay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`search`, and with ``weights`` and ``decay`` ((N,) float32 contiguous, per anchor)
        the found anchors' snapshot confidences (B, k') float32 as the native pass computes them
        (``sfcl.snapshot.triggers.anchor_confidence_each``) when it ran and no row needed the exact
        fallback; else None (the caller computes them). Same errors as :meth:`search`."""
        if queries.dim() != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"queries must have shape (B, {self.dim}), got {tuple(queries.shape)}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        k = min(k, self.n)
        if self.kind == "dense" or k > IVF_MAX_K:
            q = unit_rows(queries)  # (B, D) float32
            if self.kind == "ivf":
                return *_exact(self.stored, q, k), None
            if self.dtype == torch.float32:
                return *torch.topk(q @ self.vectors.T, k, dim=1), None
            _, cand = torch.topk(q.to(self.dtype) @ self.vectors.T, candidates(k, self.n), dim=1)  # (B, c)
            return *_rescore(self.stored, q, cand, k), None
        q = queries  # (B, D) float32, contiguous; normalised by the pass (float64 norm)
        if q.dtype is not torch.float32 or q.requires_grad or not q.is_contiguous():  # the usual query is all three
            q = q.detach().to(torch.float32).contiguous()
        c = self.cells
        conf = None
        if self._native_search is not None:  # keeps the GIL (bindings.cpp)
            scores, ids, conf = self._native_search(q, self.stored, *c.arrays(), self._nprobe, k,
                                                    candidates(k, self.n), weights, decay, *c.groups(),
                                                    self._group_probe)
            if weights is None:
                conf = None
        else:
            scores, ids = ivf_search_torch(c, self.stored, q, self._nprobe, k, candidates(k, self.n),
                                           self._group_probe)
        i_np = ids.numpy()
        if i_np.size and i_np.min() < 0:  # short or non-finite rows: exact over all anchors
            short = torch.from_numpy((i_np < 0).any(1))
            scores[short], ids[short] = _exact(self.stored, unit_rows(q[short]), k)
            conf = None
        return scores, ids, conf


def build_cells(x: np.ndarray, seed: int, list_size: int = IVF_LIST_SIZE) -> IvfCells:
    """The inverted file over unit rows ``x`` (N, D) float32 (the library's stored float16 vectors):
    nlist = N / ``list_size`` cells trained by faiss spherical k-means (``IVF_TRAIN_ITERS``
    iterations, seeded), each anchor in the cell of its nearest centroid."""
    import faiss

    n, d = x.shape
    nlist = max(1, n // list_size)
    km = faiss.Kmeans(d, nlist, niter=IVF_TRAIN_ITERS, seed=seed, spherical=True,
                      min_points_per_centroid=1,  # N / nlist = IVF_LIST_SIZE points per cell by design: no warning
                      verbose=False)
    km.train(x)
    cent = torch.from_numpy(km.centroids).float()  # (C, D) unit rows
    group = None
    if nlist >= GROUPED_MIN_CELLS:  # the second level: cells grouped by k-means over their centroids
        ng = max(2, round(nlist ** 0.5))
        gkm = faiss.Kmeans(d, ng, niter=IVF_TRAIN_ITERS, seed=seed, spherical=True, min_points_per_centroid=1,
                           verbose=False)
        gkm.train(km.centroids)
        gcent = torch.from_numpy(gkm.centroids).float()  # (G, D) unit rows
        gof = torch.argmax(cent @ gcent.T, dim=1)  # (C,) group of each cell
        cell_order = torch.argsort(gof, stable=True)  # cells renumbered group by group
        cent = cent[cell_order]
        gof = gof[cell_order]
        group_offsets = torch.zeros(ng + 1, dtype=torch.int64)
        group_offsets[1:] = torch.cumsum(torch.bincount(gof, minlength=ng), 0)
        group = (*int8_rows(gcent), group_offsets)
    xt = torch.from_numpy(x)
    assign = torch.cat([torch.argmax(xt[s:s + EXACT_CHUNK] @ cent.T, dim=1)
                        for s in range(0, n, EXACT_CHUNK)])  # (N,) nearest centroid by inner product
    order = torch.argsort(assign, stable=True)
    offsets = torch.zeros(nlist + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.bincount(assign, minlength=nlist), 0)
    centroids, centroid_step = sq4_rows(cent)
    cent16 = cent.half().contiguous()  # (C, D): q . c of a probed cell is taken against these
    codes, code_step = sq4_rows(xt[order] - cent16[assign[order]].float(), SQ4_RESIDUAL_CLIP)
    return IvfCells(centroids, centroid_step, cent16, offsets, order.to(torch.int32).contiguous(), codes, code_step,
                    *(group or (None, None, None)))


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of each row of ``x`` (n, D) float: codes (n, D) int8 and scale (n,)
    float32 with x ~ codes * scale (scale = max |x| / 127 per row; a zero row has codes 0)."""
    scale = (x.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny).float()
    return torch.round(x / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), scale.contiguous()


def sq4_rows(x: torch.Tensor, clip: float = SQ4_CLIP) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit codes of the rows of ``x`` (n, D) float with one range per dimension (scalar
    quantisation as faiss's ``QT_4bit``, the range clipped to the ``clip`` and ``1 - clip`` quantiles
    of the dimension over at most ``SQ4_QUANTILE_ROWS`` rows: a few outlying values would otherwise
    widen every step). Returns packed codes
    (n, Dp / 2) uint8 and step (Dp,) float32, Dp = D rounded up to a multiple of 64, with
    x[:, d] ~ lo[d] + code[:, d] * step[d] (code in 0..15, ``lo`` not kept: a query's q . lo is the
    same for every row, see the module docstring); the padded dimensions have step 0 and code 0.
    Packing: the 64 dimensions of block w take bytes 32 w to 32 w + 31 of a row, byte j holding
    dimension 64 w + j in its low nibble and 64 w + 32 + j in its high nibble (``sq4_unpack``)."""
    n, d = x.shape
    dp = -(-d // SQ4_BLOCK) * SQ4_BLOCK
    xf = x.detach().float()
    # the ranges from at most SQ4_QUANTILE_ROWS rows (every k-th), in one numpy call over a transposed
    # copy (0.4 s for the 32,731 anchors of the 61 NDAs; two calls over the rows 0.9 s; torch.quantile
    # stops at 2**24 values); the codes in torch (numpy took 0.9 s more for them)
    sample = xf[:: max(1, -(-n // SQ4_QUANTILE_ROWS))].T.contiguous().numpy() if n else np.zeros((d, 1), np.float32)
    lo, hi = (torch.from_numpy(v).float() for v in np.quantile(sample, [clip, 1 - clip], axis=1))  # (D,) each
    step = torch.zeros(dp)
    step[:d] = (hi - lo) / 15
    inv = torch.where(step[:d] > 0, 1 / step[:d].clamp_min(torch.finfo(torch.float32).tiny), 0)
    codes = torch.zeros(n, dp, dtype=torch.uint8)
    codes[:, :d] = torch.round((xf - lo) * inv).clamp_(0, 15).to(torch.uint8)
    blocks = codes.view(n, dp // SQ4_BLOCK, 2, SQ4_BLOCK // 2)  # (n, W, low / high half, 32)
    packed = blocks[:, :, 0] | (blocks[:, :, 1] << 4)  # (n, W, 32)
    return packed.reshape(n, dp // 2).contiguous(), step


def sq4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """The codes (n, Dp) uint8 (0..15) of ``sq4_rows``'s packed rows (n, Dp / 2) uint8."""
    n, half = packed.shape
    p = packed.view(n, half * 2 // SQ4_BLOCK, SQ4_BLOCK // 2)  # (n, W, 32)
    return torch.cat([p & 15, p >> 4], dim=2).reshape(n, half * 2)


def sq4_query(qn: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 codes (B, Dp) and scale (B,) float32 of unit queries ``qn`` (B, D) float32 times the
    4-bit codes' per-dimension ``step`` (Dp,) (zero-padded to Dp), as ``int8_rows`` quantises them:
    scale times the integer dot product of these codes with a row's 4-bit codes is q . x up to
    q . lo, the same for every row (module docstring)."""
    q = torch.zeros(qn.shape[0], step.shape[0])
    q[:, : qn.shape[1]] = qn
    return int8_rows(q * step)


def ivf_search_torch(cells: IvfCells, stored: torch.Tensor, q: torch.Tensor, nprobe: int, k: int,
                     n_candidates: int, group_probe: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The IVF pass of the native ``anchor_search`` in torch operators (the search without
    SFCL's native kernels): same inputs (``cells``, ``stored`` (N, D) float16, queries ``q`` (B, D)
    float32), same steps, same results up to float32 summation order. Returns (scores (B, k)
    float32, ids (B, k) int64), best first; -inf / -1 in rows that are short or not finite.
    Queries go ``TORCH_PASS_ROWS`` at a time: the pass holds a float32 copy of the codes it scans
    (a 12-cell scan of the default library ~0.9 MB per query, but a cell of 8,000 duplicates 18 MB)."""
    if q.shape[0] > TORCH_PASS_ROWS:
        parts = [_ivf_torch_rows(cells, stored, q[i:i + TORCH_PASS_ROWS], nprobe, k, n_candidates, group_probe)
                 for i in range(0, q.shape[0], TORCH_PASS_ROWS)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return _ivf_torch_rows(cells, stored, q, nprobe, k, n_candidates, group_probe)


def _ivf_torch_rows(cells: IvfCells, stored: torch.Tensor, q: torch.Tensor, nprobe: int, k: int,
                    n_candidates: int, group_probe: int) -> tuple[torch.Tensor, torch.Tensor]:
    qn = unit_rows(q)  # (B, D)
    B = q.shape[0]
    if B == 0:
        return torch.full((0, k), float("-inf")), torch.full((0, k), -1, dtype=torch.int64)
    qf = torch.nan_to_num(qn)
    # integer products and sums below 2**24 (D <= 1,040 for int8 x int8, Dp <= 8,808 for int8 x 4-bit):
    # exact in float32, as the native int32 sums
    qc = sq4_query(qf, cells.centroid_step)[0].float()  # (B, Dp) against the centroids' 4-bit codes
    cs = qc @ sq4_unpack(cells.centroids).float().T  # (B, C)
    if group_probe and cells.group_centroids is not None:  # rank only the cells of the best groups
        q8, qs = int8_rows(qf)  # (B, D) int8 codes of the query, (B,) scale
        gs = (q8.float() @ cells.group_centroids.float().T) * (cells.group_scale[None, :] * qs[:, None])  # (B, G)
        best = torch.topk(gs, min(group_probe, cells.ngroups), dim=1).indices  # (B, gp)
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, best, True)  # (B, G)
        group_of = torch.repeat_interleave(torch.arange(cells.ngroups), cells.group_offsets.diff())  # (C,)
        cs = cs.masked_fill(~keep[:, group_of], float("-inf"))
    probe_s, probe = _top(cs, min(nprobe, cells.nlist))  # (B, P)
    start = cells.offsets[probe].reshape(-1)  # (B * P,) each probed cell's first row of codes
    # a cell outside the row's groups (when they hold fewer than nprobe cells) is not scanned
    size = (cells.offsets[probe + 1].reshape(-1) - start) * (probe_s.reshape(-1) > float("-inf"))
    per_row = size.view(B, -1).sum(1)  # (B,) anchors scanned per query
    width = int(per_row.max())
    if width < k:  # every row short
        return torch.full((B, k), float("-inf")), torch.full((B, k), -1, dtype=torch.int64)
    total = int(per_row.sum())
    first = torch.cumsum(size, 0) - size  # (B * P,) where each cell's run starts in the flat scan
    rows = torch.repeat_interleave(start - first, size) + torch.arange(total)  # (total,) rows of codes
    row_of = torch.repeat_interleave(torch.arange(B), per_row)  # (total,) query of each scanned anchor
    qa, sa = sq4_query(qf, cells.code_step)  # (B, Dp) against the residuals' 4-bit codes, (B,) scale
    cell_s = torch.gather(qf @ cells.centroid_vectors.float().T, 1, probe).reshape(-1)  # (B * P,) q . c
    resid = (sq4_unpack(cells.codes[rows]).float() * qa.float()[row_of]).sum(1)  # (total,) integer sums
    approx = torch.repeat_interleave(cell_s, size) + sa[row_of] * resid  # (total,)
    col = torch.arange(total) - torch.repeat_interleave(torch.cumsum(per_row, 0) - per_row, per_row)
    grid = torch.full((B, width), float("-inf"))  # (B, W) each query's scanned anchors, -inf padded
    grid[row_of, col] = approx
    where = torch.zeros(B, width, dtype=torch.int64)
    where[row_of, col] = rows
    top_s, top = _top(grid, min(n_candidates, width))
    cand = cells.members[torch.gather(where, 1, top)].long()  # (B, c) anchor ids
    exact = torch.bmm(stored[cand].float(), qn[:, :, None])[..., 0].masked_fill(top_s == float("-inf"), float("-inf"))
    scores, pos = torch.topk(exact, k, dim=1)
    ids = torch.gather(cand, 1, pos)
    short = (per_row < k) | ~torch.isfinite(qn).all(1)
    scores[short], ids[short] = float("-inf"), -1
    return scores, ids


def _top(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest of each row of ``x`` (B, W) and their columns, ties to the lower column (the
    native pass's rule: integer scores tie, and ``torch.topk`` does not say which tie it keeps)."""
    s, i = torch.sort(x, dim=1, descending=True, stable=True)
    return s[:, :n], i[:, :n]


def unit_rows(queries: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """queries (B, D), any float dtype -> (B, D) float32 rows of norm 1 on ``device``: the one
    normalisation of every anchor search (this index and ``sfcl.snapshot.device_search``). The
    norm is taken in float64, so neither 1e30 nor 1e-30 over/underflows (in float32 a 1e30 query
    became zero); zero rows stay zero; non-finite rows come out non-finite."""
    q = queries.detach().to(device, torch.float32)
    norm = torch.linalg.vector_norm(q, dim=1, keepdim=True, dtype=torch.float64)  # (B, 1)
    return (q / norm.clamp_min(_TINY)).float()


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

"""KV cache storage: one contiguous row ("slot") of ``max_len`` positions per running sequence, a
prefix-cache pool of fixed-size blocks, and an optional block-wise INT8 format.

Who owns what: the scheduler (torch-free) decides which slot a request uses, when rows move
(compaction keeps decoding sequences in slots [0, n) so that decode attends to plain views, no
gather), and which prefix-cache blocks are restored or saved (``sfcl.engine.block_manager``);
this module holds the tensors and performs what the scheduler planned. Data lives on the model's
device. Row ``n_slots`` is a scratch row for swaps.

Memory that follows the tokens held (CPU): every tensor is a private anonymous memory map
(``mmap``), so the OS hands out a zeroed page the first time a position on it is written and a
large ``max_len`` or pool costs address space only. When a sequence leaves its row (finished,
aborted, or moved away by compaction) the scheduler lists the row in ``SchedulerOutput.release``
and ``release`` returns its pages to the OS (``madvise(MADV_DONTNEED)``); they read as zeros
afterwards (except the first ``keep_positions``, see ``KEEP_POSITIONS``). Resident KV memory is
therefore the tokens actually held, rounded up per (layer, row, head) to whole pages (4 KiB = 16
fp32 or 32 bf16 positions of a 64-wide head), instead of every row's longest past sequence.
Transparent huge pages are turned off for these maps (``MADV_NOHUGEPAGE``): a 2 MiB page per head
would hold 8,192 positions after one write. Why rows and not blocks with a block table (vLLM's
PagedAttention): decode attends to plain strided views of rows [0, B) with no gather (see
``sfcl.model.llama.Attention.decode_attn``), and with pages given back on release a row costs no
more memory than the blocks it would hold (``python scripts/profile_kv_memory.py --keep-positions
0``: 16 rows x 150 fp32 tokens = 105 MiB of KV, 117 MiB resident after writing, 6 MiB after
release). On other devices (CUDA) tensors come from ``torch.empty``, are never released, and rows
are zeroed ahead of reads (``ensure_initialized``).

INT8 (``kv_dtype="int8"``), following KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache"): keys are quantized **per channel** within each block of
``block_size`` positions (key channels carry persistent outliers, so a per-token scale would be
set by the outlier channel and crush the others), values **per token** (values have no channel
outliers; their error is averaged by the attention weights). Symmetric absmax scaling to
[-127, 127], scales stored in bfloat16 (fp32 exponent range; each value is quantized with the
already-rounded scale, so the rounding costs nothing). The keys of a block still being filled are
kept in full precision (a per-slot residual, as in KIVI) and the block is re-quantized from it on
each write, so no value is ever quantized twice. Attention dequantizes the attended range to the
compute dtype. Bytes per token and head (hd = 64, block 16): keys 64 + 8 (scales), values 64 + 2
= 138 vs 256 in bf16 (0.54x).
"""

from __future__ import annotations

import mmap

import torch

from sfcl.model.llama import LlamaArgs

KV_DTYPES = ("auto", "int8")
ZERO_AHEAD = 256  # positions zeroed at once past a row's written range (see KVCache.ensure_initialized)
# Positions of a row that ``release`` keeps resident for the row's next sequence. A page costs a
# fault when first written and a free when released: ``python scripts/profile_kv_memory.py`` on the
# 2-core AVX2 EPYC (a firecracker VM, load average 10-19 from other jobs) measured 190-550 us per
# fp32 token of SmolLM2-135M for the faults (11 pages a token) and 45-127 ms per released row, a few
# percent of what prefilling that token costs there. Keeping the first 256 positions spares the short
# chats that make up most requests that round trip; a row keeps at most 11 MiB (fp32) after release.
KEEP_POSITIONS = 256
# Runs of consecutive pool ids up to which a prefix-cache save or restore copies run by run (one
# strided copy per run and tensor: 2 x n_layers copies per run); past it, one gather per tensor.
MAX_COPY_RUNS = 8


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A zero-filled CPU tensor on its own private anonymous memory map (pages materialise on first
    write), and the map (None for an empty tensor). The tensor keeps the map alive."""
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype), None
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(m, dtype=dtype, count=n).view(shape), m


class KVCache:
    """Per layer l, for ``kv_dtype="auto"`` (the model dtype): k[l], v[l] (R, nkv, max_len, hd);
    for ``"int8"``: k[l], v[l] int8 of that shape plus k_scale[l] (R, nkv, max_len/bs, hd) and
    v_scale[l] (R, nkv, max_len) in bfloat16, and k_res[l] (R, nkv, bs, hd) full-precision keys of
    each row's block in progress. R = n_slots + 1 (scratch row). The prefix-cache pool mirrors one
    block of every tensor per pool block: pool_k[l] (P, nkv, bs, hd), ...

    lazy_pages: None (default) = True on the CPU: storage on anonymous memory maps whose pages are
    touched as positions are written and given back by ``release`` (module docstring); False:
    ``torch.empty`` storage, zeroed ahead of reads by ``ensure_initialized`` (other devices).
    keep_positions: positions of a row that ``release`` leaves resident.

    Raises ValueError for an unknown kv_dtype, sizes < 1, or lazy_pages on a non-CPU device.
    """

    def __init__(self, args: LlamaArgs, n_slots: int, max_len: int, dtype: torch.dtype, device: str = "cpu",
                 kv_dtype: str = "auto", block_size: int = 16, pool_blocks: int = 0, lazy_pages: bool | None = None,
                 keep_positions: int = KEEP_POSITIONS):
        if n_slots < 1 or max_len < 1 or block_size < 1 or pool_blocks < 0 or keep_positions < 0:
            raise ValueError("n_slots, max_len and block_size must be >= 1, pool_blocks and keep_positions >= 0")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, not {kv_dtype!r}")
        bs = block_size
        max_len = -(-max_len // bs) * bs  # whole blocks
        R, nkv, hd, L = n_slots + 1, args.n_kv_heads, args.head_dim, args.n_layers
        self.n_slots, self.max_len, self.block_size, self.dtype, self.kv_dtype = n_slots, max_len, bs, dtype, kv_dtype
        self.int8 = kv_dtype == "int8"
        sd = dtype if not self.int8 else torch.int8
        cpu = torch.device(device).type == "cpu"
        if lazy_pages and not cpu:
            raise ValueError(f"lazy_pages needs a CPU KV cache, not {device}")
        self.lazy_pages = cpu if lazy_pages is None else bool(lazy_pages)
        # row tensors (R, nkv, P, ...) on lazy pages, their maps, and positions per index of axis 2
        self._maps: list[tuple[torch.Tensor, mmap.mmap, int]] = []
        self.keep_positions = keep_positions

        def alloc(shape, dt, per_index: int = 0):  # per_index 0: not a row tensor (never released)
            if not self.lazy_pages:
                return [torch.empty(shape, dtype=dt, device=device) for _ in range(L)]
            out = []
            for _ in range(L):
                t, m = _lazy_zeros(shape, dt)
                if per_index and m is not None:
                    self._maps.append((t, m, per_index))
                out.append(t)
            return out

        self.k = alloc((R, nkv, max_len, hd), sd, 1)
        self.v = alloc((R, nkv, max_len, hd), sd, 1)
        self.pool_k = alloc((pool_blocks, nkv, bs, hd), sd)
        self.pool_v = alloc((pool_blocks, nkv, bs, hd), sd)
        if self.int8:
            self.k_scale = alloc((R, nkv, max_len // bs, hd), torch.bfloat16, bs)
            self.v_scale = alloc((R, nkv, max_len), torch.bfloat16, 1)
            self.k_res = [torch.zeros((R, nkv, bs, hd), dtype=dtype, device=device) for _ in range(L)]  # small
            self.pool_ks = alloc((pool_blocks, nkv, hd), torch.bfloat16)
            self.pool_vs = alloc((pool_blocks, nkv, bs), torch.bfloat16)
        self.pool_blocks = pool_blocks
        # Decode attention through sfcl's fused kernel (``sfcl.model.decode_kernel``): set by the
        # engine once the kernel is loaded and ``decode_kernel.supports`` this cache; False: torch ops.
        self.fused_decode = False
        # The decoder layers of decode-only steps in one C++ call (``sfcl.model.decode_stack``, same
        # library as the attention kernel): set by the engine with fused_decode unless told otherwise.
        self.fused_layers = False
        # Positions [0, hwm[r]) of row r may hold written values; past it, lazy pages hold zeros and
        # torch.empty storage holds garbage. Decode attends to [0, S) for every row with masked
        # weights that are exactly 0, and 0 * NaN = NaN: uninitialized memory past a row's own
        # length must not hold NaN/Inf bit patterns, so torch.empty rows are zeroed up to S before
        # they are read (``ensure_initialized``), a few positions per step. Lazy pages are zeros
        # already; there hwm bounds what ``release`` gives back.
        self.hwm = [0] * R
        el = torch.empty((), dtype=sd).element_size()
        per_head = 2 * hd * el
        if self.int8:
            per_head += 2 * (hd / bs) + 2  # bf16 key scales per channel per block + bf16 value scale per token
        self.bytes_per_token = L * nkv * per_head  # KV bytes per cached token, all layers

    # -- writes (inside attention) ---------------------------------------------------------------
    def write_prefill(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (nkv, T, hd) for positions [start, start+T) of ``slot``."""
        T = k.shape[1]
        if layer == 0:
            self.hwm[slot] = max(self.hwm[slot], start + T)
        if not self.int8:
            self.k[layer][slot, :, start:start + T] = k
            self.v[layer][slot, :, start:start + T] = v
            return
        bs = self.block_size
        b0 = start // bs * bs
        if start > b0:  # the first block was partly written before: its keys are in the residual
            k = torch.cat([self.k_res[layer][slot, :, :start - b0], k], dim=1)
        end = start + T
        n = end - b0
        nb = -(-n // bs)
        pad = nb * bs - n
        kp = torch.nn.functional.pad(k, (0, 0, 0, pad)) if pad else k  # (nkv, nb*bs, hd), zeros do not change absmax
        q, s = _quant_keys(kp.view(k.shape[0], nb, bs, -1))  # (nkv, nb, bs, hd) int8, (nkv, nb, hd)
        self.k[layer][slot, :, b0:b0 + nb * bs] = q.view(k.shape[0], nb * bs, -1)
        self.k_scale[layer][slot, :, b0 // bs:b0 // bs + nb] = s
        if end % bs:  # keep the block in progress in full precision
            r = end % bs
            self.k_res[layer][slot, :, :r] = k[:, n - r:]
        vq, vs = _quant_tokens(v)
        self.v[layer][slot, :, start:end] = vq
        self.v_scale[layer][slot, :, start:end] = vs

    def write_decode(self, layer: int, slots: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots, pos: (B,) int64; k, v: (B, nkv, hd) — one new position per row."""
        if not self.int8:
            self.k[layer][slots, :, pos] = k
            self.v[layer][slots, :, pos] = v
            return
        bs = self.block_size
        off = pos % bs  # (B,)
        blk = pos // bs  # (B,)
        res = self.k_res[layer]
        res[slots, :, off] = k
        keep = (torch.arange(bs, device=k.device)[None, :] <= off[:, None])  # (B, bs) positions filled so far
        # where, not multiply: positions past `off` may hold anything, and 0 * NaN = NaN
        block = torch.where(keep[:, None, :, None], res[slots], torch.zeros((), dtype=res.dtype, device=res.device))  # (B, nkv, bs, hd)
        q, s = _quant_keys(block[:, :, None])  # (B, nkv, 1, bs, hd), (B, nkv, 1, hd)
        idx = blk[:, None] * bs + torch.arange(bs, device=k.device)[None, :]  # (B, bs)
        self.k[layer][slots[:, None], :, idx] = q[:, :, 0].transpose(1, 2)  # index -> (B, bs, nkv, hd)
        self.k_scale[layer][slots, :, blk] = s[:, :, 0]
        vq, vs = _quant_tokens(v[:, :, None])  # (B, nkv, 1, hd), (B, nkv, 1)
        self.v[layer][slots, :, pos] = vq[:, :, 0]
        self.v_scale[layer][slots, :, pos] = vs[:, :, 0]

    # -- reads (inside attention) ----------------------------------------------------------------
    def read(self, layer: int, rows: slice | torch.Tensor, S: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of positions [start, S) for ``rows`` (a slice -> views when not INT8, or a (B,) index):
        (B, nkv, S - start, hd) each in the compute dtype. With INT8, ``start`` is a whole number of
        blocks (ValueError otherwise)."""
        if not self.int8:
            return self.k[layer][rows, :, start:S], self.v[layer][rows, :, start:S]
        bs = self.block_size
        if start % bs:
            raise ValueError(f"an INT8 KV read starts on a block boundary ({bs} positions), not at {start}")
        b0, nb = start // bs, -(-S // bs)
        kq = self.k[layer][rows, :, b0 * bs:nb * bs]  # (B, nkv, (nb - b0) bs, hd)
        B, nkv, _, hd = kq.shape
        ks = self.k_scale[layer][rows, :, b0:nb]  # (B, nkv, nb - b0, hd)
        kk = (kq.view(B, nkv, nb - b0, bs, hd).to(self.dtype) * ks[:, :, :, None].to(self.dtype)
              ).view(B, nkv, (nb - b0) * bs, hd)[:, :, :S - start]
        vv = self.v[layer][rows, :, start:S].to(self.dtype) * self.v_scale[layer][rows, :, start:S, None].to(self.dtype)
        return kk, vv

    def ensure_initialized(self, n_rows: int, S: int) -> None:
        """Zero positions [hwm, S) of rows [0, n_rows) that were never written (see ``hwm``); with
        lazy pages (zeros already) only record that rows [0, n_rows) may be written up to S.

        Zeroes ahead to the next multiple of ``ZERO_AHEAD`` positions, so a decoding row pays for
        this once every ZERO_AHEAD steps rather than with 2 x n_layers tiny writes every step."""
        bs = self.block_size
        for r in range(n_rows):
            a = self.hwm[r]
            if a >= S:
                continue
            if self.lazy_pages:  # zeros already: only note how far the row may be written
                self.hwm[r] = S
                continue
            b = min(self.max_len, -(-S // ZERO_AHEAD) * ZERO_AHEAD)
            for i in range(len(self.k)):
                self.k[i][r, :, a:b] = 0
                self.v[i][r, :, a:b] = 0
                if self.int8:
                    self.k_scale[i][r, :, -(-a // bs):-(-b // bs)] = 0  # a block in progress keeps its scale
                    self.v_scale[i][r, :, a:b] = 0
            self.hwm[r] = b

    # -- scheduler-planned copies and releases -----------------------------------------------------
    def release(self, row: int) -> None:
        """Give the memory of row ``row``'s positions from ``keep_positions`` on back to the OS:
        those pages read as zeros afterwards and are touched again only as positions are written.
        The scheduler lists a row once no sequence holds KV in it (``SchedulerOutput.release``).
        A no-op without lazy pages. Pages that straddle the kept range are kept."""
        keep, end = self.keep_positions, self.hwm[row]
        if not self._maps or end <= keep:
            return
        page = mmap.PAGESIZE
        for t, m, per_index in self._maps:
            _, nkv, P = t.shape[:3]
            first, last = -(-keep // per_index), min(P, -(-end // per_index))  # indices on axis 2
            inner = t[0, 0, 0].numel() * t.element_size()  # bytes per index of axis 2
            for h in range(nkv):  # each head's positions are one contiguous run
                base = (row * nkv + h) * P * inner
                a = -(-(base + first * inner) // page) * page
                # the page holding position hwm - 1 is this run's up to the run's own end (zeros past hwm)
                b = min(-(-(base + last * inner) // page), (base + P * inner) // page) * page
                if b > a:
                    m.madvise(mmap.MADV_DONTNEED, a, b - a)
        self.hwm[row] = keep

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy positions [0, length) of row ``src`` into row ``dst`` in every layer."""
        bs = self.block_size
        nb = -(-length // bs)
        self.hwm[dst] = max(self.hwm[dst], length)
        for i in range(len(self.k)):
            self.k[i][dst, :, :length] = self.k[i][src, :, :length]
            self.v[i][dst, :, :length] = self.v[i][src, :, :length]
            if self.int8:
                self.k_scale[i][dst, :, :nb] = self.k_scale[i][src, :, :nb]
                self.v_scale[i][dst, :, :length] = self.v_scale[i][src, :, :length]
                self.k_res[i][dst] = self.k_res[i][src]

    def restore(self, slot: int, first_block: int, pool_blocks: list[int]) -> None:
        """Prefix-cache hit: copy pool blocks into consecutive blocks of ``slot``'s row."""
        self._blocks(slot, first_block, pool_blocks, to_pool=False)

    def save(self, slot: int, first_block: int, pool_blocks: list[int]) -> None:
        """Copy consecutive full blocks of ``slot``'s row into pool blocks."""
        self._blocks(slot, first_block, pool_blocks, to_pool=True)

    def _blocks(self, slot: int, first_block: int, pool_blocks: list[int], to_pool: bool) -> None:
        """Copy ``slot``'s blocks [first_block, first_block + n) to or from ``pool_blocks`` (n ids).
        One strided ``copy_`` per run of consecutive pool ids and tensor, each element read and
        written once: a prefix cache allocates a prompt's blocks mostly in order, so a 3,600-token
        document is one or a few runs. (Indexing the pool with the id list made a gathered copy and
        then a reshaped one before the write: 37 of a repeated long-document prompt's 100 ms on an
        Intel Xeon, bf16, 2026-12-07.)"""
        bs, n = self.block_size, len(pool_blocks)
        if not to_pool:
            self.hwm[slot] = max(self.hwm[slot], (first_block + n) * bs)
        runs, j = [], 0  # (first pool id, first block of the slot's row, blocks)
        for i in range(1, n + 1):
            if i == n or pool_blocks[i] != pool_blocks[i - 1] + 1:
                runs.append((pool_blocks[j], first_block + j, i - j))
                j = i
        if len(runs) > MAX_COPY_RUNS:  # a fragmented pool: one gather (or scatter) per tensor instead
            self._gathered_blocks(slot, first_block, pool_blocks, to_pool)
            return
        for p, f, m in runs:
            a, b = f * bs, (f + m) * bs
            for i in range(len(self.k)):
                nkv, hd = self.k[i].shape[1], self.k[i].shape[3]
                # (slot's view, pool's view), both (nkv, m, ...): the row's positions as m blocks
                pairs = [(self.k[i][slot, :, a:b].view(nkv, m, bs, hd), self.pool_k[i][p:p + m].transpose(0, 1)),
                         (self.v[i][slot, :, a:b].view(nkv, m, bs, hd), self.pool_v[i][p:p + m].transpose(0, 1))]
                if self.int8:  # key scales per block and channel, value scales per position
                    pairs += [(self.k_scale[i][slot, :, f:f + m], self.pool_ks[i][p:p + m].transpose(0, 1)),
                              (self.v_scale[i][slot, :, a:b].view(nkv, m, bs), self.pool_vs[i][p:p + m].transpose(0, 1))]
                for row, pool in pairs:
                    (pool.copy_(row) if to_pool else row.copy_(pool))

    def _gathered_blocks(self, slot: int, first_block: int, pool_blocks: list[int], to_pool: bool) -> None:
        """``_blocks`` for pool ids in many runs: per tensor one ``index_copy_`` into the pool, or one
        ``index_select`` from it copied into the row."""
        bs, n = self.block_size, len(pool_blocks)
        a, b = first_block * bs, (first_block + n) * bs
        ids = torch.tensor(pool_blocks, device=self.k[0].device)
        for i in range(len(self.k)):
            nkv, hd = self.k[i].shape[1], self.k[i].shape[3]
            # (slot's view as (n, nkv, ...), pool tensor indexed on axis 0)
            pairs = [(self.k[i][slot, :, a:b].view(nkv, n, bs, hd).transpose(0, 1), self.pool_k[i]),
                     (self.v[i][slot, :, a:b].view(nkv, n, bs, hd).transpose(0, 1), self.pool_v[i])]
            if self.int8:
                pairs += [(self.k_scale[i][slot, :, first_block:first_block + n].transpose(0, 1), self.pool_ks[i]),
                          (self.v_scale[i][slot, :, a:b].view(nkv, n, bs).transpose(0, 1), self.pool_vs[i])]
            for row, pool in pairs:
                (pool.index_copy_(0, ids, row) if to_pool else row.copy_(pool.index_select(0, ids)))


def _quant_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric INT8 over the block axis: x (..., nb, bs, hd) -> int8 same shape,
    bf16 scales (..., nb, hd)."""
    s = (x.abs().amax(dim=-2).float() / 127.0).clamp_min(1e-8).to(torch.bfloat16)  # (..., nb, hd)
    q = torch.round(x.float() / s.float()[..., None, :]).clamp_(-127, 127).to(torch.int8)
    return q, s


def _quant_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric INT8 over the channel axis: x (..., T, hd) -> int8, bf16 scales (..., T)."""
    s = (x.abs().amax(dim=-1).float() / 127.0).clamp_min(1e-8).to(torch.bfloat16)  # (..., T)
    q = torch.round(x.float() / s.float()[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, s

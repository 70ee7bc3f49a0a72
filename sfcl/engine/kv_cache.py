"""KV cache storage: one contiguous row ("slot") of ``max_len`` positions per running sequence.

Who owns what: the scheduler (torch-free) decides which slot a request uses and when slots move
(compaction keeps running sequences in slots [0, n) so that decode attends to plain views, no
gather); this module only holds the tensors and performs the moves the scheduler asked for.
Data lives on the model's device. ``torch.empty`` reserves virtual memory; pages are touched only
as positions are written, so a large ``max_len`` costs little until used.
"""

from __future__ import annotations

import torch

from sfcl.model.llama import LlamaArgs


class KVCache:
    """k[l], v[l]: (n_slots, n_kv_heads, max_len, head_dim) in ``dtype`` for each layer l."""

    def __init__(self, args: LlamaArgs, n_slots: int, max_len: int, dtype: torch.dtype, device: str = "cpu"):
        if n_slots < 1 or max_len < 1:
            raise ValueError("n_slots and max_len must be >= 1")
        shape = (n_slots, args.n_kv_heads, max_len, args.head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.n_slots, self.max_len = n_slots, max_len
        self.bytes_per_token = 2 * args.n_layers * args.n_kv_heads * args.head_dim * self.k[0].element_size()

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy positions [0, length) of slot ``src`` into slot ``dst`` in every layer."""
        for kl, vl in zip(self.k, self.v):
            kl[dst, :, :length] = kl[src, :, :length]
            vl[dst, :, :length] = vl[src, :, :length]

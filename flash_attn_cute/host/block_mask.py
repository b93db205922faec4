"""Block masks: which (query block, key block) tiles a ``mask_mod`` leaves empty, full or
partial, computed once on the GPU and read by every kernel to skip work.

``create_block_mask`` evaluates the predicate on every (query, key) pair once (torch on
the device, in chunks) and keeps, per (batch, head, ``block_size`` query rows):

- ``ranges[..., 0:2]``: the kept keys' span [lo, hi) (empty: lo = seqlen_k, hi = 0);
- ``ranges[..., 2:4]``: the longest run of keys kept by *every* row of the block
  [full_lo, full_hi) (no such key: 0, 0).

Both are exact to the key, so they hold for any kernel tile: a kernel visits only the
KV blocks meeting [lo, hi) (``UserVariant.key_range``) and skips the per-element
predicate on the blocks inside [full_lo, full_hi) (``unmasked_key_range``); blocks in
between take the predicate. An empty block between two kept ones (a mask with holes)
is visited under the predicate: correct, not skipped. ``block_states`` records every
(query block, key block) tile as empty (0), partial (1) or full (2) for inspection.

Where every query row keeps one interval of keys (a document mask, a prefix, a window:
checked on every row), ``row_bounds`` holds each row's [lo, hi) and the kernels mask those
blocks with two compares per score instead of calling the ``mask_mod`` (a document mask
calls it with two aux loads per score). H200, b4 s8192 h16 d128 causal, documents of 1000
tokens (``bench_variants.py``): 293.9 TFLOP/s against 273 by the predicate
(``benchmarks/RESULTS.md``, section "User variants", its limits line).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from flash_attn_cute.host.user_variants import check_aux_tensors

__all__ = ["BlockMask", "create_block_mask"]

EMPTY, PARTIAL, FULL = 0, 1, 2
_CHUNK_ELEMS = 1 << 27  # mask elements evaluated at once (128 MB as bool)


@dataclass(frozen=True, eq=False)
class BlockMask:
    mask_mod: Callable
    aux_tensors: tuple
    batch: int  # 1 when the mask does not depend on the batch (broadcast)
    nheads: int  # 1 when it does not depend on the head (broadcast)
    seqlen_q: int
    seqlen_k: int
    block_size: tuple  # (query rows, keys) per block_states entry
    ranges: torch.Tensor  # (batch, nheads, ceil(seqlen_q / block_q), 4) int32
    block_states: torch.Tensor  # (batch, nheads, q blocks, k blocks) uint8: EMPTY / PARTIAL / FULL
    # (batch, nheads, seqlen_q, 2) int32: each row's kept keys [lo, hi) (an empty row: 0, 0),
    # where every row keeps one interval; None otherwise.
    row_bounds: Optional[torch.Tensor] = None

    @property
    def block_q(self) -> int:
        return self.block_size[0]

    def sparsity(self) -> float:
        """Fraction of the (query block, key block) tiles that are empty."""
        return (self.block_states == EMPTY).float().mean().item()

    def kernel_ranges(self, batch: int, nheads: int, rows: bool = False) -> torch.Tensor:
        """The kernels' table, broadcast to a call's (batch, nheads) (a view: stride 0 where
        the mask was built with batch or nheads None): ``ranges``, or with ``rows`` (needs
        ``row_bounds``) entry i = block i's four values (zeros past the last block) and row
        i's [lo, hi), (batch, nheads, seqlen_q, 6)."""
        table = self.ranges
        if rows:
            table = self._row_table()
        return table.expand(batch, nheads, *table.shape[2:])

    def _row_table(self) -> torch.Tensor:
        table = self.__dict__.get("_row_table_cache")
        if table is None:
            B, H, n_qb, _ = self.ranges.shape
            table = self.ranges.new_zeros(B, H, self.seqlen_q, 6)
            table[:, :, :n_qb, :4] = self.ranges
            table[..., 4:] = self.row_bounds
            object.__setattr__(self, "_row_table_cache", table)  # built once per mask, not per call
        return table

    def __repr__(self):
        return (f"BlockMask(batch={self.batch}, nheads={self.nheads}, seqlen_q={self.seqlen_q}, "
                f"seqlen_k={self.seqlen_k}, block_size={self.block_size}, sparsity={self.sparsity():.3f})")


def create_block_mask(mask_mod: Callable, batch: Optional[int], nheads: Optional[int], seqlen_q: int, seqlen_k: int,
                      aux_tensors=None, device="cuda", block_size=128) -> BlockMask:
    """Evaluates ``mask_mod(b, h, q_idx, kv_idx, aux)`` on the device and returns its
    ``BlockMask``. ``batch``/``nheads`` None: the mask does not depend on them (computed
    once, broadcast). ``block_size``: query rows per entry (int) or (rows, keys) of
    ``block_states``; the kernels' key ranges are exact whatever their tiles."""
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function, got {type(mask_mod).__name__}")
    block_q, block_k = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    for name, v in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k), ("block_size", block_q), ("block_size", block_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    aux = check_aux_tensors(aux_tensors, device)
    B, H = batch or 1, nheads or 1
    n_qb, n_kb = -(-seqlen_q // block_q), -(-seqlen_k // block_k)
    ranges = torch.empty(B, H, n_qb, 4, dtype=torch.int32, device=device)
    states = torch.empty(B, H, n_qb, n_kb, dtype=torch.uint8, device=device)
    row_bounds = torch.empty(B, H, seqlen_q, 2, dtype=torch.int32, device=device)
    intervals = torch.ones((), dtype=torch.bool, device=device)  # every row so far keeps one interval
    kv_idx = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    rows_per_chunk = max(block_q, (_CHUNK_ELEMS // max(seqlen_k * H, 1)) // block_q * block_q)
    for b in range(B):
        b_idx = torch.full((1, 1, 1, 1), b, device=device, dtype=torch.long)
        h_idx = torch.arange(H, device=device).view(1, H, 1, 1)
        for q0 in range(0, seqlen_q, rows_per_chunk):
            q1 = min(seqlen_q, q0 + rows_per_chunk)
            q_idx = torch.arange(q0, q1, device=device).view(1, 1, -1, 1)
            keep = mask_mod(b_idx, h_idx, q_idx, kv_idx, aux)
            if isinstance(keep, bool) or not isinstance(keep, torch.Tensor):
                keep = torch.tensor(bool(keep), device=device)
            if keep.dtype != torch.bool:
                raise TypeError(f"mask_mod must return booleans, got {keep.dtype}")
            keep = keep.expand(1, H, q1 - q0, seqlen_k)[0]  # (H, rows, seqlen_k)
            qb0, qb1 = q0 // block_q, -(-q1 // block_q)
            ranges[b, :, qb0:qb1], states[b, :, qb0:qb1] = _summarize(keep, block_q, block_k, seqlen_k)
            row_bounds[b, :, q0:q1], one = _row_intervals(keep)
            intervals &= one
    return BlockMask(mask_mod, aux, B, H, seqlen_q, seqlen_k, (block_q, block_k), ranges, states,
                     row_bounds if bool(intervals) else None)


def _row_intervals(keep: torch.Tensor):
    """(H, rows, seqlen_k) bool -> each row's kept span [lo, hi) (H, rows, 2) int32 (an empty
    row: 0, 0) and whether every row keeps exactly its span (0-d bool)."""
    pos = torch.arange(keep.shape[-1], device=keep.device)
    count = keep.sum(-1)
    lo = torch.where(keep, pos, keep.shape[-1]).amin(-1)
    hi = torch.where(keep, pos + 1, 0).amax(-1)
    empty = count == 0
    lo, hi = torch.where(empty, 0, lo), torch.where(empty, 0, hi)
    return torch.stack([lo, hi], dim=-1).to(torch.int32), (count == hi - lo).all()


def _summarize(keep: torch.Tensor, block_q: int, block_k: int, seqlen_k: int):
    """(H, rows, seqlen_k) bool -> ranges (H, q blocks, 4) and states (H, q blocks, k blocks)."""
    H, rows, _ = keep.shape
    pad = -rows % block_q
    # Rows past seqlen_q (the last block's tail) keep nothing and constrain nothing.
    any_kept = torch.nn.functional.pad(keep, (0, 0, 0, pad), value=False).view(H, -1, block_q, seqlen_k).any(2)
    all_kept = torch.nn.functional.pad(keep, (0, 0, 0, pad), value=True).view(H, -1, block_q, seqlen_k).all(2)
    pos = torch.arange(seqlen_k, device=keep.device)
    lo = torch.where(any_kept, pos, seqlen_k).amin(-1)
    hi = torch.where(any_kept, pos + 1, 0).amax(-1)
    # Longest run of every-row-kept keys: run length at j = j + 1 - (last non-kept index + 1).
    not_kept = torch.where(all_kept, -1, pos)
    last_break = torch.cummax(not_kept, dim=-1).values
    run = torch.where(all_kept, pos - last_break, 0)
    best = run.amax(-1)
    end = torch.argmax(run, dim=-1) + 1  # first position reaching the longest run
    f_lo = torch.where(best > 0, end - best, 0)
    f_hi = torch.where(best > 0, end, 0)
    ranges = torch.stack([lo, hi, f_lo, f_hi], dim=-1).to(torch.int32)
    pad_k = -seqlen_k % block_k
    blk_any = torch.nn.functional.pad(keep, (0, pad_k), value=False).view(H, rows, -1, block_k).any(-1)
    blk_all = torch.nn.functional.pad(keep, (0, pad_k), value=True).view(H, rows, -1, block_k).all(-1)
    blk_any = torch.nn.functional.pad(blk_any, (0, 0, 0, pad), value=False).view(H, -1, block_q, blk_any.shape[-1]).any(2)
    blk_all = torch.nn.functional.pad(blk_all, (0, 0, 0, pad), value=True).view(H, -1, block_q, blk_all.shape[-1]).all(2)
    states = torch.where(blk_all, FULL, torch.where(blk_any, PARTIAL, EMPTY)).to(torch.uint8)
    return ranges, states

"""Engines' KV tables in the primitives' terms: slots for :func:`rotary.kv_append`, a block table and sequence
lengths for :func:`rotary.paged_attention`.

- vLLM: ``slot_mapping`` *is* ``slots`` (-1 for padding tokens); ``block_tables`` (num_seqs, max_blocks) and
  ``seq_lens`` are the block table and lengths as they are.
- flash-attn: ``block_table`` (batch, max_pages) and ``cache_seqlens`` (the lengths before the new tokens): the
  new tokens of row b sit at positions ``cache_seqlens[b] + j``; :func:`slots_from_block_table` gives their slots,
  and the lengths after the append are ``cache_seqlens + s``.
- FlashInfer: a CSR page table, sequence i owning pages ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`` with
  ``kv_last_page_len[i]`` tokens on its last page: :func:`block_table_from_csr`; its append's
  ``(batch_indices, positions)`` pairs give slots through :func:`slots_from_block_table`.
"""

from __future__ import annotations

import numpy as np

from ..spec.packing import host_int_array


def slots_from_block_table(block_table, seq_ids, positions, page_size: int) -> np.ndarray:
    """``slots[t] = block_table[seq_ids[t], positions[t] // page_size] * page_size + positions[t] % page_size``
    (int64, host); a token with ``seq_ids[t] < 0`` (padding) gets slot -1."""
    table = host_int_array(block_table, "block_table")
    ids = host_int_array(seq_ids, "seq_ids")
    pos = host_int_array(positions, "positions")
    if table.ndim != 2 or ids.ndim != 1 or pos.shape != ids.shape:
        raise ValueError(f"block_table must be 2-D and seq_ids, positions 1-D of one length, got {table.shape}, "
                         f"{ids.shape}, {pos.shape}")
    real = ids >= 0
    if np.any(pos[real] < 0) or np.any(pos[real] >= table.shape[1] * page_size):
        raise ValueError(f"positions must be in [0, {table.shape[1] * page_size}) (the block table's pages)")
    page = np.where(real, pos // page_size, 0)
    slots = table[np.where(real, ids, 0), page] * page_size + pos % page_size
    return np.where(real, slots, -1).astype(np.int64)


def block_table_from_csr(kv_indptr, kv_indices, kv_last_page_len, page_size: int):
    """(block_table (n, max pages) int64 padded with -1, seq_lens (n,) int64) of FlashInfer's CSR page table:
    ``seq_lens[i] = (pages_i - 1) * page_size + kv_last_page_len[i]`` (0 for a sequence without pages)."""
    indptr = host_int_array(kv_indptr, "kv_indptr")
    indices = host_int_array(kv_indices, "kv_indices")
    last = host_int_array(kv_last_page_len, "kv_last_page_len")
    counts = np.diff(indptr)
    if indptr.ndim != 1 or indptr.size < 1 or indptr[0] != 0 or np.any(counts < 0) or indptr[-1] > indices.size:
        raise ValueError("kv_indptr must be non-decreasing offsets into kv_indices, starting at 0")
    if last.shape != counts.shape or np.any((last < 1) & (counts > 0)) or np.any(last > page_size):
        raise ValueError(f"kv_last_page_len must be ({counts.size},) in [1, {page_size}] for sequences with pages")
    width = int(counts.max()) if counts.size else 0
    table = np.full((counts.size, width), -1, np.int64)
    for i, (a, b) in enumerate(zip(indptr[:-1].tolist(), indptr[1:].tolist())):
        table[i, :b - a] = indices[a:b]
    seq_lens = np.where(counts > 0, (counts - 1) * page_size + last, 0).astype(np.int64)
    return table, seq_lens


__all__ = ["block_table_from_csr", "slots_from_block_table"]

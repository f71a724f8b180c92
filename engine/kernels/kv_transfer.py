"""Block copies between KV block arrays, one launch for every block of a step: the device pool and the host tier.

A block array is seen as [blocks, slices, S] words with its own strides: the device pool [2, L, N, bs, Hk, D] is
2L slices of S = bs*Hk*D elements per block, a block's slices N*S apart; the host tier [Nh, 2, L, bs, Hk, D] holds
a block's 2L slices side by side. On cuda the host tier is pinned memory, which a kernel reads and writes directly
(unified addressing): one launch moves a step's blocks where the copy engines need a memcpy per block and a staging
copy per direction.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class BlockView:
    """A block array as int32 words: block b's slice s is words[b * block + s * slice:][:size]."""
    words: torch.Tensor
    block: int
    slice: int
    size: int
    num_slices: int


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).view(torch.int32).reshape(-1)      # (a slice's bytes are a multiple of 4)


def pool_view(kv: torch.Tensor) -> BlockView:
    """The device pool [2, L, N, bs, Hk, D] (contiguous): a block's slices N blocks apart."""
    two, L, N = kv.shape[:3]
    words = _words(kv)
    size = words.numel() // (two * L * N)
    return BlockView(words, size, N * size, size, two * L)


def blocks_view(t: torch.Tensor) -> BlockView:
    """A block-major array [n, 2, L, bs, Hk, D] (contiguous): the host tier, or a staging buffer."""
    words = _words(t)
    num_slices = t.shape[1] * t.shape[2]
    per_block = words.numel() // t.shape[0]
    return BlockView(words, per_block, per_block // num_slices, per_block // num_slices, num_slices)


# the index pointers are slices of one tensor at any offset: not specialized on alignment (one compiled variant)
@triton.jit(do_not_specialize=["src_idx_ptr", "dst_idx_ptr"])
def _kv_transfer_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, src_block, src_slice, dst_block, dst_slice,
                        S, BLOCK: tl.constexpr):
    p = tl.program_id(0)                                     # the pair: src block -> dst block
    s = tl.program_id(1).to(tl.int64)                        # the slice (K or V of one layer)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < S
    sb = tl.load(src_idx_ptr + p).to(tl.int64)
    db = tl.load(dst_idx_ptr + p).to(tl.int64)
    x = tl.load(src_ptr + sb * src_block + s * src_slice + offs, mask=mask)
    tl.store(dst_ptr + db * dst_block + s * dst_slice + offs, x, mask=mask)


def kv_transfer(src: BlockView, dst: BlockView, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """dst block dst_idx[i] = src block src_idx[i], every slice (int32 indices on the launching device)."""
    assert src.size == dst.size and src.num_slices == dst.num_slices, (src, dst)
    n = src_idx.numel()
    if n == 0:
        return
    BLOCK = min(4096, triton.next_power_of_2(src.size))
    grid = (n, src.num_slices, triton.cdiv(src.size, BLOCK))
    _kv_transfer_kernel[grid](src.words, dst.words, src_idx, dst_idx, src.block, src.slice, dst.block, dst.slice,
                              src.size, BLOCK=BLOCK, num_warps=4)


def kv_transfer_ref(src: BlockView, dst: BlockView, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """The torch reference of kv_transfer (same arguments), and the CPU path."""
    if src_idx.numel() == 0:
        return
    as_blocks(dst, int(dst_idx.max()) + 1)[dst_idx.long()] = as_blocks(src, int(src_idx.max()) + 1)[src_idx.long()]


def as_blocks(v: BlockView, n: int) -> torch.Tensor:
    """The first n blocks of v as a [n, slices, size] view of its words."""
    return v.words.as_strided((n, v.num_slices, v.size), (v.block, v.slice, 1))

"""Structured output's token mask: the torch path against the definition, and the fused Triton kernel against
the torch path (interpreted on CPU, compiled on CUDA) at odd sizes."""
import pytest
import torch

from engine.structured.bitmask import apply_token_bitmask_torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# ---- the mask ---------------------------------------------------------------------------------------
def masked_by_loop(logits, bitmask, rows):
    """The definition, one token at a time: bit t % 32 of word t // 32; tokens past the last word never."""
    expect = logits.clone()
    words = bitmask.shape[1]
    for j, r in enumerate(rows):
        for t in range(logits.shape[1]):
            if t // 32 >= words or not (int(bitmask[j, t // 32]) >> (t % 32)) & 1:
                expect[r, t] = float("-inf")
    return expect


# (B, V, bitmask words, rows): vocabularies not a multiple of 32, rows a subset in any order, a bitmask
# narrower than the vocabulary (a model vocabulary padded beyond the tokenizer's)
CASES = [(5, 1000, 32, [3, 1]), (3, 97, 4, [0, 1, 2]), (7, 33, 2, [6]), (4, 1000, 20, [2, 0]), (2, 64, 2, [1])]


@pytest.mark.parametrize("B,V,words,rows", CASES)
def test_apply_token_bitmask_torch_matches_definition(B, V, words, rows):
    g = torch.Generator().manual_seed(B * V + words)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(rows), words), dtype=torch.int32, generator=g)
    logits = torch.randn(B, V, generator=g)
    expect = masked_by_loop(logits, bitmask, rows)
    if rows == list(range(B)):                          # every row in order: the same without an index
        every = logits.clone()
        apply_token_bitmask_torch(every, bitmask, None)
        assert torch.equal(every, expect)
    apply_token_bitmask_torch(logits, bitmask, torch.tensor(rows))
    assert torch.equal(logits, expect)


@pytest.mark.parametrize("B,V,words,rows", CASES + [pytest.param(3, 49157, 1537, [2, 0], marks=pytest.mark.slow)])
@pytest.mark.parametrize("block", [64, 8192])
def test_triton_token_bitmask_matches_torch(B, V, words, rows, block):
    """The fused kernel (interpreted on CPU, compiled on CUDA) against the torch path: fp32, and the dtype the
    GPU runs (bf16) there; chunks smaller than, equal to and larger than the vocabulary."""
    from engine.kernels.token_bitmask import apply_token_bitmask
    g = torch.Generator().manual_seed(B * V + words + block)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(rows), words), dtype=torch.int32, generator=g)
    for dtype in (torch.float32,) + ((torch.bfloat16,) if DEV == "cuda" else ()):
        logits = torch.randn(B, V, generator=g).to(DEV, dtype)
        expect = logits.clone()
        apply_token_bitmask_torch(expect, bitmask.to(DEV), torch.tensor(rows, device=DEV))
        apply_token_bitmask(logits, bitmask.to(DEV), torch.tensor(rows, dtype=torch.int32, device=DEV), block=block)
        assert torch.equal(logits, expect), dtype
        assert (logits == float("-inf")).any(1).tolist() == [r in rows for r in range(B)]

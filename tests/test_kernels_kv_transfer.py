"""kv_transfer: block copies between the device pool's layout and block-major arrays, against its torch
reference and against plain indexing of the tensors, at odd sizes (interpreter on CPU, compiled on cuda)."""
import pytest
import torch

from engine.kernels.kv_transfer import blocks_view, kv_transfer, kv_transfer_ref, pool_view

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the reference is also the CPU path; on cuda the kernel reads and writes the pinned host tier itself
FNS = (kv_transfer,) if DEVICE == "cuda" else (kv_transfer, kv_transfer_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("L, N, bs, Hk, D, Nh, n",
                         [(3, 7, 5, 3, 12, 9, 4), (1, 2, 16, 1, 4, 3, 2), (2, 33, 3, 2, 8, 40, 17)])
def test_transfer_matches_indexing(dtype, L, N, bs, Hk, D, Nh, n):
    g = torch.Generator().manual_seed(N * 31 + n)
    kv = torch.randn(2, L, N, bs, Hk, D, generator=g).to(dtype).to(DEVICE)
    host = torch.randn(Nh, 2, L, bs, Hk, D, generator=g).to(dtype)
    host = host.pin_memory() if DEVICE == "cuda" else host
    dev_blocks = torch.randperm(N, generator=g)[:n]
    host_blocks = torch.randperm(Nh, generator=g)[:n]
    want_host = host.clone()
    want_host[host_blocks] = kv.cpu()[:, :, dev_blocks].movedim(2, 0)
    d_idx, h_idx = dev_blocks.int().to(DEVICE), host_blocks.int().to(DEVICE)
    for fn in FNS:
        h = host.clone()
        h = h.pin_memory() if DEVICE == "cuda" else h
        fn(pool_view(kv), blocks_view(h), d_idx, h_idx)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(h.view(torch.uint8), want_host.view(torch.uint8)), fn.__name__
    # and back: host blocks into device blocks, the others untouched
    want_kv = kv.cpu().clone()
    want_kv[:, :, dev_blocks] = host[host_blocks].movedim(0, 2)
    for fn in FNS:
        k = kv.clone()
        fn(blocks_view(host), pool_view(k), h_idx, d_idx)
        assert torch.equal(k.cpu().view(torch.uint8), want_kv.view(torch.uint8)), fn.__name__


def test_staging_round_trip_keeps_every_word():
    """pool -> contiguous staging -> pool blocks elsewhere: the path a step's blocks out take, in words."""
    kv = torch.randn(2, 2, 11, 4, 2, 8).to(torch.bfloat16).to(DEVICE)
    src = torch.tensor([9, 0, 4], dtype=torch.int32, device=DEVICE)
    rows = torch.arange(3, dtype=torch.int32, device=DEVICE)
    staged = torch.empty((3, 2, 2, 4, 2, 8), dtype=torch.bfloat16, device=DEVICE)
    kv_transfer(pool_view(kv), blocks_view(staged), src, rows)
    assert torch.equal(staged, kv[:, :, src.long()].movedim(2, 0))
    dst = torch.tensor([1, 2, 10], dtype=torch.int32, device=DEVICE)
    before = kv.clone()
    kv_transfer(blocks_view(staged), pool_view(kv), rows, dst)
    assert torch.equal(kv[:, :, dst.long()], before[:, :, src.long()])
    untouched = [b for b in range(11) if b not in (1, 2, 10)]
    assert torch.equal(kv[:, :, untouched], before[:, :, untouched])

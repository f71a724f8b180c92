"""Weight formats and their torch references: quantize a [N, K] float weight, dequantize it back.

- fp8:  float8_e4m3fn weight [N, K] and one fp32 scale per 128x128 block, `weight_scale_inv`
        [ceil(N/128), ceil(K/128)] (w = q * scale; the layout of the published Qwen3/DeepSeek FP8 checkpoints).
- int8: symmetric per-output-channel int8 weight [N, K] and fp32 `weight_scale` [N, 1] (w = q * scale; the
        compressed-tensors w8a8 layout).
- int4: asymmetric group-wise 4-bit along K, groups of G (128 by default; 32 or 64): `qweight` uint8 [N, Kp / 2]
        (Kp = K rounded up to G) holding two codes per byte, `scales` and `mins` fp16 [N, Kp / G]
        (w = q * scale + min, q in 0..15). Byte i of group g holds k = G g + i in its low nibble and
        k = G g + G / 2 + i in its high one, so a kernel reads a group as two contiguous halves of the
        activation. G is implied by the shapes (int4_group).
        Words layout (int4_to_words; the packed decode GEMV's, kernels/quant_gemv_packed.py): `qweight` int32
        [N, Kp / 8]; word i of group g (i < S = G / 8, word column g S + i) holds k = G g + j S + i in its
        nibble j (bits 4j..4j+3), so the 8 nibbles of a word tile pair with 8 contiguous activation slices and
        decode by shift-and-mask, no reshape. dequantize tells the layouts apart by the dtype.
"""
from __future__ import annotations

import torch

FORMATS = ("fp8", "int8", "int4")
BLOCK = 128                     # fp8 block edge; int4 group size
FP8_MAX = 448.0                 # largest float8_e4m3fn
FP8_DTYPE = torch.float8_e4m3fn
# checkpoint parameters whose rows cover BLOCK weight rows (a fused q|k|v or gate|up concatenates them at /BLOCK)
ROW_BLOCKED = {"weight_scale_inv": BLOCK}


def _pad_to(w: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    N, K = w.shape
    if (rows, cols) == (N, K):
        return w
    return torch.nn.functional.pad(w, (0, cols - K, 0, rows - N), value=value)


INT4_GROUPS = (32, 64, 128)


def int4_group(tensors: dict[str, torch.Tensor]) -> int:
    per = 8 if tensors["qweight"].dtype == torch.int32 else 2          # codes per qweight element
    return per * tensors["qweight"].shape[1] // tensors["scales"].shape[1]


def int4_codes(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """int4 qweight (either layout) -> codes uint8 [N, Kp] in k order."""
    qw = tensors["qweight"]
    G = int4_group(tensors)
    N = qw.shape[0]
    if qw.dtype == torch.int32:                                           # words: [N, groups, S], nibble j
        w = qw.view(N, -1, 1, G // 8)
        shifts = torch.arange(0, 32, 4, device=qw.device, dtype=torch.int32).view(1, 1, 8, 1)
        return ((w >> shifts) & 15).to(torch.uint8).view(N, -1)          # [N, groups, 8, S] -> k = G g + j S + i
    p = qw.view(N, -1, G // 2)                                            # bytes: [N, groups, G / 2]
    return torch.cat((p & 15, p >> 4), dim=2).view(N, -1)


def int4_to_words(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """int4 tensors in the byte layout -> the words layout (same scales and mins; exact). Words pass through."""
    if tensors["qweight"].dtype == torch.int32:
        return tensors
    G = int4_group(tensors)
    codes = int4_codes(tensors).to(torch.int64)
    N = codes.shape[0]
    c = codes.view(N, -1, 8, G // 8)                                      # [N, groups, j, i]
    shifts = torch.arange(0, 32, 4, device=codes.device, dtype=torch.int64).view(1, 1, 8, 1)
    w = (c << shifts).sum(dim=2)                                          # [N, groups, S] in 0 .. 2^32 - 1
    w = torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)
    return {"qweight": w.view(N, -1).contiguous(), "scales": tensors["scales"], "mins": tensors["mins"]}


def quantize(w: torch.Tensor, fmt: str, group: int = BLOCK, row_absmax: torch.Tensor | None = None
             ) -> dict[str, torch.Tensor]:
    """[N, K] float weight -> the format's tensors (on w's device), named as QuantLinear's parameters.
    group: the int4 group size. row_absmax [N, 1]: int8's per-row |max| when w is a column slice of the
    weight (a row-parallel shard: the scale is the whole row's, as unsplit)."""
    w = w.detach().float()
    N, K = w.shape
    if fmt == "int8":
        absmax = w.abs().amax(dim=1, keepdim=True) if row_absmax is None else row_absmax
        scale = (absmax / 127.0).clamp(min=1e-12)                                     # [N, 1]
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        return {"weight": q, "weight_scale": scale}
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    if fmt == "fp8":
        blocks = _pad_to(w, nb * BLOCK, kb * BLOCK).view(nb, BLOCK, kb, BLOCK)
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)          # [nb, kb]
        full = scale.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
        q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return {"weight": q, "weight_scale_inv": scale}
    if fmt == "int4":
        kb = -(-K // group)
        g = _pad_to(w, N, kb * group).view(N, kb, group)                               # [N, groups, G]
        valid = (torch.arange(kb * group, device=w.device) < K).view(1, kb, group)
        mn = torch.where(valid, g, torch.inf).amin(dim=2)
        mx = torch.where(valid, g, -torch.inf).amax(dim=2)
        scales = ((mx - mn) / 15.0).clamp(min=1e-6).half()                           # [N, G]
        mins = mn.half()
        q = torch.round((g - mins.float()[..., None]) / scales.float()[..., None]).clamp(0, 15).to(torch.uint8)
        packed = q[..., :group // 2] | (q[..., group // 2:] << 4)                    # [N, groups, G / 2]
        return {"qweight": packed.reshape(N, kb * group // 2), "scales": scales, "mins": mins}
    raise ValueError(f"quantization: unknown format {fmt!r} (known: {FORMATS})")


def dequantize(fmt: str, tensors: dict[str, torch.Tensor], shape: tuple[int, int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The format's tensors -> the [N, K] weight they stand for, in dtype (computed in fp32)."""
    N, K = shape
    if fmt == "int8":
        w = tensors["weight"].float() * tensors["weight_scale"].float().view(N, 1)
    elif fmt == "fp8":
        s = tensors["weight_scale_inv"].float()
        full = s.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
        w = tensors["weight"].float() * full
    elif fmt == "int4":
        q = int4_codes(tensors).float().view(N, tensors["scales"].shape[1], -1)        # [N, groups, G]
        w = (q * tensors["scales"].float()[..., None] + tensors["mins"].float()[..., None]).view(N, -1)[:, :K]
    else:
        raise ValueError(f"quantization: unknown format {fmt!r} (known: {FORMATS})")
    return w.to(dtype)


def empty(fmt: str, N: int, K: int, device, group: int = BLOCK) -> dict[str, torch.Tensor]:
    """Uninitialised tensors of the format for an [N, K] weight (a pre-quantized checkpoint fills them)."""
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    if fmt == "int8":
        return {"weight": torch.empty(N, K, dtype=torch.int8, device=device),
                "weight_scale": torch.empty(N, 1, dtype=torch.float32, device=device)}
    if fmt == "fp8":
        return {"weight": torch.empty(N, K, dtype=FP8_DTYPE, device=device),
                "weight_scale_inv": torch.empty(nb, kb, dtype=torch.float32, device=device)}
    if fmt == "int4":
        kb = -(-K // group)
        return {"qweight": torch.empty(N, kb * group // 2, dtype=torch.uint8, device=device),
                "scales": torch.empty(N, kb, dtype=torch.float16, device=device),
                "mins": torch.empty(N, kb, dtype=torch.float16, device=device)}
    raise ValueError(f"quantization: unknown format {fmt!r} (known: {FORMATS})")


def activation_scales_fp8(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> [M, K / 128] fp32 scales: a row's 128-group max |x| / 448, by true division (CUDA torch divides
    by a Python number as a multiply by its reciprocal, which can differ in the last bit)."""
    M, K = x.shape
    kb = -(-K // BLOCK)
    amax = _pad_to(x.float(), M, kb * BLOCK).view(M, kb, BLOCK).abs().amax(dim=2).clamp(min=1e-12)
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_activations_fp8_ref(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> fp32 values of x quantized to fp8 per row and 128-wide group (dynamic scales), dequantized."""
    M, K = x.shape
    kb = -(-K // BLOCK)
    g = _pad_to(x.float(), M, kb * BLOCK).view(M, kb, BLOCK)
    s = activation_scales_fp8(x)[..., None]
    return ((g / s).to(FP8_DTYPE).float() * s).view(M, -1)[:, :K]

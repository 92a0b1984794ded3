"""FP8 quantization of attention inputs, FlashAttention 3 style: block scales and incoherent
processing (a random Hadamard rotation of Q and K). `flashgen.fp8` is its public face; it
lives in the runtime so that the input checks (and exported packages) share its constants.

Why both: real activations carry outlier features. One scale per tensor is set by the largest
outlier, so every ordinary value lands on few fp8 steps. A scale per block of rows confines an
outlier's damage to its block; rotating Q and K by the same orthogonal matrix leaves Q K^T
unchanged and spreads each outlier over all D coordinates before rounding.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

#: The fp8 format of the inputs: 4 exponent bits, 3 mantissa bits, no infinities, max 448.
#: (`float8_e5m2` trades a mantissa bit for range: too coarse for Q, K and V.)
FP8_DTYPE = torch.float8_e4m3fn
#: The largest finite `FP8_DTYPE` value: a block's absolute maximum is scaled onto it.
FP8_MAX = torch.finfo(FP8_DTYPE).max
#: Rows of the sequence sharing one scale: descales of a blocked tensor (B, H, N, D) have
#: shape (B, H, ceil(N / QUANT_BLOCK)). 128 is a multiple of every key/query tile the kernels
#: take, so a tile never straddles two scales.
QUANT_BLOCK = 128


class Quantized(NamedTuple):
    """fp8 q, k, v (B, H, N, D) and their fp32 descales: multiply an fp8 value by its descale
    to get back (approximately) the value it came from. Descales are (B, H, ceil(N / block))
    for a blocked tensor, or 0-d for a per-tensor one."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    descale_q: torch.Tensor
    descale_k: torch.Tensor
    descale_v: torch.Tensor


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x @ H / sqrt(D) over the last dim (D a power of two), H the Sylvester Hadamard matrix:
    log2(D) butterfly passes, O(D log D) per row, no D x D matrix. Orthogonal and symmetric,
    so it is its own inverse."""
    d = x.shape[-1]
    if d & (d - 1) or d == 0:
        raise ValueError(f"the Hadamard transform needs a power-of-two last dim, got {d}")
    lead = x.shape[:-1]
    h = 1
    while h < d:
        # Pair each element with the one h further on: (a, b) -> (a + b, a - b).
        pairs = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    return x / math.sqrt(d)


def random_signs(d: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """D random +-1 from a seeded generator: the diagonal that makes the rotation random."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    signs = torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1
    return signs.to(device)


def rotate(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """x @ diag(s) @ H / sqrt(D), s = `random_signs(D, seed)`: the orthogonal rotation applied
    to Q and K alike (so Q K^T is unchanged). `unrotate` undoes it."""
    return hadamard(x * random_signs(x.shape[-1], seed, x.device).to(x.dtype))


def unrotate(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The inverse of `rotate`: H is its own inverse, and so is diag(s)."""
    return hadamard(x) * random_signs(x.shape[-1], seed, x.device).to(x.dtype)


def padded_dim(d: int) -> int:
    """The power of two the head dim is zero-padded to before rotating."""
    return 1 << max(0, (d - 1).bit_length())


def quantize_one(x: torch.Tensor, block: int | None = QUANT_BLOCK
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One (B, H, N, D) tensor to (fp8 tensor, fp32 descales): each block of `block` rows of
    a (batch, head) scaled so its absolute maximum lands on `FP8_MAX`; `block=None` scales
    the whole tensor at once (descale 0-d). An all-zero block gets descale 1."""
    x = x.float()
    if block is None:
        amax = x.abs().amax()
    else:
        b, h, n, d = x.shape
        blocks = -(-n // block)
        rows = torch.nn.functional.pad(x, (0, 0, 0, blocks * block - n))
        amax = rows.reshape(b, h, blocks, block * d).abs().amax(dim=-1)
    descale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scale = descale if block is None else descale.repeat_interleave(block, dim=-1)
    if block is not None:
        scale = scale[..., : x.shape[2], None]
    # The clamp only guards against rounding of amax / FP8_MAX pushing a value past FP8_MAX:
    # e4m3fn has no infinity, and a cast past its range gives NaN.
    quantized = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, descale.to(torch.float32)


def dequantize(x: torch.Tensor, descale: torch.Tensor, block: int | None = QUANT_BLOCK
               ) -> torch.Tensor:
    """fp8 (B, H, N, D) and its descales back to fp32: the values the kernel computes on."""
    values = x.float()
    if descale.dim() == 0:
        return values * descale
    if block is None:
        raise ValueError("block is None but descale is not 0-d: pass the block size used")
    scale = descale.float().repeat_interleave(block, dim=-1)[..., : x.shape[2], None]
    return values * scale


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
             block: int | None = QUANT_BLOCK, incoherent: bool = True,
             seed: int = 0, v_keys_inner: bool = True) -> Quantized:
    """q, k, v (B, H, N, D) (k and v may have fewer heads) to `FP8_DTYPE` with fp32 descales,
    the step to run before `flashgen.attention(..., descale_q=, descale_k=, descale_v=)`.

    `incoherent`: Q and K are both rotated by one random orthogonal matrix (random +-1 signs
    from `seed`, then a normalised Walsh-Hadamard transform), so Q K^T is unchanged while
    outlier features spread over every coordinate before rounding. V is not rotated, so the
    output needs no inverse. The rotation is O(D log D) per row; fusing it into RoPE saves a
    pass over Q and K.
    A head dim D that is not a power of two (with `incoherent`) is zero-padded to the next
    one, D' = `padded_dim(D)`, and q, k and v all come back with D' columns (v's extra ones
    zero, so they share a head dim). Then pass `scale=D ** -0.5` to attention (its default
    would use D') and keep `out[..., :D]`: the extra columns of the output are zero.
    `block`: rows per scale (default `QUANT_BLOCK`); `None` gives one scale per tensor.
    `incoherent=False, block=None` is plain per-tensor fp8, the baseline. Attention reads
    one descale per `QUANT_BLOCK` rows (or one per tensor): another block size is for
    accuracy studies (`dequantize`, the emulation), and warns, since its descales could
    have attention's shape and still scale the wrong rows.
    `v_keys_inner`: v comes back as a (B, H, N, D) view of (B, H, D, N) memory, each column's
    keys contiguous (rows padded to 16 keys): the layout fp8 tensor cores take for P V (the
    reduction runs over the keys; Hopper's fp8 WGMMA reads that operand only K-major) and
    the one fp8 TMA kernels read. Same values; any layout is accepted by attention (others
    run the pointer kernels).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim); "
                             f"got shape {tuple(t.shape)}")
        if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise TypeError(f"{name} must be a float16, bfloat16, float32 or float64 tensor "
                            f"to quantize; got {t.dtype}")
    if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        raise ValueError(f"head dims differ: q {q.shape[-1]}, k {k.shape[-1]}, "
                         f"v {v.shape[-1]}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}")
    if min(q.shape[1], k.shape[1], q.shape[-1]) == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a positive multiple of key/value "
                         f"heads ({k.shape[1]}), and the head dim ({q.shape[-1]}) positive")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int)
                              or block < 1):
        raise ValueError(f"block must be a positive int or None, got {block!r}")
    if block not in (None, QUANT_BLOCK):
        warnings.warn(f"quantize(block={block}): flashgen.attention reads one descale per "
                      f"{QUANT_BLOCK} rows (or one per tensor); these descales are for "
                      "dequantize and accuracy studies, not for attention", stacklevel=2)
    if incoherent:
        d = q.shape[-1]
        pad = padded_dim(d) - d
        if pad:
            q, k, v = (torch.nn.functional.pad(t.float(), (0, pad)) for t in (q, k, v))
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        q, k = rotate(q.to(work), seed), rotate(k.to(work), seed)
    (q8, dq), (k8, dk), (v8, dv) = (quantize_one(t, block) for t in (q, k, v))
    if v_keys_inner:
        # Rows of keys padded to 16 bytes: the stride TMA descriptors need (the padding is
        # never read: the kernels stop at N).
        b, h, n, d = v8.shape
        rows = torch.empty((b, h, d, -(-n // 16) * 16), dtype=v8.dtype, device=v8.device)
        rows[..., :n].copy_(v8.transpose(-1, -2))
        v8 = rows[..., :n].transpose(-1, -2)
    return Quantized(q8, k8, v8, dq, dk, dv)

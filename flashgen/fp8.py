"""FP8 attention inputs: quantize q, k, v before `flashgen.attention` (FlashAttention 3 style).

    qz = flashgen.fp8.quantize(q, k, v)            # block scales + random Hadamard rotation
    out = flashgen.attention(qz.q, qz.k, qz.v, descale_q=qz.descale_q,
                             descale_k=qz.descale_k, descale_v=qz.descale_v)

`quantize(..., incoherent=False, block=None)` is plain per-tensor fp8, the baseline;
`dequantize` gives back the fp32 values an fp8 kernel computes on. The measured accuracy of
each scheme is in docs/fp8.md. The code lives in `flashgen.runtime.quantize` so the runtime's
input checks, and exported packages, share its constants.
"""

from __future__ import annotations

from flashgen.runtime.quantize import (
    FP8_DTYPE,
    FP8_MAX,
    QUANT_BLOCK,
    Quantized,
    dequantize,
    hadamard,
    padded_dim,
    quantize,
    random_signs,
    rotate,
    unrotate,
)

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "QUANT_BLOCK",
    "Quantized",
    "dequantize",
    "hadamard",
    "padded_dim",
    "quantize",
    "random_signs",
    "rotate",
    "unrotate",
]

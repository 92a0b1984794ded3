"""Quick forward check of flashgen's default variant against torch SDPA backends (GPU).

Not the benchmark suite (that is `flashgen bench`): a look at where the untuned default stands.
Median of repeats with CUDA events (triton.testing.do_bench), fresh random inputs.
"""

from __future__ import annotations

import argparse

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="fp16")
    args = parser.parse_args()
    dtype = flashgen.problem.DTYPES[args.dtype]
    print(f"device: {torch.cuda.get_device_name()}  dtype {args.dtype}")
    print(f"{'problem':44s} {'variant':24s} {'flashgen':>9s} {'cudnn':>9s} {'flash':>9s} ratio")
    for d in (64, 128):
        for n in (512, 2048, 8192, 16384):
            for causal in (False, True):
                b, h = 16384 // n, 2048 // d
                p = flashgen.Problem(b, h, h, n, n, d, args.dtype, causal)
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
                variant = flashgen.default_variant(p, "cuda")
                times = {
                    "flashgen": triton.testing.do_bench(
                        lambda: flashgen.attention(q, k, v, causal=causal, variant=variant),
                        return_mode="median",
                    )
                }
                for name, backend in BACKENDS.items():
                    with sdpa_kernel(backend):
                        try:
                            times[name] = triton.testing.do_bench(
                                lambda: torch.nn.functional.scaled_dot_product_attention(
                                    q, k, v, is_causal=causal
                                ),
                                return_mode="median",
                            )
                        except RuntimeError:
                            times[name] = float("nan")
                tf = {key: p.flops() / t * 1e-9 for key, t in times.items()}
                best = max(tf["cudnn"], tf["flash"])
                print(f"{p!s:44s} {variant!s:24s} {tf['flashgen']:9.1f} {tf['cudnn']:9.1f} "
                      f"{tf['flash']:9.1f} {tf['flashgen'] / best:5.2f}")


if __name__ == "__main__":
    main()

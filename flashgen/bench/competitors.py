"""The attention implementations `flashgen bench` times side by side, each behind one factory.

A competitor turns a problem into a plain `(q, k, v) -> out` function once (choosing the
variant, compiling, building the causal block mask: work a real model also does once), so the
timed call is only the attention itself. The same function runs on the correctness inputs,
which may be a smaller problem of the same kind (`flashgen.tune.fwd_bench.gate_problem`): every
function here therefore works on any lengths, not only the problem it was prepared for.

A competitor that cannot run a problem raises `Unavailable` (or any error): the benchmark
records it as "n/a" with the reason and goes on. With a `Layout` (`--window`, `--varlen`:
`flashgen.bench.layouts`) `prepare` gets it as `layout=` and its function also takes the
layout's extra arguments; SDPA's backends have no such masks and are n/a.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from flashgen.bench.layouts import Layout, flashgen_fn, flex_fn
from flashgen.kernels.hardware import device_info
from flashgen.kernels.problem import Problem
from flashgen.runtime.api import attention
from flashgen.serve import Dispatcher, default_dispatcher

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: The subject of the benchmark; every other competitor is a yardstick for it.
FLASHGEN = "flashgen"


class Unavailable(RuntimeError):
    """This competitor cannot run the problem here (no GPU, no such backend, ...)."""


@dataclass(frozen=True)
class Prepared:
    """A competitor ready for one problem: the call, and what it chose (for the CSV)."""

    fn: AttentionFn
    note: str = ""


@dataclass(frozen=True)
class Competitor:
    name: str
    description: str
    prepare: Callable[..., Prepared]  # (problem, device[, layout=]) -> Prepared
    #: prepare takes `backward=` (whether a timed mode runs one): flashgen pins its backward
    #: choice only where one runs.
    picks_backward: bool = False


def _flashgen(problem: Problem, device: torch.device,
              dispatcher: Dispatcher | None = None, layout: Layout | None = None,
              backward: bool = True) -> Prepared:
    # The dispatcher's choice for the timed problem is pinned, so the correctness inputs
    # (possibly a smaller problem, whose own dispatch could pick another variant) run the very
    # kernels that are timed. With the choice pinned, a call costs what a dispatched one does:
    # the plan cache is keyed by shape and variant alike.
    dispatcher = dispatcher or default_dispatcher()
    info = device_info(device)
    fwd = dispatcher.choose(problem, info)
    # fp8 is forward only: asking for its backward would log a hint to tune one
    # (`flashgen tune --dtype fp8 --mode bwd`) that `flashgen tune` refuses. A forward-only
    # bench asks for none either: its hint would be about kernels it does not time.
    bwd = (dispatcher.choose_bwd(problem, info)
           if backward and problem.dtype != "fp8" else None)
    note = f"fwd {fwd.variant} ({fwd.how})" + (
        "" if not backward else "; no backward (fp8)" if bwd is None
        else f"; bwd {bwd.variant} ({bwd.how})")
    bwd_variant = None if bwd is None else bwd.variant
    if layout:
        return Prepared(flashgen_fn(problem, layout, fwd.variant, bwd_variant), note)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **fp8: torch.Tensor) -> torch.Tensor:
        out = attention(q, k, v, causal=problem.causal, variant=fwd.variant,
                        bwd_variant=bwd_variant, **fp8)  # type: ignore[arg-type]
        assert isinstance(out, torch.Tensor)
        return out

    return Prepared(run, note)


def _sdpa_kwargs(q: torch.Tensor, k: torch.Tensor, causal: bool) -> dict[str, object]:
    kwargs: dict[str, object] = {}
    if q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    nq, nk = q.shape[-2], k.shape[-2]
    if causal and nq != nk:
        # SDPA's is_causal aligns the mask top-left; flashgen aligns it bottom-right.
        from torch.nn.attention.bias import causal_lower_right

        kwargs["attn_mask"] = causal_lower_right(nq, nk)
    else:
        kwargs["is_causal"] = causal
    return kwargs


def _no_fp8(problem: Problem, who: str) -> None:
    if problem.dtype == "fp8":
        raise Unavailable(f"torch {torch.__version__}'s {who} takes no fp8 inputs")


def _sdpa(backend_name: str, gpu_only: bool) -> Callable[[Problem, torch.device], Prepared]:
    """One SDPA backend, forced with `sdpa_kernel`: SDPA's own pick is a heuristic, and a
    backend that refuses the problem must show up as n/a, not as another backend's time."""

    def prepare(problem: Problem, device: torch.device,
                layout: Layout | None = None) -> Prepared:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if layout:
            raise Unavailable("SDPA has no sliding-window or packed-sequence mask (only a "
                              "dense one)")
        _no_fp8(problem, "SDPA")
        if gpu_only and device.type != "cuda":
            raise Unavailable("needs a CUDA GPU")
        backend = getattr(SDPBackend, backend_name, None)
        if backend is None:
            raise Unavailable(f"torch {torch.__version__} has no SDPBackend.{backend_name}")

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, **_sdpa_kwargs(q, k, problem.causal))

        return Prepared(run, f"SDPBackend.{backend_name}")

    return prepare


def _flex(problem: Problem, device: torch.device, layout: Layout | None = None) -> Prepared:
    """FlexAttention compiled for static shapes, as its own benchmarks run it.

    Dynamo's caches are reset first, so each problem compiles on its own and a long grid
    never reaches dynamo's recompile limit (past it, calls would silently run unfused).
    """
    if device.type != "cuda":
        raise Unavailable("timed on CUDA only (the CPU run covers flashgen and sdpa-math)")
    _no_fp8(problem, "FlexAttention")
    if layout:
        return Prepared(flex_fn(problem, layout, device),
                        "torch.compile(flex_attention, dynamic=False), layout block mask")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    masks: dict[tuple[int, int], object] = {}

    def block_mask(nq: int, nk: int) -> object:
        # Built once per shape, outside the timed call; bottom-right aligned like flashgen's
        # (the same as top-left when Nq == Nk).
        if (nq, nk) not in masks:
            offset = nk - nq

            def causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                       kv_idx: torch.Tensor) -> torch.Tensor:
                return q_idx + offset >= kv_idx

            masks[nq, nk] = create_block_mask(causal, None, None, nq, nk, device=device)
        return masks[nq, nk]

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mask = block_mask(q.shape[-2], k.shape[-2]) if problem.causal else None
        out = compiled(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        assert isinstance(out, torch.Tensor)
        return out

    return Prepared(run, "torch.compile(flex_attention, dynamic=False)")


COMPETITORS: dict[str, Competitor] = {c.name: c for c in (
    Competitor(FLASHGEN, "flashgen.attention, the dispatched (tuned or default) variant",
               _flashgen, picks_backward=True),
    Competitor("sdpa-flash", "torch SDPA, FlashAttention backend",
               _sdpa("FLASH_ATTENTION", gpu_only=True)),
    Competitor("sdpa-cudnn", "torch SDPA, cuDNN backend", _sdpa("CUDNN_ATTENTION", gpu_only=True)),
    Competitor("sdpa-efficient", "torch SDPA, memory-efficient backend",
               _sdpa("EFFICIENT_ATTENTION", gpu_only=True)),
    Competitor("sdpa-math", "torch SDPA, math backend (materialises the scores)",
               _sdpa("MATH", gpu_only=False)),
    Competitor("flex", "torch.compile'd FlexAttention (causal through a block mask)", _flex),
)}

#: What a GPU run compares by default; sdpa-math only where asked (it is a memory yardstick).
GPU_DEFAULT = (FLASHGEN, "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")
#: The interpreter run: the whole pipeline on CPU tensors, with the one CPU-capable yardstick.
CPU_DEFAULT = (FLASHGEN, "sdpa-math")
#: The peak-memory table compares the tiled kernel with the one that stores the scores.
MEMORY_COMPETITORS = (FLASHGEN, "sdpa-math")


def resolve(names: Sequence[str], dispatcher: Dispatcher | None = None) -> list[Competitor]:
    """Competitors by name, in the order given; an unknown name is an error naming the known.
    `dispatcher` chooses flashgen's kernels (default: the one `flashgen.attention` uses)."""
    unknown = [n for n in names if n not in COMPETITORS]
    if unknown:
        raise ValueError(f"unknown competitor(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(COMPETITORS)}")
    chosen = [COMPETITORS[n] for n in dict.fromkeys(names)]
    if dispatcher is None:
        return chosen
    ours = functools.partial(_flashgen, dispatcher=dispatcher)
    return [replace(c, prepare=ours) if c.name == FLASHGEN else c for c in chosen]


def parse_names(text: str | None, device: torch.device) -> list[str]:
    """`--competitors` text -> names; None gives the device's default set."""
    if text is None:
        return list(GPU_DEFAULT if device.type == "cuda" else CPU_DEFAULT)
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError("--competitors names none")
    return names

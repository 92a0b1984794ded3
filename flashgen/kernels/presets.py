"""Named sets of problems for `flashgen tune --preset`, and the expansion of CLI choices.

Every preset keeps the FlashAttention papers' convention of 16k tokens per batch (batch =
16384 / N), so a preset's problems do comparable work at every sequence length and its
TFLOP/s figures line up with the papers' plots.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from flashgen.kernels.hardware import DeviceInfo, cuda_index
from flashgen.kernels.problem import DecodeProblem, Problem

TOKENS_PER_BATCH = 16384


@dataclass(frozen=True)
class Preset:
    """Heads and head dims of one model family (or benchmark), tuned at several lengths."""

    description: str
    heads: tuple[tuple[int, int, int], ...]  # (Hq, Hkv, D) combinations
    seq_lens: tuple[int, ...]
    batch: int | None = None  # None: TOKENS_PER_BATCH // N
    #: Whole (B, Hq, Hkv, Nq, Nk, D) shapes, for a preset of models that share no grid.
    problems: tuple[tuple[int, int, int, int, int, int], ...] = ()

    def shapes(self) -> list[tuple[int, int, int, int, int, int]]:
        """(B, Hq, Hkv, Nq, Nk, D) for every head layout and length (self-attention: Nq = Nk),
        then the preset's whole shapes."""
        return [
            (self.batch or max(1, TOKENS_PER_BATCH // n), hq, hkv, n, n, d)
            for hq, hkv, d in self.heads
            for n in self.seq_lens
        ] + list(self.problems)


_PAPER_LENS = (512, 1024, 2048, 4096, 8192, 16384)
_MODEL_LENS = (512, 1024, 2048, 4096, 8192)

PRESETS: dict[str, Preset] = {
    # FlashAttention 1/2/3 benchmark grid: hidden size 2048, so H = 2048 / D.
    "fa-bench": Preset("FlashAttention papers' grid: hidden 2048, D 64 and 128, N 512..16k",
                       ((32, 32, 64), (16, 16, 128)), _PAPER_LENS),
    "llama3-8b": Preset("Llama 3 8B: 32 query heads, 8 KV heads, D 128", ((32, 8, 128),),
                        _MODEL_LENS),
    "llama3-70b": Preset("Llama 3 70B: 64 query heads, 8 KV heads, D 128", ((64, 8, 128),),
                         _MODEL_LENS),
    "mistral-7b": Preset("Mistral 7B: 32 query heads, 8 KV heads, D 128", ((32, 8, 128),),
                         _MODEL_LENS),
    # An odd head count and a 7:1 GQA ratio: grids of "nice" numbers hide tail bugs.
    "qwen2.5-7b": Preset("Qwen2.5 7B: 28 query heads, 4 KV heads, D 128", ((28, 4, 128),),
                         _MODEL_LENS),
    "gemma2-9b": Preset("Gemma 2 9B: 16 query heads, 8 KV heads, D 256", ((16, 8, 256),),
                        (512, 1024, 2048, 4096)),
    # Vision transformers at 224 px, a batch each: short odd lengths (a class token on 14 x 14
    # or 16 x 16 patches), where launch cost and tile waste weigh most.
    "vit": Preset("ViT-B/16 (B64 H12 N197) and ViT-L/14 (B256 H16 N257), D 64", (), (),
                  problems=((64, 12, 12, 197, 197, 64), (256, 16, 16, 257, 257, 64))),
    # Small enough for the Triton interpreter on a CPU (CI); deliberately odd lengths and D.
    "tiny": Preset("Tiny shapes for the CPU interpreter (CI smoke tests)",
                   ((2, 1, 16), (4, 2, 24)), (32, 48), batch=1),
}



@dataclass(frozen=True)
class DecodePreset:
    """Heads of one model generating: Nq new tokens against caches of Nk keys, B sequences."""

    description: str
    heads: tuple[tuple[int, int, int], ...]  # (Hq, Hkv, D)
    batches: tuple[int, ...]
    seq_ks: tuple[int, ...]
    seq_q: int = 1

    def shapes(self) -> list[tuple[int, int, int, int, int, int]]:
        """(B, Hq, Hkv, Nq, Nk, D) for every head layout, batch and cache length."""
        return [(b, hq, hkv, self.seq_q, nk, d) for hq, hkv, d in self.heads
                for b in self.batches for nk in self.seq_ks]


_DECODE_BATCHES = (1, 8, 32, 128)
_DECODE_LENS = tuple(1024 << i for i in range(8))  # 1k .. 128k

DECODE_PRESETS: dict[str, DecodePreset] = {
    "llama3-8b-decode": DecodePreset("Llama 3 8B generating: 32 query heads, 8 KV heads, D 128",
                                     ((32, 8, 128),), _DECODE_BATCHES, _DECODE_LENS),
    "llama3-70b-decode": DecodePreset("Llama 3 70B generating: 64 query heads, 8 KV heads, "
                                      "D 128", ((64, 8, 128),), _DECODE_BATCHES, _DECODE_LENS),
    "qwen2.5-7b-decode": DecodePreset("Qwen2.5 7B generating: 28 query heads, 4 KV heads, "
                                      "D 128", ((28, 4, 128),), _DECODE_BATCHES, _DECODE_LENS),
    # Issue 30's target grid (H200, bf16): B 1, 8, 64 x Nk 2k, 8k, 32k, 128k.
    "decode-targets": DecodePreset("The decode target grid: Hq 32, Hkv 8, D 128, B 1/8/64, "
                                   "Nk 2k..128k", ((32, 8, 128),), (1, 8, 64),
                                   (2048, 8192, 32768, 131072)),
    "tiny-decode": DecodePreset("Tiny decode shapes for the CPU interpreter",
                                ((4, 1, 16), (8, 2, 24)), (2,), (48,)),
}


def decode_problems(shapes: Iterable[str], presets: Iterable[str], dtypes: Iterable[str],
                    causal: Iterable[bool], page_sizes: Iterable[int]) -> list[DecodeProblem]:
    """Decode problems from `B,Hq,Hkv,Nq,Nk,D` strings and decode presets, for each dtype,
    mask and page size (0: contiguous), in that order, without duplicates. The page sizes
    vary fastest, so a shape's contiguous problem comes before its paged ones."""
    texts = list(shapes)
    for name in presets:
        try:
            preset = DECODE_PRESETS[name]
        except KeyError:
            if name in PRESETS:  # a forward preset under --mode decode: say so, not "unknown"
                raise ValueError(f"{name!r} is not a decode preset: drop --mode decode, or "
                                 f"choose from {sorted(DECODE_PRESETS)}") from None
            raise ValueError(f"unknown decode preset {name!r}; choose from "
                             f"{sorted(DECODE_PRESETS)}") from None
        texts += [",".join(map(str, s)) for s in preset.shapes()]
    dtypes, causal, page_sizes = list(dtypes), list(causal), list(page_sizes)
    found = [DecodeProblem.parse(t, d, c, page) for t in texts for d in dtypes for c in causal
             for page in page_sizes]
    return list(dict.fromkeys(found))


def parse_page_sizes(text: str) -> list[int]:
    """`0,16` -> [0, 16] (0: a contiguous cache); DecodeProblem checks each."""
    try:
        sizes = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--page-size takes comma-separated integers, got {text!r}") from None
    if not sizes:
        raise ValueError("no page size given")
    return sizes


CAUSAL_CHOICES: dict[str, tuple[bool, ...]] = {
    "no": (False,),
    "yes": (True,),
    "both": (False, True),
}


def preset_problems(name: str, dtypes: Iterable[str], causal: Iterable[bool]) -> list[Problem]:
    """Every problem of preset `name` for each dtype and causal setting."""
    try:
        preset = PRESETS[name]
    except KeyError:
        if name in DECODE_PRESETS:  # exists, but "unknown" would send the user to a typo hunt
            raise ValueError(f"{name!r} is a decode preset: add --mode decode") from None
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}, or with "
                         f"--mode decode from {sorted(DECODE_PRESETS)}") from None
    return shape_problems([",".join(map(str, s)) for s in preset.shapes()], dtypes, causal)


def shape_problems(shapes: Iterable[str], dtypes: Iterable[str],
                   causal: Iterable[bool]) -> list[Problem]:
    """Problems from `B,Hq,Hkv,Nq,Nk,D` strings, for each dtype and causal setting."""
    dtypes, causal = list(dtypes), list(causal)
    return [Problem.parse(s, d, c) for s in shapes for d in dtypes for c in causal]


def expand(shapes: Iterable[str], presets: Iterable[str], dtypes: Iterable[str],
           causal: Iterable[bool]) -> list[Problem]:
    """The CLI's problem list: shapes first, then presets, without duplicates, in order."""
    dtypes, causal = list(dtypes), list(causal)
    problems = shape_problems(shapes, dtypes, causal)
    for name in presets:
        problems += preset_problems(name, dtypes, causal)
    return list(dict.fromkeys(problems))


def parse_dtypes(text: str) -> list[str]:
    """`fp16,bf16` -> ["fp16", "bf16"]; Problem validates each name."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError("no dtype given")
    return names


def parse_causal(text: str) -> tuple[bool, ...]:
    try:
        return CAUSAL_CHOICES[text.strip().lower()]
    except KeyError:
        raise ValueError(f"--causal must be one of {sorted(CAUSAL_CHOICES)}, got {text!r}") \
            from None


def length_label(n: int) -> str:
    """A sequence length as the tables print it: whole multiples of 1024 as "2k"."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def kind_label(dtype: str, causal: bool, head_dim: int, gqa: int, seq_q: int,
               seq_k: int) -> str:
    """The short name of a problem's kind, e.g. "bf16 c D128 g4 2k": dtype, c(ausal) or
    f(ull), head dim, query heads per key/value head (GQA; left out where it is 1), and the
    lengths ("512/2k" where Nq and Nk differ). Short so that a table row fits 80 columns;
    the CLI's help explains it."""
    lengths = (length_label(seq_q) if seq_q == seq_k
               else f"{length_label(seq_q)}/{length_label(seq_k)}")
    group = f" g{gqa}" if gqa > 1 else ""
    return f"{dtype} {'c' if causal else 'f'} D{head_dim}{group} {lengths}"


def problem_label(p: Problem) -> str:
    """`kind_label` of a whole problem, then its batch and query heads: "bf16 c D128 g4 2k
    B8 H32"; a modified problem adds its modifier key ("... B3 H2 w", "... v4")."""
    cache = f" {p.modifier_key}" if p.modifier_key else ""
    if isinstance(p, DecodeProblem):
        cache = f" p{p.page_size}" if p.page_size else " contig"
    return (f"{kind_label(p.dtype, p.causal, p.head_dim, p.group, p.seq_q, p.seq_k)} "
            f"B{p.batch} H{p.heads_q}{cache}")


def shape_text(p: Problem) -> str:
    """`p` as `--shape` takes it: B,Hq,Hkv,Nq,Nk,D."""
    return ",".join(map(str, (p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim)))


def tune_command(device: DeviceInfo, problem: Problem, mode: str = "both") -> str:
    """The `flashgen tune` line that tunes `problem`'s kind on `device`, for hints: the CPU
    interpreter needs `--device cpu` (and a GPU index would be wrong there), a GPU the index
    under which this process sees that model. An fp8 problem's line says --mode fwd, the
    only mode fp8 has."""
    where = "--device cpu" if device.is_interpreter else f"--gpu {cuda_index(device)}"
    if problem.dtype == "fp8":
        mode = "fwd"  # fp8 tunes the forward only: `tune` refuses --mode both, bwd and decode
    page = (f" --page-size {problem.page_size}"
            if isinstance(problem, DecodeProblem) and mode == "decode" else "")
    return (f"flashgen tune {where} --shape {shape_text(problem)} --dtype {problem.dtype} "
            f"--causal {'yes' if problem.causal else 'no'} --mode {mode}{page}")

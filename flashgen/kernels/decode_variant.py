"""One point of the decode (flash-decoding) kernels' search space."""

from __future__ import annotations

from dataclasses import dataclass

from flashgen.kernels.knobs import Knobs


@dataclass(frozen=True)
class DecodeVariant(Knobs):
    """Everything that tells two decode launches apart (templates/attn_decode_split.py.jinja).

    block_m: packed query rows per program (GQA packing: the Hq / Hkv query heads sharing a
        K/V head times the Nq queries fill the tile's rows). Below GROUP x Nq the rows take
        several programs, each reading the K/V head again; above it rows are wasted.
    block_n: keys per inner step: fewer loop trips and more bytes in flight against a bigger
        score tile.
    num_splits: how many runs of keys each sequence is cut into, one program each, merged by
        the combine kernel. 0 lets the launcher pick enough to give every SM about two
        programs (`runtime.kvcache.auto_splits`); 1 runs the split kernel alone (no combine).
    num_warps / num_stages: warps per program and pipelining depth of the K/V loads.
    fused_combine: the last split of each tile to finish merges all of them (an arrival
        counter per tile), so a call is one launch, not a split pass and a combine kernel:
        less host time and no second kernel's start on short caches, against one program
        per tile doing the merge alone.
    hoisted: each key's row offset split into what no tile changes (its slot in its page,
        its page id's place in the tile), computed once before the K/V loop, and what a
        step adds (the tile's start, or its page ids). Fewer integer instructions a step,
        which is what bounds a program streaming its run alone (few programs per SM); off
        renders the kernels the rows tuned before the knob ran.
    """

    kind = "decode variant"
    block_m: int = 16
    block_n: int = 64
    num_splits: int = 0
    num_warps: int = 4
    num_stages: int = 2
    fused_combine: bool = False
    hoisted: bool = False

    def __str__(self) -> str:
        splits = f"x{self.num_splits}" if self.num_splits else "xauto"
        return (f"decode m{self.block_m} n{self.block_n} {splits} "
                f"w{self.num_warps} s{self.num_stages}{' fused' if self.fused_combine else ''}"
                f"{' hoisted' if self.hoisted else ''}")

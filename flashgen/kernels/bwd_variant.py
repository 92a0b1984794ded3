"""One point of the backward kernels' search space."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from flashgen.kernels.knobs import Knobs

DqMode = Literal["separate", "atomic"]
DQ_MODES: tuple[str, ...] = ("separate", "atomic")
Fa3Kernels = Literal["none", "dq", "both"]
FA3_KERNELS: tuple[str, ...] = ("none", "dq", "both")


@dataclass(frozen=True)
class BwdVariant(Knobs):
    """Everything that tells two generated backward passes apart.

    The backward runs up to three kernels: preprocessing (delta = rowsum(dO * O)), dK/dV
    (each program owns `block_owned` keys and streams query blocks of `block_streamed` rows
    past them), and dQ (each program owns `block_owned` query rows and streams key blocks of
    `block_streamed`).

    block_owned: the tile a program owns and accumulates in fp32 registers (keys in dK/dV,
        query rows in dQ). block_streamed: the tile streamed past it per inner step (query
        rows in dK/dV, keys in dQ). The two kernels share the pair rather than having knobs
        of their own because in both the owned tile wants to be the big one (it sets how
        often each streamed load is reused) and the streamed one the small one (it sets the
        score tiles' register cost); two more independent knobs would square the search
        space for little gain. The templates keep their own terms (BLOCK_M query rows,
        BLOCK_N keys); `bwd_render` maps the pair onto them.
    num_warps / num_stages: warps per program and pipelining depth of the streamed loads, for
        the dK/dV and dQ kernels alike.
    dq_mode: "separate" runs the dQ kernel (deterministic, recomputes S and dP); "atomic" adds
        each K block's share of dQ into an fp32 buffer inside the dK/dV kernel (no recompute,
        but reduce traffic, the buffer and a run-to-run nondeterministic sum order): fp32
        atomics in the Triton kernel; with fa3 "both", TMA reduces in the Gluon one
        (FlashAttention 3's five-product backward). "dq" names the Gluon dQ kernel, which the
        atomic mode does not launch.
    fa3: which kernels are the Gluon (FlashAttention-3 style, Hopper) ones: "none", "dq" (the
        dQ kernel; dK/dV stays Triton's) or "both". Their consumer warpgroups own 64 rows each
        (block_owned / 64 of them, 4 warps each, num_warps = 4), a producer warp feeds them by TMA.
        On an H100 (each kernel alone against the Triton one) the Gluon dK/dV kernel ran
        1.10-1.26x at D128 and 0.82-0.99x at D64, the Gluon dQ kernel 1.06-1.47x with 64- or
        128-key tiles (docs/backward-kernels.md). "dq" pairs the Triton dK/dV kernel with the
        Gluon dQ one.
    dq_block_streamed: the keys the Gluon dQ kernel streams per step; 0 takes block_streamed.
        Why a knob of its own: the Triton dK/dV kernel does best streaming 32 queries at D64
        (block_streamed 32),
        while the Gluon dQ kernel ran 1.06-1.19x the Triton one with 64- or 128-key tiles and
        0.76-0.86x with 32 (H100, each kernel alone). With dQ tied to block_streamed, "dq" won no
        fa-bench key. Only the Gluon dQ kernel reads it (rule-checked).
    fused_delta: the dQ kernel (Triton's or Gluon's) works out delta = rowsum(dO * O) for
        its own rows (it has dO on chip already) and stores it, and runs before the dK/dV
        kernel, which reads it: two launches instead of three, and O and dO read once less
        by a separate pass. Only where there is a dQ kernel, dq_mode 'separate'
        (rule-checked).
    smem_stats: the Gluon dK/dV kernel (the wide one too) takes each streamed block's LSE
        and delta from a shared-memory ring that a warp of their own fills, not from global
        memory in every consumer thread (rule-checked; docs/backward-kernels.md).
    lpt: under the causal mask the Gluon kernels' programs differ in work (dK/dV's first key
        block sees every query block, its last only a few; dQ the other way round), and
        launched in grid order the heaviest of the last heads started last, leaving a
        ragged final wave. With lpt (longest processing time first) they start heaviest
        first, a few heads at a time so those heads' streamed rows stay in L2: +1-8% on the
        backward alone at D64 and D128, N2k-8k (H100). Causal dense problems with a Gluon
        kernel only (rule-checked; the wide D256 dK/dV kernel keeps grid order).
    """

    kind = "backward variant"
    renamed: ClassVar[dict[str, str]] = {"block_m": "block_streamed", "block_n": "block_owned",
               "dq_block_m": "dq_block_streamed"}
    block_streamed: int = 64
    block_owned: int = 128
    num_warps: int = 8
    num_stages: int = 2
    dq_mode: DqMode = "separate"
    fa3: Fa3Kernels = "none"
    dq_block_streamed: int = 0
    fused_delta: bool = False
    smem_stats: bool = False
    lpt: bool = False

    def __str__(self) -> str:
        # "own128x32": 128 owned rows crossed with 32-row streamed tiles; "dq-x64": the Gluon
        # dQ kernel's own streamed tile.
        fa3 = {"none": "", "dq": " fa3-dq", "both": " fa3"}.get(self.fa3, f" fa3={self.fa3}")
        return (
            f"bwd-{self.dq_mode} own{self.block_owned}x{self.block_streamed} "
            f"w{self.num_warps} s{self.num_stages}{fa3}"
            + (f" dq-x{self.dq_block_streamed}" if self.dq_block_streamed else "")
            + (" fused-delta" if self.fused_delta else "")
            + (" smem-stats" if self.smem_stats else "")
            + (" lpt" if self.lpt else "")
        )

    @property
    def deterministic(self) -> bool:
        """Whether its gradients are bitwise equal from run to run: the atomic dQ mode adds
        fp32 shares in whatever order programs reach them (Triton or Gluon kernel); the
        separate mode's programs own their rows (GQA dK/dV is summed on chip)."""
        return self.dq_mode == "separate"

    def gluon(self, kernel: str) -> bool:
        """Whether backward kernel `kernel` ("preprocess", "dkdv", "dq") is a Gluon one (the
        atomic mode launches no dQ kernel: its dQ comes from the dK/dV kernel)."""
        return (kernel == "dq" and self.fa3 in ("dq", "both") and self.dq_mode == "separate"
                ) or (kernel == "dkdv" and self.fa3 == "both")

    def streamed(self, kernel: str) -> int:
        """Rows of the tile that backward kernel `kernel` streams past its owned one per step:
        queries in dK/dV, keys in dQ (`dq_block_streamed` where the Gluon dQ kernel has one)."""
        if kernel == "dq" and self.gluon("dq") and self.dq_block_streamed:
            return self.dq_block_streamed
        return self.block_streamed

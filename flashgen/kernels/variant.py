"""One point of the kernel search space, and the hand-picked default used before any tuning."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Literal

from flashgen.kernels.knobs import Knobs

LoopOrder = Literal["fa1", "fa2", "fa3"]
LOOP_ORDERS: tuple[str, ...] = ("fa2", "fa1", "fa3")


@dataclass(frozen=True)
class Variant(Knobs):
    """Everything that tells two generated forward kernels apart.

    loop_order: "fa2" gives each program one Q block and streams K/V blocks past it (FlashAttention
        2); "fa1" is the 2022 paper's order: K/V blocks outer, Q blocks inner, with the running
        O, m and l kept in GPU memory between steps (one program per batch and head); "fa3"
        (Hopper, fp16/bf16, head dim 64 or 128) is fa2's order written in Gluon the
        FlashAttention 3 way: a TMA producer warp, one to three consumer warpgroups of
        16 x num_warps rows each (block_m / (16 x num_warps) of them), and the softmax of one
        K/V tile running under the tensor-core product of the previous one.
    block_m / block_n: rows of Q / K-V per tile. Larger tiles reuse more data per load but need
        more registers and shared memory.
    num_warps: warps per program. num_stages: software-pipelining depth of the K/V loads.
    split_mask (fa2): run K/V tiles that every row of the Q tile sees without masks, masking only
        the causal diagonal stretch and the ragged last tile.
    warp_specialize (fa2, Hopper): Triton's warp specialization of the unmasked main loop.
    use_tma (fa2, Hopper): Q, K, V and O move through TMA tensor descriptors (the bulk tensor
        copy engine) instead of pointer loads; needs 16-byte aligned rows.
    programs_per_sm: 0 launches one program per Q tile; k > 0 caps the grid near k programs
        per SM (a persistent grid), each walking several Q tiles (longest first under a causal
        mask), which trims the last wave's idle SMs and the per-program setup. fa2 takes k in
        PROGRAMS_PER_SM, each program walking the tiles of its head; fa3 takes 1 only (its
        tiles fill an SM's shared memory), one program walking tiles of every head, its
        producer loading the next tile's Q and K/V while the consumers finish the current one.
    pingpong (fa3, persistent, two or three consumers): the consumers take turns to issue their
        tensor-core products (FlashAttention 3's ping-pong), so one consumer's products run
        under the others' softmax; faster at D128, slower at D64 on an H100 (docs/fa3-hopper.md).
    head_units (fa3, persistent, causal): a program takes a whole head's Q tiles at a time
        (its pairs one after the other: longest, shortest, next longest, ...) instead of one
        pair, so every tile after the first reads K/V the same program has just read. At D64
        N512 (m128 n128 s3, H100) it ran 0.996x cuDNN where pairs ran 0.90x (the best pair
        point 0.98x); at D128 it ran 0.75x against 0.99x (docs/fa3-hopper.md). Dispatch
        serves it only with heads enough to keep the programs as busy as pairs would
        (`runtime.table.head_units_leave_programs_idle`).
    """

    renamed: ClassVar[dict[str, str]] = {"persistent": "programs_per_sm"}

    loop_order: LoopOrder = "fa2"
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    split_mask: bool = True
    warp_specialize: bool = False
    use_tma: bool = False
    programs_per_sm: int = 0
    pingpong: bool = False
    head_units: bool = False

    @property
    def needs_tma(self) -> bool:
        """Whether the kernel reads its inputs through TMA descriptors (16-byte aligned rows)."""
        return self.use_tma or self.loop_order == "fa3"

    @property
    def fa3_rows(self) -> int:
        """Query rows of one fa3 consumer warpgroup: 16 a warp (the warpgroup MMA's M is 64
        rows per four warps). Also the block of Q and O that one TMA copy moves."""
        return 16 * self.num_warps

    @property
    def fa3_consumers(self) -> int:
        """fa3 consumer warpgroups per program: each takes fa3_rows of the block_m rows."""
        return self.block_m // self.fa3_rows

    def pointer_twin(self) -> Variant:
        """The same tiles, warps and stages with plain pointer loads: what runs on inputs
        that TMA cannot address (and what ahead-of-time export compiles), computing the same
        function."""
        if self.loop_order == "fa3":
            # fa2's persistent grid is another schedule (measured 0.43-0.98x of its
            # one-program-per-tile grid on an H100): the twin keeps the plain one.
            # fa3's 192-row tile (three consumers) has no fa2 kernel: fa2 ranges need a power
            # of two, so the twin takes 128 rows.
            return replace(self, loop_order="fa2", use_tma=False, programs_per_sm=0,
                           pingpong=False, head_units=False, block_m=min(self.block_m, 128))
        return replace(self, use_tma=False)

    def __str__(self) -> str:
        flags = "".join(
            name
            for name, on in ((" nosplit", not self.split_mask), (" ws", self.warp_specialize),
                             (" tma", self.use_tma),
                             (f" p{self.programs_per_sm}", self.programs_per_sm),
                             (" pp", self.pingpong), (" heads", self.head_units))
            if on
        )  # fmt: skip
        return (
            f"{self.loop_order} m{self.block_m} n{self.block_n} "
            f"w{self.num_warps} s{self.num_stages}{flags}"
        )

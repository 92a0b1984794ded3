"""Experiment, not part of the package: the fa3 forward with two schedules still to measure.

`templates/attn_fwd_fa3.py.jinja` is the kernel whose design was measured on an H100
(NOTES.md, 2026-11-23). This file is that kernel with two switches the next GPU session is to
measure with `experiments/run_fa3_next.py` before either enters the template:

  PINGPONG    two consumers take turns issuing their tensor-core products (FlashAttention
              3's ping-pong, which its paper credits with ~9%): consumer c's k-th issue waits
              on mbarrier turn[c] at parity (k & 1) ^ (1 - c), so consumer 0 goes first (a
              fresh mbarrier passes parity 1), and passes the turn by arriving on turn[1 - c].
  PERSISTENT  one program per SM walks (head, Q tile) pairs, longest causal tiles first. The
              producer runs into the next tile while the consumers finish the current one: its
              Q sub-tiles load as soon as a consumer's last Q K^T product is done (q_free) and
              its K/V tiles continue the same ring. O is staged in its own shared buffer (the
              previous tile's TMA store is waited for just before the buffer is rewritten), so
              Q can be replaced while O is still being written. At N=512 a program of the
              non-persistent kernel lives ~2.3 us, of which the first TMA round trip is a large
              part; this hides it.

Both switches are compile-checked for sm90a on the CPU (`python experiments/run_fa3_next.py`
without a GPU), never run on a GPU yet. ptxas reports 150-240 bytes of spills at D128 with
128-key tiles (none with 64-key tiles): the tile loop keeps more alive than the template's
single tile; the hot K/V loop itself looked free of them in the SASS.

K/V ring positions and mbarrier phases count across tiles (`g`), so
a program's consumers and producer must walk the same tile sequence, which they do: both
compute it from the program id alone.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def _tile(t, num_m, H_Q, GROUP, N_Q, N_K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          CAUSAL: gl.constexpr):
    """Coordinates and K/V extent of tile t: (batch, head, kv head, first row, tiles, full)."""
    bh = t // num_m
    m = t % num_m
    if CAUSAL:
        m = num_m - 1 - m  # the longest tiles first
    off_b = bh // H_Q
    off_h = bh % H_Q
    q_row = m * BLOCK_M
    causal_offset = N_K - N_Q
    if CAUSAL:
        hi = gl.minimum(N_K, q_row + BLOCK_M + causal_offset)
        n_full = gl.minimum(gl.maximum(q_row + causal_offset + 1, 0) // BLOCK_N, N_K // BLOCK_N)
    else:
        hi = N_K
        n_full = N_K // BLOCK_N
    n_blocks = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)
    return off_b, off_h, off_h // GROUP, q_row, n_blocks, n_full


@gluon.jit
def _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready,
             kv_free, total, num_m, H_Q, GROUP, N_Q, N_K,
             BLOCK_M: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr):
    g = 0
    it = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        off_b, off_h, off_hkv, q_row, n_blocks, _n_full = _tile(
            t, num_m, H_Q, GROUP, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
        for c in gl.static_range(CONSUMERS):
            mbarrier.wait(q_free.index(c), (it & 1) ^ 1)
            mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [off_b, off_h, q_row + c * ROWS, 0],
                                            q_ready.index(c), q_smem.index(c))
        for j in range(n_blocks):
            slot = g % STAGES
            mbarrier.wait(kv_free.index(slot), ((g // STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [off_b, off_hkv, j * BLOCK_N, 0],
                                            k_ready.index(slot), k_smem.index(slot))
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [off_b, off_hkv, j * BLOCK_N, 0],
                                            v_ready.index(slot), v_smem.index(slot))
            g += 1
        it += 1


@gluon.jit
def _mask_scores(s, j, n_full, offs_m, offs_n, N_K, causal_offset,
                 BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    if j >= n_full:
        cols = j * BLOCK_N + offs_n
        keep = gl.expand_dims(cols < N_K, 0)
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(offs_m + causal_offset, 1))
        s = gl.where(keep, s, float("-inf"))
    return s


@gluon.jit
def _softmax_rows(s, m_i, qk_scale):
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_safe, 1))
    return m_new, alpha, p


@gluon.jit
def _take_turn(turn, k, CID: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.wait(turn.index(CID), (k & 1) ^ (1 - CID))


@gluon.jit
def _pass_turn(turn, CID: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - CID), count=1)


@gluon.jit
def _consume(q_smem, o_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, kv_free, turn,
             o_desc, LSE, stride_lb, stride_lh, total, num_m, H_Q, GROUP, N_Q, N_K, qk_scale,
             BLOCK_M: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
             BLOCK_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
             WARPS: gl.constexpr, PINGPONG: gl.constexpr, CID: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype
    q_tile = q_smem.index(CID)
    q = q_tile.reshape([ROWS, BLOCK_D])
    o_tile = o_smem.index(CID)
    causal_offset = N_K - N_Q

    g = 0  # K/V ring position, shared with the producer's count
    it = 0  # tiles done by this program
    k = 0  # tensor-core issues so far (ping-pong turns)
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        off_b, off_h, _off_hkv, q_row, n_blocks, n_full = _tile(
            t, num_m, H_Q, GROUP, N_Q, N_K, BLOCK_M, BLOCK_N, CAUSAL)
        q_row = q_row + CID * ROWS
        offs_m = q_row + gl.arange(0, ROWS, layout=rows_s)
        # Made per tile, not kept live across tiles: registers are what this kernel lacks.
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        mbarrier.wait(q_ready.index(CID), it & 1)

        slot = g % STAGES
        mbarrier.wait(k_ready.index(slot), (g // STAGES) & 1)
        kt = k_smem.index(slot).reshape([BLOCK_N, BLOCK_D]).permute((1, 0))
        _take_turn(turn, k, CID, PINGPONG)
        s = warpgroup_mma(q, kt, zero_s, use_acc=False, is_async=True)
        _pass_turn(turn, CID, PINGPONG)
        k += 1
        s = warpgroup_mma_wait(0, deps=(s,))
        s = _mask_scores(s, 0, n_full, offs_m, offs_n, N_K, causal_offset, BLOCK_N, CAUSAL)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, rows_s)
        m_i, alpha, p = _softmax_rows(s, m_i, qk_scale)
        l_i = gl.sum(p, 1)
        acc = gl.zeros([ROWS, BLOCK_D], gl.float32, o_layout)

        for j in range(1, n_blocks):
            cur = g + j
            slot = cur % STAGES
            prev = (cur - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), (cur // STAGES) & 1)
            mbarrier.wait(v_ready.index(prev), ((cur - 1) // STAGES) & 1)
            kt = k_smem.index(slot).reshape([BLOCK_N, BLOCK_D]).permute((1, 0))
            v = v_smem.index(prev).reshape([BLOCK_N, BLOCK_D])
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            _take_turn(turn, k, CID, PINGPONG)
            s_tok = warpgroup_mma(q, kt, zero_s, use_acc=False, is_async=True)
            o_tok = warpgroup_mma(p_op, v, acc, is_async=True)
            _pass_turn(turn, CID, PINGPONG)
            k += 1
            s = warpgroup_mma_wait(1, deps=(s_tok,))
            s = _mask_scores(s, j, n_full, offs_m, offs_n, N_K, causal_offset, BLOCK_N, CAUSAL)
            m_i, alpha, p = _softmax_rows(s, m_i, qk_scale)
            l_i = l_i * alpha + gl.sum(p, 1)
            acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
            mbarrier.arrive(kv_free.index(prev), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, rows_o), 1)

        # Every Q K^T product of this tile is done: the producer may load the next tile's Q.
        mbarrier.arrive(q_free.index(CID), count=1)
        last = g + n_blocks - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        v = v_smem.index(last % STAGES).reshape([BLOCK_N, BLOCK_D])
        _take_turn(turn, k, CID, PINGPONG)
        o_tok = warpgroup_mma(p_op, v, acc, is_async=True)
        _pass_turn(turn, CID, PINGPONG)
        k += 1
        acc, p_op = warpgroup_mma_wait(0, deps=(o_tok, p_op))
        mbarrier.arrive(kv_free.index(last % STAGES), count=1)
        g += n_blocks

        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        out = acc / gl.expand_dims(gl.convert_layout(l_safe, rows_o), 1)
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
        tma.store_wait(pendings=0)  # the previous tile's O has left o_tile
        o_tile.reshape([ROWS, BLOCK_D]).store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [off_b, off_h, q_row, 0], o_tile)
        lse_ptr = LSE + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh
        gl.store(lse_ptr + offs_m, lse, mask=offs_m < N_Q)
        it += 1
    tma.store_wait(pendings=0)


@gluon.jit
def attn_fwd(q_desc, k_desc, v_desc, o_desc, LSE, stride_lb, stride_lh, sm_scale, N_Q, N_K,
             H_Q, GROUP, BH,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             BLOCK_D: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG_ON: gl.constexpr):
    WARPS: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = 16 * WARPS
    CONSUMERS: gl.constexpr = BLOCK_M // ROWS
    gl.static_assert(CONSUMERS * ROWS == BLOCK_M)
    PINGPONG: gl.constexpr = PINGPONG_ON and CONSUMERS == 2
    num_m = gl.cdiv(N_Q, BLOCK_M)
    total = num_m * BH
    qk_scale = sm_scale * 1.4426950408889634

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape,
                                       q_desc.layout)
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS] + o_desc.block_type.shape,
                                       o_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape,
                                       k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape,
                                       v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(c), count=1)
        mbarrier.init(q_free.index(c), count=1)
        mbarrier.init(turn.index(c), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=CONSUMERS)

    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consume, (q_smem, o_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready,
                        kv_free, turn, o_desc, LSE, stride_lb, stride_lh, total, num_m, H_Q,
                        GROUP, N_Q, N_K, qk_scale, BLOCK_M, ROWS, BLOCK_N, BLOCK_D, STAGES,
                        CAUSAL, WARPS, PINGPONG, 0)),
            (_consume, (q_smem, o_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready,
                        kv_free, turn, o_desc, LSE, stride_lb, stride_lh, total, num_m, H_Q,
                        GROUP, N_Q, N_K, qk_scale, BLOCK_M, ROWS, BLOCK_N, BLOCK_D, STAGES,
                        CAUSAL, WARPS, PINGPONG, 1)),
            (_produce, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready,
                        v_ready, kv_free, total, num_m, H_Q, GROUP, N_Q, N_K, BLOCK_M, ROWS,
                        BLOCK_N, STAGES, CONSUMERS, CAUSAL)),
        ], [WARPS, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_consume, (q_smem, o_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready,
                        kv_free, turn, o_desc, LSE, stride_lb, stride_lh, total, num_m, H_Q,
                        GROUP, N_Q, N_K, qk_scale, BLOCK_M, ROWS, BLOCK_N, BLOCK_D, STAGES,
                        CAUSAL, WARPS, PINGPONG, 0)),
            (_produce, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready,
                        v_ready, kv_free, total, num_m, H_Q, GROUP, N_Q, N_K, BLOCK_M, ROWS,
                        BLOCK_N, STAGES, CONSUMERS, CAUSAL)),
        ], [1], [24])

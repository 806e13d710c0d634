"""Gluon (Triton's tile-level dialect) kernel for Hopper: the training block's forward in one launch,
``qkv = x W^T`` with RoPE + RMSNorm of the query and key heads in the GEMM's epilogue (issue 24).

Why Gluon: in Triton's own language the epilogue runs on the MMA warps between two tiles and the
rotate-half split of the accumulator goes through shared memory (session 11: spills, or half-width
MMAs at 2x cuBLAS). Here the layouts and the warp roles are explicit:

* a persistent grid, tiles ``[BM, D]`` (one head each) in ``GROUP_M`` tile-row groups;
* a producer warp streams x ``[BM, BK]`` and W ``[D, BK]`` tiles by TMA into a ``STAGES``-deep ring
  (``ready``/``empty`` mbarriers);
* two consumer warpgroups take alternate tiles ("ping-pong"): a pair of turn barriers lets one
  issue its K loop of async wgmma while the other runs its epilogue, so the epilogue is hidden
  behind the other's MMAs;
* the epilogue splits the ``[BM, D]`` fp32 accumulator into its RoPE halves ``[BM, D/2]`` by
  register renaming alone (in the wgmma layout column ``D/2`` is a register bit;
  ``convert_layout(..., assert_trivial=True)`` fails the compile on any data movement), rounds it
  to the output dtype, stores ``qkv`` through shared memory and TMA, and for a query or key head
  norms and rotates it (fp32; the row sum is two quad shuffles) and stores q/k (token-major
  ``[tokens, H*D]``) and rstd.

Semantics are the forward stage's (``rope_qk_norm_fwd.py``) for the plain block: the norm and
RoPE see the projection rounded to its dtype, fp32 math, one rounding of q/k; NeoX rotate-half over
the whole head, cos/sin per element; ``NORM_AFTER_ROPE``; ``NORM_WEIGHT`` (else unweighted). The
plan keeps cuBLAS + the stage for every other variant.

FP8 (``SCALES``, issue 35): x and W as e4m3 codes (K-major both, as wgmma's 8-bit operands must be;
``BK`` twice the 16-bit one, the same bytes per ring stage), the fp32 accumulator (wgmma's own, fast
accumulation) multiplied by the recipe's inverse scales before the rounding to the output dtype, as
``torch._scaled_mm`` applies them on sm_90: ``SCALES == 1`` (rowwise) ``x_scale[row] * (w_scale[col] *
acc)``, the order of torch's CUTLASS rowwise kernel (cuBLASLt's outer-vector scales, which torch 2.11
calls instead, do not document one: the rowwise recipes' power-of-two scales make every order exact);
``SCALES == 2`` (tensorwise) ``acc * (x_scale * w_scale)``, the two scalars folded into one product as
CUTLASS's scalar epilogue folds them. The epilogue after it is the 16-bit one.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

CONSUMER_WARPS = gl.constexpr(4)  # one warpgroup per consumer
# the TMA copies: async_copy_global_to_shared / async_copy_shared_to_global up to Triton 3.7, renamed
# async_load / async_store in 3.8 (the old names kept as aliases) and removed in 3.9
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _tile_origin(tile, n_m, n_n, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
    """(first row, first column) of the ``tile``-th tile: groups of ``GROUP_M`` tile rows sweep the
    column tiles together (x's row tiles and W's column tiles shared in L2)."""
    per_group = GROUP_M * n_n
    first = (tile // per_group) * GROUP_M
    rows = gl.minimum(n_m - first, GROUP_M)
    within = tile % per_group
    return (first + within % rows) * BM, (within // rows) * BN


@gluon.constexpr_function
def _acc_layout(BN, K=16):
    """A warpgroup's wgmma accumulator ``[*, BN]``; ``K``: the instruction's K, 32 bytes of the operands (16
    for 16-bit, 32 for 8-bit ones). The registers' layout is K's alone: the epilogue's halves use 16."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS.value, 1], instr_shape=[16, BN, K])


@gluon.constexpr_function
def _halves_layout(BM, W):
    """The ``[BM, W/2, 2]`` view (reshape ``[BM, 2, W/2]``, permute (0, 2, 1)) of a ``[BM, W]`` wgmma
    accumulator of one warpgroup, as linear-layout bases (row, column in the half, half): registers
    hold column 1, row 8, columns 8..W/4, the half, then rows 64..; lanes columns 2, 4 and rows 1, 2,
    4; warps rows 16, 32. The half is a register bit, so splitting moves no data."""
    H = W // 2

    def col(c):
        return [0, c % H, c // H]

    reg = [col(1), [8, 0, 0]]
    c = 8
    while c < W:
        reg.append(col(c))
        c *= 2
    r = 64
    while r < BM:
        reg.append([r, 0, 0])
        r *= 2
    lane = [col(2), col(4), [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    warp = [[16, 0, 0], [32, 0, 0]]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[],
                                      shape=[BM, H, 2])


@gluon.jit
def _halves(acc, BM: gl.constexpr, W: gl.constexpr):
    """(columns [0, W/2), columns [W/2, W)) of a ``[BM, W]`` accumulator, each in the wgmma layout of
    width W/2: register renaming only."""
    x3 = gl.convert_layout(gl.permute(gl.reshape(acc, [BM, 2, W // 2]), (0, 2, 1)), _halves_layout(BM, W),
                           assert_trivial=True)
    lo, hi = gl.split(x3)
    half: gl.constexpr = _acc_layout(W // 2)
    return gl.convert_layout(lo, half, assert_trivial=True), gl.convert_layout(hi, half, assert_trivial=True)


@gluon.jit
def _steps(K, R, BK: gl.constexpr, LORA: gl.constexpr):
    """(K steps of x W^T, all K steps of a tile): with ``LORA`` the adapters' ``[x | U] [W | B]^T``
    columns follow x's, in ``BK`` steps of U ``[tokens, R]`` and B ``[N, R]`` (the TMA fills the
    columns past R with zeros)."""
    k_steps = gl.cdiv(K, BK)
    if LORA:
        return k_steps, k_steps + gl.cdiv(R, BK)
    return k_steps, k_steps


@gluon.jit
def _ring_load(a_desc, b_desc, off_m, off_n, k, a_bufs, b_bufs, ready, empty, it, nbytes: gl.constexpr,
               STAGES: gl.constexpr):
    """The ``it``-th ring slot: once free, the ``[BM, BK]`` box of ``a_desc`` at (off_m, k) and the
    ``[BN, BK]`` box of ``b_desc`` at (off_n, k) into it."""
    s = it % STAGES
    # a fresh barrier passes a wait on parity 1: the ring's first lap waits for nothing
    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(s), nbytes)
    _tma_load(a_desc, [off_m, k], ready.index(s), a_bufs.index(s))
    _tma_load(b_desc, [off_n, k], ready.index(s), b_bufs.index(s))


@gluon.jit
def _producer(x_desc, w_desc, u_desc, b_desc, x_bufs, w_bufs, ready, empty, M, N, K, R,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              LORA: gl.constexpr):
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_m = gl.cdiv(M, BM)
    n_n = gl.cdiv(N, BN)
    k_steps, n_steps = _steps(K, R, BK, LORA)
    nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
    it = 0  # position in the ring over all of this program's tiles
    for tile in range(pid, n_m * n_n, nprog):
        off_m, off_n = _tile_origin(tile, n_m, n_n, BM, BN, GROUP_M)
        for kk in range(k_steps):
            _ring_load(x_desc, w_desc, off_m, off_n, kk * BK, x_bufs, w_bufs, ready, empty, it, nbytes, STAGES)
            it += 1
        if LORA:  # the same ring slots: U's and B's boxes are x's and W's shapes and dtype
            for kk in range(n_steps - k_steps):
                _ring_load(u_desc, b_desc, off_m, off_n, kk * BK, x_bufs, w_bufs, ready, empty, it, nbytes, STAGES)
                it += 1


@gluon.jit
def _rope(x1, x2, c1, c2, s1, s2):
    # x*cos + rotate_half(x)*sin on the two halves, fp32 (the stage's _rope_fwd_2d)
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@gluon.constexpr_function
def _chunk_layout(RC, HALF):
    """Rows of a half-head chunk ``[RC, HALF]``: 8 consecutive columns per thread (16-byte loads of
    cos/sin and of shared memory), a row over HALF/8 lanes."""
    lanes_c = min(32, HALF // 8)
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // lanes_c, lanes_c],
                            warps_per_cta=[CONSUMER_WARPS.value, 1], order=[1, 0])


@gluon.jit
def _cos_sin_chunk(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, off_m, c, M, S, live,
                   RC: gl.constexpr, HALF: gl.constexpr):
    """cos/sin of rows [off_m + c*RC, +RC), both halves, as loaded (converted where used, so a
    prefetched chunk holds 16-bit pairs), and the rows' batch and position; nothing is read unless
    ``live``."""
    layout: gl.constexpr = _chunk_layout(RC, HALF)
    cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
    rows = off_m + c * RC + gl.arange(0, RC, layout=gl.SliceLayout(1, layout))
    # (batch, position) of each row: one 32-bit division (tokens < 2**31), 64-bit offsets
    b32 = rows // S
    b = b32.to(gl.int64)
    s = (rows - b32 * S).to(gl.int64)
    m2 = gl.expand_dims((rows < M) & live, 1)
    cs_row = gl.expand_dims(b * scos_b + s * scos_s, 1)
    sn_row = gl.expand_dims(b * ssin_b + s * ssin_s, 1)
    c1 = gl.load(cos_ptr + cs_row + gl.expand_dims(cols * scos_d, 0), mask=m2, other=1.0)
    c2 = gl.load(cos_ptr + cs_row + gl.expand_dims((cols + HALF) * scos_d, 0), mask=m2, other=1.0)
    s1 = gl.load(sin_ptr + sn_row + gl.expand_dims(cols * ssin_d, 0), mask=m2, other=0.0)
    s2 = gl.load(sin_ptr + sn_row + gl.expand_dims((cols + HALF) * ssin_d, 0), mask=m2, other=0.0)
    return c1, c2, s1, s2, b, s


@gluon.jit
def _norm_weight_halves(wq_ptr, swq, wk_ptr, swk, is_q, HALF: gl.constexpr, RC: gl.constexpr):
    """The query's or the key's norm weight, both halves, fp32 ``[1, HALF]`` rows."""
    cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, _chunk_layout(RC, HALF)))
    mq = (cols < HALF) & is_q
    mk = (cols < HALF) & (not is_q)
    w1 = gl.load(wq_ptr + cols * swq, mask=mq, other=0.0) + gl.load(wk_ptr + cols * swk, mask=mk, other=0.0)
    w2 = (gl.load(wq_ptr + (cols + HALF) * swq, mask=mq, other=0.0)
          + gl.load(wk_ptr + (cols + HALF) * swk, mask=mk, other=0.0))
    return gl.expand_dims(w1.to(gl.float32), 0), gl.expand_dims(w2.to(gl.float32), 0)


@gluon.jit
def _norm_rope_chunk(part1, part2, cs, w1, w2, eps, D: gl.constexpr, layout: gl.constexpr,
                     NORM_AFTER_ROPE: gl.constexpr, NORM_WEIGHT: gl.constexpr):
    """One chunk of a head's halves in shared memory (the projection rounded to its dtype), its
    cos/sin ``cs``: RMS-normed and rotated in fp32, written back in place; returns its rstd."""
    c1 = cs[0].to(gl.float32)
    c2 = cs[1].to(gl.float32)
    s1 = cs[2].to(gl.float32)
    s2 = cs[3].to(gl.float32)
    x1 = part1.load(layout).to(gl.float32)
    x2 = part2.load(layout).to(gl.float32)
    if NORM_AFTER_ROPE:
        x1, x2 = _rope(x1, x2, c1, c2, s1, s2)
    ss = gl.sum(x1 * x1, axis=1) + gl.sum(x2 * x2, axis=1)
    r = 1.0 / gl.sqrt_rn(ss / D + eps)
    r2 = gl.expand_dims(r, 1)
    if NORM_WEIGHT:
        y1 = x1 * r2 * w1
        y2 = x2 * r2 * w2
    else:
        y1 = x1 * r2
        y2 = x2 * r2
    if not NORM_AFTER_ROPE:
        y1, y2 = _rope(y1, y2, c1, c2, s1, s2)
    part1.store(y1.to(part1.dtype))
    part2.store(y2.to(part2.dtype))
    return r


@gluon.jit
def _norm_rope_chunks(buf1, buf2, cs, w1, w2, r_ptr, sr_b, sr_h, sr_s, h,
                      cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, off_m, eps, M, S,
                      BM: gl.constexpr, D: gl.constexpr, RC: gl.constexpr, NORM_AFTER_ROPE: gl.constexpr,
                      NORM_WEIGHT: gl.constexpr):
    """One query or key head of tokens [off_m, off_m + BM), its halves in ``buf1``/``buf2``: RMS-normed
    and rotated in place, ``RC`` rows at a time (the whole [BM, D] tile's temporaries would not fit
    the registers), each chunk's cos/sin loaded while the chunk before is computed (``cs``: the
    first chunk's); its rstd stored. Unrolled, and called once for query and once for key heads."""
    HALF: gl.constexpr = D // 2
    layout: gl.constexpr = _chunk_layout(RC, HALF)
    for c in gl.static_range(BM // RC):
        if c + 1 < BM // RC:
            nxt = _cos_sin_chunk(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, off_m, c + 1, M,
                                 S, True, RC, HALF)
        r = _norm_rope_chunk(buf1.slice(c * RC, RC), buf2.slice(c * RC, RC), cs, w1, w2, eps, D, layout,
                             NORM_AFTER_ROPE, NORM_WEIGHT)
        rows = off_m + c * RC + gl.arange(0, RC, layout=gl.SliceLayout(1, layout))
        gl.store(r_ptr + cs[4] * sr_b + h * sr_h + cs[5] * sr_s, r, mask=rows < M)
        if c + 1 < BM // RC:
            cs = nxt


@gluon.jit
def _row_scales(xs_ptr, off_m, M, BM: gl.constexpr, BN: gl.constexpr):
    """x's inverse scales of rows [off_m, +BM) as ``[BM, 1]`` fp32, in the layout of the accumulator's halves."""
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, _acc_layout(BN // 2)))
    return gl.expand_dims(gl.load(xs_ptr + rows, mask=rows < M, other=0.0), 1)


@gluon.jit
def _col_scales(ws_ptr, off_n, BN: gl.constexpr):
    """W's inverse scales of columns [off_n, +BN/2) (W's rows: the output's columns) as ``[1, BN/2]`` fp32, in
    the layout of the accumulator's halves (N is a multiple of BN)."""
    cols = off_n + gl.arange(0, BN // 2, layout=gl.SliceLayout(0, _acc_layout(BN // 2)))
    return gl.expand_dims(gl.load(ws_ptr + cols), 0)


@gluon.jit
def _consumer(x_bufs, w_bufs, ready, empty, turn, bufs, qkv_desc, q_desc, k_desc, xs_ptr, ws_ptr,
              wq_ptr, swq, wk_ptr, swk, rq_ptr, srq_b, srq_h, srq_s, rk_ptr, srk_b, srk_h, srk_s,
              cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, eps, M, N, K, R, S, HQ, HKV,
              CID: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, FUSE: gl.constexpr, NORM_AFTER_ROPE: gl.constexpr, NORM_WEIGHT: gl.constexpr,
              RC: gl.constexpr, LORA: gl.constexpr, SCALES: gl.constexpr):
    acc_layout: gl.constexpr = _acc_layout(BN, 256 // x_bufs.dtype.primitive_bitwidth)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_m = gl.cdiv(M, BM)
    n_n = gl.cdiv(N, BN)
    k_steps, n_steps = _steps(K, R, BK, LORA)
    buf1 = bufs.index(2 * CID)  # this consumer's two [BM, BN/2] epilogue buffers
    buf2 = bufs.index(2 * CID + 1)
    j = CID  # the program's local tile index (the producer's order): the consumers alternate tiles
    lap = 0
    for tile in range(pid + CID * nprog, n_m * n_n, 2 * nprog):
        off_m, off_n = _tile_origin(tile, n_m, n_n, BM, BN, GROUP_M)
        it = j * n_steps  # ring position of the tile's first K step
        # ping-pong: consumer 0's first wait passes (parity 1 on a fresh barrier), consumer 1 waits for 0
        mbarrier.wait(turn.index(CID), (lap & 1) ^ (1 - CID))
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        for kk in range(n_steps):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            acc = warpgroup_mma(x_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, use_acc=kk > 0, is_async=True)
            # one wgmma in flight: the one before it is done, its stage goes back to the producer
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=kk > 0)
            it += 1
        mbarrier.arrive(turn.index(1 - CID))  # every wgmma of the tile issued: the other's turn
        _consumer_epilogue(acc, it, empty, buf1, buf2, qkv_desc, q_desc, k_desc, off_m, off_n, xs_ptr, ws_ptr,
                           wq_ptr, swq, wk_ptr, swk, rq_ptr, srq_b, srq_h, srq_s, rk_ptr, srk_b, srk_h, srk_s,
                           cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, eps, M, S, HQ,
                           HKV, BM, BN, STAGES, FUSE, NORM_AFTER_ROPE, NORM_WEIGHT, RC, SCALES)
        j += 2
        lap += 1
    tma.store_wait(0)


@gluon.jit
def _head_prefetch(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, wq_ptr, swq, wk_ptr, swk,
                   off_m, M, S, live, is_q, BN: gl.constexpr, RC: gl.constexpr, NORM_WEIGHT: gl.constexpr):
    """A query or key head's first chunk of cos/sin rows (nothing read unless ``live``) and its norm
    weight's halves (1.0 where unweighted)."""
    cs = _cos_sin_chunk(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, off_m, 0, M, S, live, RC,
                        BN // 2)
    if NORM_WEIGHT:
        w1, w2 = _norm_weight_halves(wq_ptr, swq, wk_ptr, swk, is_q, BN // 2, RC)
    else:
        w1 = 1.0
        w2 = 1.0
    return cs, w1, w2


@gluon.jit
def _consumer_epilogue(acc, it, empty, buf1, buf2, qkv_desc, q_desc, k_desc, off_m, off_n, xs_ptr, ws_ptr,
                       wq_ptr, swq, wk_ptr, swk, rq_ptr, srq_b, srq_h, srq_s, rk_ptr, srk_b, srk_h, srk_s,
                       cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, eps, M, S, HQ, HKV,
                       BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, FUSE: gl.constexpr,
                       NORM_AFTER_ROPE: gl.constexpr, NORM_WEIGHT: gl.constexpr, RC: gl.constexpr,
                       SCALES: gl.constexpr):
    """A consumer's epilogue of its [BM, BN] tile, hidden behind the other consumer's MMAs."""
    if FUSE:
        h = off_n // BN
        live = h < HQ + HKV
        is_q = h < HQ
        if SCALES == 0:  # a query or key head's first cos/sin rows and norm weight, loaded while the MMAs finish
            cs, w1, w2 = _head_prefetch(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, wq_ptr, swq,
                                        wk_ptr, swk, off_m, M, S, live, is_q, BN, RC, NORM_WEIGHT)
    if SCALES == 1:  # FP8: the scales instead (rowwise: 36 registers a thread)
        sx = _row_scales(xs_ptr, off_m, M, BM, BN)
        sw1 = _col_scales(ws_ptr, off_n, BN)
        sw2 = _col_scales(ws_ptr, off_n + BN // 2, BN)
    elif SCALES == 2:
        s_xw = gl.load(xs_ptr) * gl.load(ws_ptr)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))

    x1, x2 = _halves(acc, BM, BN)
    if SCALES == 1:  # fp32, before the one rounding (the module's docstring: _scaled_mm's order)
        x1 = (x1 * sw1) * sx
        x2 = (x2 * sw2) * sx
    elif SCALES == 2:
        x1 = x1 * s_xw
        x2 = x2 * s_xw
    tma.store_wait(0)  # the previous tile's copies have read the buffers
    buf1.store(x1.to(qkv_desc.dtype))
    buf2.store(x2.to(qkv_desc.dtype))
    fence_async_shared()
    _tma_store(qkv_desc, [off_m, off_n], buf1)
    _tma_store(qkv_desc, [off_m, off_n + BN // 2], buf2)
    if FUSE and SCALES != 0:  # FP8: the head's cos/sin and norm weight once the accumulator's registers are
        # free, while qkv's copies run (loaded with the scales, the rowwise build spilled: offline ptxas, session 23)
        cs, w1, w2 = _head_prefetch(cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, wq_ptr, swq,
                                    wk_ptr, swk, off_m, M, S, live, is_q, BN, RC, NORM_WEIGHT)
    if FUSE:
        if live:  # normed and rotated in place once qkv's copies have read the buffers
            tma.store_wait(0)
            if is_q:
                _norm_rope_chunks(buf1, buf2, cs, w1, w2, rq_ptr, srq_b, srq_h, srq_s, h, cos_ptr, scos_b,
                                  scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, off_m, eps, M, S, BM, BN, RC,
                                  NORM_AFTER_ROPE, NORM_WEIGHT)
                fence_async_shared()
                _tma_store(q_desc, [off_m, off_n], buf1)
                _tma_store(q_desc, [off_m, off_n + BN // 2], buf2)
            else:
                _norm_rope_chunks(buf1, buf2, cs, w1, w2, rk_ptr, srk_b, srk_h, srk_s, h - HQ, cos_ptr, scos_b,
                                  scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, off_m, eps, M, S, BM, BN, RC,
                                  NORM_AFTER_ROPE, NORM_WEIGHT)
                fence_async_shared()
                kcol = off_n - HQ * BN
                _tma_store(k_desc, [off_m, kcol], buf1)
                _tma_store(k_desc, [off_m, kcol + BN // 2], buf2)


@gluon.jit
def qkv_rope_norm_gemm_sm90_kernel(
    x_desc, w_desc, qkv_desc, q_desc, k_desc, u_desc, b_desc, xs_ptr, ws_ptr,
    wq_ptr, swq, wk_ptr, swk,
    rq_ptr, srq_b, srq_h, srq_s,
    rk_ptr, srk_b, srk_h, srk_s,
    cos_ptr, scos_b, scos_s, scos_d,
    sin_ptr, ssin_b, ssin_s, ssin_d,
    eps, M, N, K, R, S, HQ, HKV,
    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    FUSE: gl.constexpr, NORM_AFTER_ROPE: gl.constexpr, NORM_WEIGHT: gl.constexpr, RC: gl.constexpr,
    LORA: gl.constexpr, SCALES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """``x_desc`` x ``[tokens, K]`` in blocks ``[BM, BK]``; ``w_desc`` W ``[N, K]`` in blocks ``[BN, BK]``
    (BN = head_dim); ``qkv_desc``/``q_desc``/``k_desc`` ``[tokens, *]`` in blocks ``[BM, BN/2]``; rstd
    ``[B, H, S]`` fp32. ``FUSE`` off: the plain GEMM (benchmarks). ``LORA``: LoRA adapters' update in
    the same accumulator, ``qkv = x W^T + U B^T`` with ``u_desc`` U ``[tokens, R]`` (x A^T of every
    adapter, side by side) in blocks ``[BM, BK]`` and ``b_desc`` B ``[N, R]`` (each adapter's scaled B
    in its rows and U's columns, zeros elsewhere) in blocks ``[BN, BK]``; else both None. ``SCALES``
    (FP8: x and W e4m3 codes; 0: 16-bit operands, ``xs_ptr``/``ws_ptr`` None): 1, ``xs_ptr`` x's inverse
    scales ``[tokens]`` and ``ws_ptr`` W's ``[N]`` (rowwise); 2, one fp32 inverse scale each (tensorwise)."""
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    bufs = gl.allocate_shared_memory(qkv_desc.dtype, [4, BM, BN // 2], qkv_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)  # completed by the TMA's bytes
        mbarrier.init(empty.index(i), count=1)  # the consuming warpgroup's release
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()  # the inits visible to the TMA engine
    # (a literal list: a constexpr concatenated into a tuple reaches the partition as a tensor, and a
    # partition's function must appear in the call itself)
    gl.warp_specialize([
        (_consumer, (x_bufs, w_bufs, ready, empty, turn, bufs, qkv_desc, q_desc, k_desc, xs_ptr, ws_ptr,
                       wq_ptr, swq, wk_ptr, swk, rq_ptr, srq_b, srq_h, srq_s, rk_ptr, srk_b, srk_h, srk_s,
                       cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, eps, M, N, K, R, S, HQ, HKV,
                       0, BM, BN, BK, GROUP_M, STAGES, FUSE, NORM_AFTER_ROPE, NORM_WEIGHT, RC, LORA, SCALES)),
        (_consumer, (x_bufs, w_bufs, ready, empty, turn, bufs, qkv_desc, q_desc, k_desc, xs_ptr, ws_ptr,
                       wq_ptr, swq, wk_ptr, swk, rq_ptr, srq_b, srq_h, srq_s, rk_ptr, srk_b, srk_h, srk_s,
                       cos_ptr, scos_b, scos_s, scos_d, sin_ptr, ssin_b, ssin_s, ssin_d, eps, M, N, K, R, S, HQ, HKV,
                       1, BM, BN, BK, GROUP_M, STAGES, FUSE, NORM_AFTER_ROPE, NORM_WEIGHT, RC, LORA, SCALES)),
        (_producer, (x_desc, w_desc, u_desc, b_desc, x_bufs, w_bufs, ready, empty, M, N, K, R, BM, BN, BK, GROUP_M,
                     STAGES, LORA)),
    ], [CONSUMER_WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])

/* The chunked (WY) backward of gated_delta_net, from a saved forward (ABI.md §9.1), one text for both targets; part
 * of the gdn_backward program (before kernels/gdn_backward.cl, after kernels/ssm_fields.cl, whose state slots,
 * carried state and f32 state beside a 16-bit thunk it shares; GDNB_NORM switches qk_l2norm on, GDNB_GATE_K
 * per-channel gates).
 *
 * Per chunk of L = 32 tokens of one (batch row, value head), with the reserve's S0 (the state entering it), U
 * (what each token adds), qk, kk (the decayed Gram products, before scale) and inverse = (I + diag(beta) kk)^-1,
 * gamma_r = exp(cum_r) (the decay from the chunk's start through token r), end_r = exp(cum_L - cum_r) and the
 * chunk's decay D = exp(cum_L), the forward is
 *   U = inverse diag(beta) (V - diag(gamma) K S0),  S_L = D S0 + (diag(end) K)^T U,
 *   O = scale (diag(gamma) Q S0 + qk U),
 * so its backward, given dO and dS_L (the gradient of the state leaving the chunk), is
 *   dU = scale qk^T dO + diag(end) K dS_L,  Y = inverse^T dU,  dV = diag(beta) Y,
 *   dS0 = D dS_L + scale (diag(gamma) Q)^T dO - (diag(gamma) K)^T dV,
 * a reverse pass over the chunks, by blocks of state columns (gdn_chunk_back_pass); then, every chunk at once,
 * the gradients of q, k, beta and g through the products (gdn_chunk_back_grads): with dA = Y U^T (strictly lower),
 * dqk = scale dO U^T (lower), dkk = -diag(beta) dA, the decay ratios R[r][s] = exp(cum_r - cum_s) (s <= r),
 *   dq = (dqk .* R) K + scale diag(gamma) dO S0^T,
 *   dk = (dqk .* R)^T Q + (dkk .* R + (dkk .* R)^T) K + diag(end) U dS_L^T - diag(beta gamma) Y S0^T,
 *   dbeta_r = Y_r . V_r - gamma_r k_r . (Y S0^T)_r - sum_s dA[r][s] kk[r][s],
 * and the log-decays' through their cumulative sums: E = dqk .* qk + dkk .* kk,
 *   dcum_r = sum_s E[r][s] - sum_s E[s][r] + q_r . dq~_r - k_r . (dk~_r + dkd_r) (dq~, dk~: the gate terms above),
 *   dcum_(L-1) += sum_r k_r . dkd_r + D S0 . dS_L,  dg_r = sum_(t >= r) dcum_t.
 * q and k are the normalised ones (nrm from gdn_qk_norm with GDNB_NORM); dq and dk go out as partials per value
 * head of a key head ([HV/H][T][H][K]) that gdn_backward_qk sums and takes through the norm. Tokens past the
 * sequence in the last chunk are zero inputs (the reserve's padding). Per-channel gates (GDNB_GATE_K): every decay
 * above is per key channel (cum_r a row of K, gamma, end and D diagonals on the state's rows, R[r][s] a ratio per
 * channel inside the K-sums of dq, dk), and dcum_r, dg_r rows of K (gdnc_row_pairs_channel, gdnc_channel_dg). On
 * CUDA with tensor cores gdn_chunk_back_grads' RLX_MMA variant takes its state products Y S0^T, dO S0^T and
 * U dS_L^T there (gdnc_state_terms_mma_barrier), gdn_chunk_back_pass' variant dU's K dS_L and dS0
 * (gdnc_pass_mma_barrier). Host twin: host_fallback/gdn_backward_chunked.py. */

#ifndef GDNB_NORM
#define GDNB_NORM 0
#endif
#ifndef GDNB_GATE_K
#define GDNB_GATE_K 0 /* per-channel gates: the cumulative log-decays per (token, key channel) in scratch */
#endif
#define GDNC_L 32 /* the saved forward's chunk (kernels/gdn.cl's GDN_RC, abi.gdn.RESERVE_CHUNK) */
#define GDNC_LP (GDNC_L + 1) /* LOCAL rows padded by one, so that a column walk spreads over banks */
/* the least log-decay of a step the kernels take: exp of it is 0 in f32 (smaller ones, -inf too, decay as much) */
#define GDNC_LOG_FLOOR (-104.2789)
#define GDNC_W 8 /* a sum over the columns is kept as GDNC_W partial sums added in order at the end: the compiler
                  * vectorizes it (the cpu target) without reordering it */

/* One chunk of one (batch row b, value head vh) as both kernels find it: its first token (b*S + c*L), its tokens
 * (n <= L), its index among the reserve's (b, chunk, value head) slots and the key head. */
typedef struct {
    i64 first, n, slot, kh;
} gdnc_chunk;

INLINE_FN gdnc_chunk gdnc_chunk_of(i64 b, i64 c, i64 vh, i64 S, i64 H, i64 HV)
{
    const i64 chunks = (S + GDNC_L - 1) / GDNC_L;
    gdnc_chunk out;
    out.first = b * S + c * GDNC_L;
    out.n = S - c * GDNC_L < GDNC_L ? S - c * GDNC_L : GDNC_L;
    out.slot = (b * chunks + c) * HV + vh;
    out.kh = vh / (HV / H);
    return out;
}

/* x[(first + r) * stride + at] for a token r of the chunk, 0 past it. */
INLINE_FN real gdnc_load(GLOBAL const store_t* x, gdnc_chunk ch, i64 r, i64 stride, i64 at)
{
    return r < ch.n ? LOAD(x, (ch.first + r) * stride + at) : (real)0;
}

/* The cumulative log-decay of token r of the chunk at key channel i: per head cum[r] (LOCAL, the same at every
 * channel), per channel ck[r * K + i] (the chunk's [L][K] in scratch, gdnc_rows_barrier's). */
INLINE_FN real gdnc_cum(LOCAL_PTR const real* cum, GLOBAL const real* ck, i64 K, i64 r, i64 i)
{
    return GDNB_GATE_K ? ck[r * K + i] : cum[r];
}

/* sum_j a[j] b[j] over j < n as GDNC_W partial sums, b in the compute type and a in the thunk's type (as) or the
 * compute type (ar, where as is 0): the loop is unswitched on which. */
INLINE_FN real gdnc_dot_any(GLOBAL const store_t* as, GLOBAL const real* ar, GLOBAL const real* b, i64 n)
{
    real part[GDNC_W];
    PRAGMA_UNROLL
    for (int l = 0; l < GDNC_W; ++l)
        part[l] = (real)0;
    i64 j = 0;
    for (; j + GDNC_W <= n; j += GDNC_W)
        PRAGMA_UNROLL
        for (int l = 0; l < GDNC_W; ++l)
            part[l] += (as ? LOAD(as, j + l) : ar[j + l]) * b[j + l];
    for (; j < n; ++j)
        part[0] += (as ? LOAD(as, j) : ar[j]) * b[j];
    real out = (real)0;
    PRAGMA_UNROLL
    for (int l = 0; l < GDNC_W; ++l)
        out += part[l];
    return out;
}

INLINE_FN real gdnc_dot(GLOBAL const store_t* a, GLOBAL const real* b, i64 n)
{
    return gdnc_dot_any(a, 0, b, n);
}

INLINE_FN real gdnc_dot_real(GLOBAL const real* a, GLOBAL const real* b, i64 n)
{
    return gdnc_dot_any(0, a, b, n);
}

/* Floored (a NaN kept): a decay of 0 leaves no -inf - -inf in a ratio. */
INLINE_FN real gdnc_floor(real g)
{
    return g < (real)GDNC_LOG_FLOOR ? (real)GDNC_LOG_FLOOR : g;
}

/* A chunk's per-token scalars in LOCAL memory: the cumulative log-decay (per channel: into ck, [L][K], a channel
 * per lane in turn), beta and the factors 1/|q|, 1/|k| (1 without GDNB_NORM), token r written by lane r % lanes;
 * a barrier follows. */
INLINE_FN void gdnc_rows_barrier(gdnc_chunk ch, i64 HV, i64 H, i64 K, i64 vh, GLOBAL const store_t* g,
                                 GLOBAL const store_t* beta, GLOBAL const real* nrm, LOCAL_PTR real* cum,
                                 GLOBAL real* ck, LOCAL_PTR real* bet, LOCAL_PTR real* nq, LOCAL_PTR real* nk,
                                 i64 lane, i64 lanes)
{
    BARRIER(); /* the previous chunk's rows are read no more */
#if GDNB_GATE_K
    for (i64 i = lane; i < K; i += lanes) {
        real sum = (real)0;
        PRAGMA_NO_UNROLL /* unrolled, the 16-bit loads of g took CUDA past its register budget */
        for (i64 t = 0; t < GDNC_L; ++t) {
            sum += gdnc_floor(gdnc_load(g, ch, t, HV * K, vh * K + i));
            ck[t * K + i] = sum;
        }
    }
#endif
    for (i64 r = lane; r < GDNC_L; r += lanes) {
        real sum = (real)0;
        for (i64 t = 0; !GDNB_GATE_K && t <= r; ++t)
            sum += gdnc_floor(gdnc_load(g, ch, t, HV, vh));
        cum[r] = sum;
        bet[r] = gdnc_load(beta, ch, r, HV, vh);
        const i64 e = (ch.first + r) * H + ch.kh;
        nq[r] = GDNB_NORM && r < ch.n ? nrm[2 * e] : (real)1;
        nk[r] = GDNB_NORM && r < ch.n ? nrm[2 * e + 1] : (real)1;
    }
    BARRIER();
}

/* Where the reverse pass finds a chunk: q, k and d_out at its first token's rows (q, k [tokens][H][K] at the key
 * head, d_out [tokens][HV][V] at the value head), d_v likewise, qk and the inverse ([L][L]), dS_L (ds, [K][V]),
 * its rows of Y ([L][V]) and where dS0 goes (out, [K][V]); every row pointer at the item's first column. */
typedef struct {
    GLOBAL const store_t* q;
    GLOBAL const store_t* k;
    GLOBAL const store_t* gout;
    GLOBAL store_t* dv;
    GLOBAL const real* qk;
    GLOBAL const real* inv;
    GLOBAL const real* ds;
    GLOBAL real* y;
    GLOBAL real* out;
} gdnc_pass_at;

/* Columns [0, w) of one chunk in the reverse pass (row strides: H*K for q, k, HV*V for d_out, d_v, V for the
 * rest); every inner loop runs over the columns. The variant's dS0 follows (gdnc_pass_mma_barrier). */
INLINE_FN void gdnc_pass_chunk(gdnc_pass_at at, i64 n, i64 w, i64 H, i64 HV, i64 K, i64 V, real scale,
                               LOCAL_PTR const real* cum, GLOBAL const real* ck, LOCAL_PTR const real* bet,
                               LOCAL_PTR const real* nq, LOCAL_PTR const real* nk)
{
    const i64 os = HV * V;
    for (i64 s = 0; s < GDNC_L; ++s) { /* dU = scale qk^T dO + diag(end) K dS_L (the variant has the second in y) */
#ifndef RLX_MMA
        const i64 qs = H * K;
        for (i64 j = 0; j < w; ++j)
            at.y[s * V + j] = (real)0;
#endif
        for (i64 r = s; r < n; ++r) {
            const real a = scale * at.qk[r * GDNC_L + s];
            for (i64 j = 0; j < w; ++j)
                at.y[s * V + j] += a * LOAD(at.gout, r * os + j);
        }
#ifndef RLX_MMA
        for (i64 i = 0; i < K && s < n; ++i) {
            const real f = rlx_exp(gdnc_cum(cum, ck, K, GDNC_L - 1, i) - gdnc_cum(cum, ck, K, s, i)) * nk[s];
            const real a = f * LOAD(at.k, s * qs + i);
            for (i64 j = 0; j < w; ++j)
                at.y[s * V + j] += a * at.ds[i * V + j];
        }
#endif
    }
    for (i64 s = 0; s < GDNC_L; ++s) { /* Y = inverse^T dU in place: Y_s reads dU_r for r >= s alone */
        for (i64 r = s + 1; r < GDNC_L; ++r) {
            const real a = at.inv[r * GDNC_L + s];
            for (i64 j = 0; j < w; ++j)
                at.y[s * V + j] += a * at.y[r * V + j];
        }
        for (i64 j = 0; j < w && s < n; ++j)
            STORE(at.dv, s * os + j, bet[s] * at.y[s * V + j]);
    }
#ifndef RLX_MMA
    const i64 qs = H * K;
    for (i64 i = 0; i < K; ++i) { /* dS0 = D dS_L + sum_r gamma_r (scale q_r dO_r - k_r beta_r Y_r) */
        const real through = rlx_exp(gdnc_cum(cum, ck, K, GDNC_L - 1, i));
        for (i64 j = 0; j < w; ++j)
            at.out[i * V + j] = through * at.ds[i * V + j];
        for (i64 r = 0; r < n; ++r) {
            const real gam = rlx_exp(gdnc_cum(cum, ck, K, r, i));
            const real a = gam * scale * nq[r] * LOAD(at.q, r * qs + i);
            const real b = gam * nk[r] * bet[r] * LOAD(at.k, r * qs + i);
            for (i64 j = 0; j < w; ++j)
                at.out[i * V + j] += a * LOAD(at.gout, r * os + j) - b * at.y[r * V + j];
        }
    }
#endif
}

#ifdef RLX_MMA
#if GDNC_L != 32
#error "the MMA variant of gdn_chunk_back_pass takes the chunk's 32 tokens as two 16-step slices of its products"
#endif
#define GDNC_PW 4 /* the pass's variant: at most 4 warps a work-group (launches/gdn_backward.py's lanes) */
/* 16-bit operands split, x = hi + lo, as three products hi.hi + hi.lo + lo.hi: rounded once, they cost d_state (the
 * first chunk's dS0) and d_v (dU's, measured with qk^T dO in the tiles too) ~2x the FMA path's error against the
 * float64 reference (emulated on PoCL, K = V = 64, S 96 and 256: bf16 d_state NMSE 5.6e-6 against 2.8e-6, d_v 4.7e-6
 * against 2.9e-6, f16 9e-8 and 7e-8 against 4.2e-8 and 4.6e-8; no growth over 8 chunks), NMSE vs the FMA path 6-7e-6
 * at bf16, past a tenth of the bound 5e-5; split, the FMA path's (vs it 1e-8). TF32 keeps plain operands. */
#define GDNC_PSPLIT (RLX_MMA == 1)
/* One of the pass's two products on the tensor cores, by 16 x 16 output tiles, a tile per warp in turn: ds0 0, dU's
 * diag(end nk) K dS_L ([L][K] [K][V]) into y (its triangular scale qk^T dO stays FMA, gdnc_pass_chunk's: a masked
 * entry of A times a NaN in dO would be NaN where the FMA path takes no such product); ds0 1, dS0 = D dS_L + [scale
 * diag(gamma nq) Q | -diag(gamma nk beta) K]^T [dO; Y] ([K][2L] [2L][V]) into out. Each warp stages its tile's
 * operands a block of 2L along the sum at a time (A's 16 rows [16][2L], then the right operand's 16 columns [2L][16],
 * zero past the chunk's tokens, the channels and the columns; at 16 bits each then its lo part) in its own share of a
 * and bm, accumulates, stores the product f32 in its share of prod ([16][16]) and writes it out. Per-channel gates
 * take the same code (the decays per key channel as staged). Every lane runs it (barriers, the first before any
 * staging: the operands' writers done). at: the group's first column's pointers (lane 0's). */
INLINE_FN void gdnc_pass_mma_barrier(int ds0, gdnc_pass_at at, i64 n, i64 H, i64 HV, i64 K, i64 V, real scale,
                                     LOCAL_PTR const real* cum, GLOBAL const real* ck, LOCAL_PTR const real* bet,
                                     LOCAL_PTR const real* nq, LOCAL_PTR const real* nk, i64 lane, i64 lanes,
                                     LOCAL_PTR mma_t* a, LOCAL_PTR mma_t* bm, LOCAL_PTR float* prod)
{
    const i64 qs = H * K, os = HV * V, warps = lanes / 32, vt = (V + 15) / 16;
    const i64 mt = ds0 ? (K + 15) / 16 : GDNC_L / 16, sum = ds0 ? 2 * GDNC_L : K;
    const i64 w = MMA_WARP(lane), l = lane - w * 32, part = 16 * 2 * GDNC_L; /* an operand's tile */
    LOCAL_PTR mma_t* aw = a + w * (1 + GDNC_PSPLIT) * part;
    LOCAL_PTR mma_t* bw = bm + w * (1 + GDNC_PSPLIT) * part;
    LOCAL_PTR float* pw = prod + w * 256;
    for (i64 t0 = 0; t0 < mt * vt; t0 += warps) {
        const i64 t = t0 + w, m0 = t / vt * 16, j0 = (t - t / vt * vt) * 16;
        const int has = t < mt * vt;
        mma_acc acc;
        mma_zero(&acc);
        for (i64 q0 = 0; q0 < sum; q0 += 2 * GDNC_L) {
            BARRIER(); /* the operands' writers done; the previous block's operands and products read no more */
            PRAGMA_NO_UNROLL
            for (int e = (int)l; has && e < part; e += 32) {
                const int mm = e / (2 * GDNC_L);
                const i64 m = m0 + mm, q = q0 + e - mm * 2 * GDNC_L, r = q % GDNC_L;
                real x = (real)0;
                if (ds0 && m < K && r < n) {
                    const real gam = rlx_exp(gdnc_cum(cum, ck, K, r, m));
                    x = q < GDNC_L ? gam * scale * nq[r] * LOAD(at.q, r * qs + m)
                                   : -gam * nk[r] * bet[r] * LOAD(at.k, r * qs + m);
                } else if (!ds0 && q < K && m < n) {
                    const real f = rlx_exp(gdnc_cum(cum, ck, K, GDNC_L - 1, q) - gdnc_cum(cum, ck, K, m, q));
                    x = f * nk[m] * LOAD(at.k, m * qs + q);
                }
                aw[e] = TO_MMA(x);
                if (GDNC_PSPLIT)
                    aw[part + e] = TO_MMA(x - FROM_MMA(aw[e]));
            }
            PRAGMA_NO_UNROLL
            for (int e = (int)l; has && e < part; e += 32) {
                const i64 q = q0 + e / 16, r = q % GDNC_L, j = j0 + e % 16;
                real x = (real)0;
                if (j < V && ds0 && r < n)
                    x = q < GDNC_L ? LOAD(at.gout, r * os + j) : at.y[r * V + j];
                else if (j < V && !ds0 && q < K)
                    x = at.ds[q * V + j];
                bw[e] = TO_MMA(x);
                if (GDNC_PSPLIT)
                    bw[part + e] = TO_MMA(x - FROM_MMA(bw[e]));
            }
            BARRIER();
            PRAGMA_NO_UNROLL /* unrolled, its operand fragments took sm_90 past 128 registers */
            for (int k0 = 0; has && k0 < 2 * GDNC_L; k0 += 16) {
                mma_tile(&acc, MMA_ROW, aw + k0, 2 * GDNC_L, MMA_ROW, bw + k0 * 16, 16);
                if (GDNC_PSPLIT) {
                    mma_tile(&acc, MMA_ROW, aw + k0, 2 * GDNC_L, MMA_ROW, bw + part + k0 * 16, 16);
                    mma_tile(&acc, MMA_ROW, aw + part + k0, 2 * GDNC_L, MMA_ROW, bw + k0 * 16, 16);
                }
            }
        }
        if (has)
            mma_store(pw, &acc, 16);
        BARRIER();
        PRAGMA_NO_UNROLL
        for (int e = (int)l; has && e < 256; e += 32) {
            const i64 m = m0 + e / 16, j = j0 + e % 16;
            if (ds0 && m < K && j < V)
                at.out[m * V + j] = rlx_exp(gdnc_cum(cum, ck, K, GDNC_L - 1, m)) * at.ds[m * V + j] + pw[e];
            else if (!ds0 && j < V)
                at.y[m * V + j] = pw[e];
        }
    }
}
#endif

/* The reverse pass: a work-group per (batch row b, value head vh), a work-item per block of CJ state columns
 * (local size ceil(V / CJ); the RLX_MMA variant's whole warps, at most GDNC_PW, lanes past V idle in the FMA part,
 * dU's K dS_L and dS0 by tiles: gdnc_pass_mma_barrier). Scratch: per-channel gates' cumulative log-decays at ckb ([B][C][HV][L][K]); the state gradients at dsb, [B][HV][C + 1][K][V]: slot c + 1 dS_L of chunk c
 * (the last one d_state's, with SSM_CARRY, or 0), slot 0 the initial state's (written to d_state with SSM_CARRY);
 * the state entering the first chunk at s0b ([B][HV][K][V]: the initial state or 0, for gdn_chunk_back_grads); Y at
 * yb, [B][C][HV][L][V] (the reserve's slot order); d_v written. */
#ifdef RLX_MMA /* work-groups of at most GDNC_PW warps, 4 of them an SM: sm_90 holds the variant within 128 registers */
#define GDNC_PASS_LANES (GDNC_PW * 32)
#define GDNC_PASS_GROUPS 4
#else /* at most 256 lanes (launches/gdn_backward.py's PASS_LANES), which bounds no register */
#define GDNC_PASS_LANES 256
#define GDNC_PASS_GROUPS 1
#endif
KERNEL_BOUNDED(GDNC_PASS_LANES, GDNC_PASS_GROUPS) gdn_chunk_back_pass(i64 S, i64 H, i64 HV, i64 K, i64 V, i64 CJ,
                           real scale, GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* gb, i64 go,
                           GLOBAL uchar* betab, i64 betao, GLOBAL uchar* stb, i64 sto, GLOBAL uchar* slb, i64 slo,
                           GLOBAL uchar* gob, i64 goo, GLOBAL uchar* dvb, i64 dvo, GLOBAL uchar* dstb, i64 dsto,
                           GLOBAL uchar* nb, i64 no, GLOBAL uchar* rqb, i64 rqo, GLOBAL uchar* rib, i64 rio,
                           GLOBAL uchar* dsb, i64 dso, GLOBAL uchar* s0b, i64 s0o, GLOBAL uchar* yb, i64 yo,
                           GLOBAL uchar* ckb, i64 cko)
{
    LOCAL real cum[GDNC_L], bet[GDNC_L], nq[GDNC_L], nk[GDNC_L];
#ifdef RLX_MMA
    MMA_LOCAL mma_t pa[GDNC_PW * (1 + GDNC_PSPLIT) * 16 * 2 * GDNC_L];
    MMA_LOCAL mma_t pb[GDNC_PW * (1 + GDNC_PSPLIT) * 2 * GDNC_L * 16];
    MMA_LOCAL float pprod[GDNC_PW * 256];
#endif
    const i64 bh = GROUP(0), lane = LID(0), b = bh / HV, vh = bh - b * HV, chunks = (S + GDNC_L - 1) / GDNC_L;
    const i64 kv = K * V, j0 = lane * CJ, w = V - j0 < CJ ? V - j0 : CJ, entry = ssm_slot(b, AT(int, slb, slo));
    GLOBAL state_t* dstate = AT(state_t, dstb, dsto) + (entry * HV + vh) * kv + j0;
    GLOBAL const state_t* h0 = AT(state_t, stb, sto) + (entry * HV + vh) * kv + j0;
    GLOBAL real* dsl = AT(real, dsb, dso) + bh * (chunks + 1) * kv + j0;
    GLOBAL real* s0 = AT(real, s0b, s0o) + bh * kv + j0;
    for (i64 i = 0; i < K; ++i)
        for (i64 j = 0; j < w; ++j) {
            dsl[chunks * kv + i * V + j] = SSM_CARRY ? SLOAD(dstate, i * V + j) : (real)0;
            s0[i * V + j] = SSM_CARRY ? SLOAD(h0, i * V + j) : (real)0;
        }
    for (i64 c = chunks - 1; c >= 0; --c) {
        const gdnc_chunk ch = gdnc_chunk_of(b, c, vh, S, H, HV);
        GLOBAL real* ck = AT(real, ckb, cko) + ch.slot * GDNC_L * K;
        gdnc_rows_barrier(ch, HV, H, K, vh, AT(store_t, gb, go), AT(store_t, betab, betao), AT(real, nb, no), cum, ck,
                          bet, nq, nk, lane, LSIZE(0));
        gdnc_pass_at at;
        at.q = AT(store_t, qb, qo) + ch.first * H * K + ch.kh * K;
        at.k = AT(store_t, kb, ko) + ch.first * H * K + ch.kh * K;
        at.gout = AT(store_t, gob, goo) + (ch.first * HV + vh) * V + j0;
        at.dv = AT(store_t, dvb, dvo) + (ch.first * HV + vh) * V + j0;
        at.qk = AT(real, rqb, rqo) + ch.slot * GDNC_L * GDNC_L;
        at.inv = AT(real, rib, rio) + ch.slot * GDNC_L * GDNC_L;
        at.ds = dsl + (c + 1) * kv;
        at.y = AT(real, yb, yo) + ch.slot * GDNC_L * V + j0;
        at.out = dsl + c * kv;
#ifdef RLX_MMA
        gdnc_pass_at group = at; /* the group's first column's rows */
        group.gout -= j0;
        group.y -= j0;
        group.ds -= j0;
        group.out -= j0;
        PRAGMA_NO_UNROLL /* one copy of the tiles' code: two took sm_90 past 128 registers */
        for (int ds0 = 0; ds0 < 2; ++ds0) { /* dU's K dS_L into y, then (dU, Y from it) dS0 */
            gdnc_pass_mma_barrier(ds0, group, ch.n, H, HV, K, V, scale, cum, ck, bet, nq, nk, lane, LSIZE(0), pa, pb,
                                  pprod);
            if (!ds0) {
                BARRIER(); /* dU in y */
                gdnc_pass_chunk(at, ch.n, w, H, HV, K, V, scale, cum, ck, bet, nq, nk);
            }
        }
#else
        gdnc_pass_chunk(at, ch.n, w, H, HV, K, V, scale, cum, ck, bet, nq, nk);
#endif
    }
#ifdef RLX_MMA
    BARRIER(); /* the first chunk's dS0 came from the warps' tiles */
#endif
    if (SSM_CARRY)
        for (i64 i = 0; i < K; ++i)
            for (i64 j = 0; j < w; ++j)
                SSTORE(dstate, i * V + j, dsl[i * V + j]);
}

/* Row r of the chunk's L x L gradient products (over the V columns): dqk = scale dO_r . U_s (s <= r) and
 * dA = Y_r . U_s (s < r) into LOCAL pq = dqk .* R, pk = dkk .* R, e = dqk .* qk + dkk .* kk (0 elsewhere; per
 * channel R is 1 here, gdnc_row_pairs_channel takes each channel's);
 * returns Y_r . V_r - sum_s dA[r][s] kk[r][s], beta's gradient but for its gate term. gout, v: row r's (r < n). */
INLINE_FN real gdnc_row_products(i64 r, i64 n, i64 V, real scale, GLOBAL const store_t* v, GLOBAL const store_t* gout,
                                 GLOBAL const real* u, GLOBAL const real* y, GLOBAL const real* qk,
                                 GLOBAL const real* kk, LOCAL_PTR const real* cum, LOCAL_PTR const real* bet,
                                 LOCAL_PTR real* pq, LOCAL_PTR real* pk, LOCAL_PTR real* e)
{
    real dbeta = r < n ? gdnc_dot(v, y + r * V, V) : (real)0;
    for (i64 s = 0; s < GDNC_L; ++s) {
        const int lower = s <= r && r < n;
        const real dqk = lower ? scale * gdnc_dot(gout, u + s * V, V) : (real)0;
        const real da = lower && s < r ? gdnc_dot_real(y + r * V, u + s * V, V) : (real)0;
        const real ratio = lower ? (GDNB_GATE_K ? (real)1 : rlx_exp(cum[r] - cum[s])) : (real)0, dkk = -bet[r] * da;
        dbeta -= da * kk[r * GDNC_L + s];
        pq[r * GDNC_LP + s] = dqk * ratio;
        pk[r * GDNC_LP + s] = dkk * ratio;
        e[r * GDNC_LP + s] = dqk * qk[r * GDNC_L + s] + dkk * kk[r * GDNC_L + s];
    }
    return dbeta;
}

/* Where gdnc_row_grads reads a chunk: q and k at its first token's key-head row (stride H*K), d_out at row r's
 * value-head row, the state entering it and dS_L ([K][V]), U and Y ([L][V]). */
typedef struct {
    GLOBAL const store_t* q;
    GLOBAL const store_t* k;
    GLOBAL const store_t* gout;
    GLOBAL const real* s0;
    GLOBAL const real* dsl;
    GLOBAL const real* u;
    GLOBAL const real* y;
    GLOBAL const real* ck; /* per-channel gates: the chunk's cumulative log-decays [L][K] */
} gdnc_grad_inputs;

/* Per-channel gates, row r's pair products after gdnc_row_products' barrier: the decay ratio of tokens r and s
 * varies with the key channel (exp(cum_later - cum_earlier) at each), so it is taken inside the channel loop:
 * dq += (dqk .* R) K, dk += (dqk .* R)^T Q + (dkk .* R + (dkk .* R)^T) K; dc ([K], holding dgk + dkd) becomes the
 * gradient of the row's cumulative log-decays,
 * dcum_r = q_r .* dq_r - k_r .* ((dqk .* R)^T Q + ((dkk .* R)^T - dkk .* R) K + dgk + dkd)_r,
 * without the pair (r, r), whose terms cancel (q_r k_r dqk[r][r] - k_r q_r dqk[r][r]): added to dq, dk last, so
 * that a row whose other terms are 0 has a gradient of exactly 0, as per head. */
INLINE_FN void gdnc_row_pairs_channel(gdnc_grad_inputs in, i64 n, i64 r, i64 qs, i64 K, GLOBAL real* dq,
                                      GLOBAL real* dk, GLOBAL real* dc, LOCAL_PTR const real* nq,
                                      LOCAL_PTR const real* nk, LOCAL_PTR const real* pq, LOCAL_PTR const real* pk)
{
    for (i64 s = 0; s < n; ++s) {
        const real a = pq[r * GDNC_LP + s] * nk[s], b = pq[s * GDNC_LP + r] * nq[s];
        const real rows = pk[r * GDNC_LP + s] * nk[s], cols = pk[s * GDNC_LP + r] * nk[s];
        const real sign = s < r ? (real)1 : (real)-1; /* the ratio runs from the earlier token to the later */
        for (i64 i = 0; i < K && s != r; ++i) {
            const real ratio = rlx_exp(sign * (in.ck[r * K + i] - in.ck[s * K + i]));
            const real ks = LOAD(in.k, s * qs + i) * ratio, qv = LOAD(in.q, s * qs + i) * ratio;
            dq[i] += a * ks;
            dk[i] += b * qv + (rows + cols) * ks;
            dc[i] += b * qv + (cols - rows) * ks;
        }
    }
    const real a = pq[r * GDNC_LP + r] * nk[r], b = pq[r * GDNC_LP + r] * nq[r];
    for (i64 i = 0; i < K; ++i) {
        const real q = LOAD(in.q, r * qs + i), k = LOAD(in.k, r * qs + i);
        dc[i] = q * nq[r] * dq[i] - k * nk[r] * dc[i];
        dq[i] += a * k;
        dk[i] += b * q;
    }
}

/* Row r's state terms at key channel i from its three state products, ys = Y_r . S0_i, os = dO_r . S0_i and
 * ud = U_r . dS_L_i: d_q's and d_k's into dq[i], dk[i] (per channel dc[i], tl[i] too, gdnc_row_grads'), and their
 * shares of beta's gradient (*dbeta), of the row's cumulative log-decay's (*dcum) and of the last row's (*tail). */
INLINE_FN void gdnc_state_term(gdnc_grad_inputs in, i64 r, i64 i, i64 qs, i64 K, real scale, real ys, real os, real ud,
                               GLOBAL real* dq, GLOBAL real* dk, GLOBAL real* dc, GLOBAL real* tl, real* dbeta,
                               real* dcum, real* tail, LOCAL_PTR const real* cum, LOCAL_PTR const real* bet,
                               LOCAL_PTR const real* nq, LOCAL_PTR const real* nk)
{
    const real at = gdnc_cum(cum, in.ck, K, r, i);
    const real gam = rlx_exp(at), end = rlx_exp(gdnc_cum(cum, in.ck, K, GDNC_L - 1, i) - at);
    const real dkd = end * ud;
    const real qn = LOAD(in.q, r * qs + i) * nq[r], kn = LOAD(in.k, r * qs + i) * nk[r];
    const real dqg = scale * gam * os, dgk = bet[r] * gam * ys;
    *dbeta -= gam * kn * ys;
    *dcum += qn * dqg - kn * (dgk + dkd);
    *tail += kn * dkd;
    dq[i] = dqg;
    dk[i] = dkd - dgk;
    if (GDNB_GATE_K) {
        dc[i] = dgk + dkd;
        tl[i] = kn * dkd;
    }
}

/* Row r's (r < n) d_q, d_k partials (with respect to the normalised q, k) into dq, dk ([K]), after
 * gdnc_row_products' barrier; returns the row's gradient of its cumulative log-decay but for the chunk's last-row
 * terms, whose share of row r it adds to *tail, and subtracts the gate term of beta's gradient from *dbeta. Per
 * channel (GDNB_GATE_K) those gradients go per key channel to dc and tl ([K]) instead (0 returned). The RLX_MMA
 * variant has taken the state terms already (gdnc_state_terms_mma_barrier: dcum their share), the portable path
 * takes them here, dcum 0. */
INLINE_FN real gdnc_row_grads(gdnc_grad_inputs in, i64 n, i64 r, i64 H, i64 K, i64 V, real scale, GLOBAL real* dq,
                              GLOBAL real* dk, GLOBAL real* dc, GLOBAL real* tl, real* dbeta, real* tail, real dcum,
                              LOCAL_PTR const real* cum, LOCAL_PTR const real* bet, LOCAL_PTR const real* nq,
                              LOCAL_PTR const real* nk, LOCAL_PTR const real* pq, LOCAL_PTR const real* pk)
{
    const i64 qs = H * K;
#ifndef RLX_MMA
    for (i64 i = 0; i < K; ++i) /* the state terms: Y S0^T, dO S0^T, U dS_L^T */
        gdnc_state_term(in, r, i, qs, K, scale, gdnc_dot_real(in.y + r * V, in.s0 + i * V, V),
                        gdnc_dot(in.gout, in.s0 + i * V, V), gdnc_dot_real(in.u + r * V, in.dsl + i * V, V), dq, dk,
                        dc, tl, dbeta, &dcum, tail, cum, bet, nq, nk);
#endif
#if GDNB_GATE_K
    gdnc_row_pairs_channel(in, n, r, qs, K, dq, dk, dc, nq, nk, pq, pk);
    return (real)0;
#else
    for (i64 s = 0; s < n; ++s) { /* the products: dq += (dqk .* R) K, dk += (dqk .* R)^T Q + (dkk .* R + ...^T) K */
        const real a = pq[r * GDNC_LP + s] * nk[s], b = pq[s * GDNC_LP + r] * nq[s];
        const real c = (pk[r * GDNC_LP + s] + pk[s * GDNC_LP + r]) * nk[s];
        for (i64 i = 0; i < K; ++i) {
            const real ks = LOAD(in.k, s * qs + i);
            dq[i] += a * ks;
            dk[i] += b * LOAD(in.q, s * qs + i) + c * ks;
        }
    }
    return dcum;
#endif
}

/* Per-channel gates, after a barrier: d_g of the chunk's tokens at the key channels i = lane, lane + L, ...: the
 * reverse sums over the tokens of dc (gdnc_row_grads'), plus the last row's terms, every token's tl and the entering
 * state's D S0 . dS_L. dg: the chunk's first token's row at its value head ([tokens][HV][K]). */
INLINE_FN void gdnc_channel_dg(gdnc_grad_inputs in, i64 n, i64 lane, i64 HV, i64 K, i64 V, GLOBAL const real* dc,
                               GLOBAL const real* tl, GLOBAL store_t* dg)
{
    for (i64 i = lane; i < K; i += GDNC_L) {
        real tail = rlx_exp(in.ck[(GDNC_L - 1) * K + i]) * gdnc_dot_real(in.s0 + i * V, in.dsl + i * V, V);
        for (i64 t = 0; t < n; ++t)
            tail += tl[t * K + i];
        real sum = (real)0;
        for (i64 t = n - 1; t >= 0; --t) {
            sum += dc[t * K + i];
            STORE(dg, t * HV * K + i, sum + tail);
        }
    }
}

#ifdef RLX_MMA
#if GDNC_L != 32
#error "the MMA variant of gdn_chunk_back_grads tiles the chunk's 32 tokens as two 16-row tiles, its one warp's"
#endif
#define GDNC_PP 20 /* prod's rows: a multiple of 4 floats (the tiles' stores), not of 32 (fewer bank conflicts) */
/* 16-bit operands: U dS_L^T takes split ones, x = hi + lo (hi = x rounded, lo = the rest rounded), as three products
 * hi.hi + hi.lo + lo.hi: U and dS_L rounded once to 16 bits cost d_g (the log-decays' gradient, whose terms cancel)
 * ~6x the FMA path's error and d_k ~2x (emulated on PoCL, K = V = 64, f16 NMSE 2.3e-7 against 5e-7, bf16 1.9e-5
 * against 5e-5); split, both are the FMA path's. Y S0^T and dO S0^T rounded once cost nothing measurable. TF32
 * keeps plain operands (d_g 5e-7 against bf16's bound 5e-5). */
#define GDNC_SPLIT (RLX_MMA == 1)
/* The state products on the tensor cores, by slices of 16 key channels i0..: Y S0^T, dO S0^T and U dS_L^T ([L][16]
 * each), one product at a time (two 16-row tiles, the group's one warp holding their two accumulators: more took
 * sm_90 past 128 registers), over the V columns in slices of 16 staged as operands (rows [L][16]: Y, dO or U, then
 * U's lo part; cols [16][16]: S0 or dS_L, then dS_L's lo part; zero past the chunk's tokens, the channels and the
 * columns); stored f32 in prod ([3][L][GDNC_PP]); then each row r < n takes its state terms at the slice's channels
 * in order (gdnc_state_term, as the portable path). gout: d_out at the chunk's first token's row (stride HV*V).
 * Every lane runs it (barriers). */
INLINE_FN void gdnc_state_terms_mma_barrier(gdnc_grad_inputs in, GLOBAL const store_t* gout, i64 n, i64 r, i64 H,
                                            i64 HV, i64 K, i64 V, real scale, GLOBAL real* dq, GLOBAL real* dk,
                                            GLOBAL real* dc, GLOBAL real* tl, real* dbeta, real* dcum, real* tail,
                                            LOCAL_PTR const real* cum, LOCAL_PTR const real* bet,
                                            LOCAL_PTR const real* nq, LOCAL_PTR const real* nk, LOCAL_PTR mma_t* rows,
                                            LOCAL_PTR mma_t* cols, LOCAL_PTR float* prod)
{
    for (i64 i0 = 0; i0 < K; i0 += 16) {
        for (int p = 0; p < 3; ++p) {
            GLOBAL const real* right = p < 2 ? in.s0 : in.dsl;
            const int split = GDNC_SPLIT && p == 2;
            mma_acc a0, a1;
            mma_zero(&a0);
            mma_zero(&a1);
            for (i64 j0 = 0; j0 < V; j0 += 16) {
                BARRIER(); /* the previous slice's operands are read no more */
                PRAGMA_NO_UNROLL
                for (int e = (int)r; e < GDNC_L * 16; e += GDNC_L) {
                    const int t = e / 16;
                    const i64 j = j0 + e % 16;
                    const real x = t >= n || j >= V ? (real)0 : p == 0 ? in.y[t * V + j]
                                                                : p == 1 ? LOAD(gout, t * HV * V + j) : in.u[t * V + j];
                    rows[e] = TO_MMA(x);
                    if (split)
                        rows[GDNC_L * 16 + e] = TO_MMA(x - FROM_MMA(rows[e]));
                }
                PRAGMA_NO_UNROLL
                for (int e = (int)r; e < 256; e += GDNC_L) {
                    const i64 i = i0 + e / 16, j = j0 + e % 16;
                    const real x = i < K && j < V ? right[i * V + j] : (real)0;
                    cols[e] = TO_MMA(x);
                    if (split)
                        cols[256 + e] = TO_MMA(x - FROM_MMA(cols[e]));
                }
                BARRIER();
                mma_tile(&a0, MMA_ROW, rows, 16, MMA_COL, cols, 16);
                mma_tile(&a1, MMA_ROW, rows + 256, 16, MMA_COL, cols, 16);
                if (split) {
                    mma_tile(&a0, MMA_ROW, rows, 16, MMA_COL, cols + 256, 16);
                    mma_tile(&a1, MMA_ROW, rows + 256, 16, MMA_COL, cols + 256, 16);
                    mma_tile(&a0, MMA_ROW, rows + GDNC_L * 16, 16, MMA_COL, cols, 16);
                    mma_tile(&a1, MMA_ROW, rows + GDNC_L * 16 + 256, 16, MMA_COL, cols, 16);
                }
            }
            mma_store(prod + p * GDNC_L * GDNC_PP, &a0, GDNC_PP);
            mma_store(prod + (p * GDNC_L + 16) * GDNC_PP, &a1, GDNC_PP);
        }
        BARRIER();
        for (i64 ii = 0; r < n && ii < 16 && i0 + ii < K; ++ii)
            gdnc_state_term(in, r, i0 + ii, H * K, K, scale, prod[r * GDNC_PP + ii],
                            prod[(GDNC_L + r) * GDNC_PP + ii], prod[(2 * GDNC_L + r) * GDNC_PP + ii], dq, dk, dc, tl,
                            dbeta, dcum, tail, cum, bet, nq, nk);
    }
}
#endif

/* Every chunk's gradients of q, k, beta and g at once: a work-group per reserve slot (batch row, chunk, value head),
 * a work-item per token r of the chunk (local size L). Reads the reserve (states, qk, kk, u at rsb, rqb, rkb, rub)
 * and gdn_chunk_back_pass's scratch (dsb, s0b, yb); writes the d_q, d_k partials [HV/H][T][H][K] at dqb, dkb
 * (scratch), d_beta and d_g; per-channel gates, the cumulative log-decays at ckb and their gradients' rows at dcb,
 * tlb (scratch, [B][C][HV][L][K] each). */
KERNEL gdn_chunk_back_grads(i64 S, i64 T, i64 H, i64 HV, i64 K, i64 V, real scale, GLOBAL uchar* qb, i64 qo,
                            GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo, GLOBAL uchar* gb, i64 go,
                            GLOBAL uchar* betab, i64 betao, GLOBAL uchar* gob, i64 goo, GLOBAL uchar* dgb, i64 dgo,
                            GLOBAL uchar* dbetab, i64 dbetao, GLOBAL uchar* nb, i64 no, GLOBAL uchar* rsb, i64 rso,
                            GLOBAL uchar* rqb, i64 rqo, GLOBAL uchar* rkb, i64 rko, GLOBAL uchar* rub, i64 ruo,
                            GLOBAL uchar* dsb, i64 dso, GLOBAL uchar* s0b, i64 s0o, GLOBAL uchar* yb, i64 yo,
                            GLOBAL uchar* dqb, i64 dqo, GLOBAL uchar* dkb, i64 dko, GLOBAL uchar* ckb, i64 cko,
                            GLOBAL uchar* dcb, i64 dco, GLOBAL uchar* tlb, i64 tlo)
{
    LOCAL real cum[GDNC_L], bet[GDNC_L], nq[GDNC_L], nk[GDNC_L], dcs[GDNC_L], tails[GDNC_L];
    LOCAL real pq[GDNC_L * GDNC_LP], pk[GDNC_L * GDNC_LP], e[GDNC_L * GDNC_LP];
    const i64 slot = GROUP(0), r = LID(0), chunks = (S + GDNC_L - 1) / GDNC_L, kv = K * V;
    const i64 bc = slot / HV, vh = slot - bc * HV, b = bc / chunks, c = bc - b * chunks;
    const gdnc_chunk ch = gdnc_chunk_of(b, c, vh, S, H, HV);
    const i64 tok = ch.first + r, row = r < ch.n ? tok : ch.first; /* a token past the chunk reads none */
    GLOBAL real* ck = AT(real, ckb, cko) + slot * GDNC_L * K;
    gdnc_rows_barrier(ch, HV, H, K, vh, AT(store_t, gb, go), AT(store_t, betab, betao), AT(real, nb, no), cum, ck, bet,
                      nq, nk, r, GDNC_L);
    gdnc_grad_inputs in;
    in.ck = ck;
    in.q = AT(store_t, qb, qo) + ch.first * H * K + ch.kh * K;
    in.k = AT(store_t, kb, ko) + ch.first * H * K + ch.kh * K;
    in.gout = AT(store_t, gob, goo) + (row * HV + vh) * V;
    in.s0 = c ? AT(real, rsb, rso) + (slot - HV) * kv : AT(real, s0b, s0o) + (b * HV + vh) * kv;
    in.dsl = AT(real, dsb, dso) + ((b * HV + vh) * (chunks + 1) + c + 1) * kv;
    in.u = AT(real, rub, ruo) + slot * GDNC_L * V;
    in.y = AT(real, yb, yo) + slot * GDNC_L * V;
    real dbeta = gdnc_row_products(r, ch.n, V, scale, AT(store_t, vb, vo) + (row * HV + vh) * V, in.gout, in.u, in.y,
                                   AT(real, rqb, rqo) + slot * GDNC_L * GDNC_L,
                                   AT(real, rkb, rko) + slot * GDNC_L * GDNC_L, cum, bet, pq, pk, e);
    BARRIER();
    const i64 part = ((vh - ch.kh * (HV / H)) * T + row) * H * K + ch.kh * K;
    real tail = (real)0, dcum = (real)0, state = (real)0; /* state: the state terms' share of dcum (RLX_MMA) */
    GLOBAL real* dc = AT(real, dcb, dco) + slot * GDNC_L * K; /* per channel: [L][K] */
    GLOBAL real* tl = AT(real, tlb, tlo) + slot * GDNC_L * K;
#ifdef RLX_MMA
    MMA_LOCAL mma_t rows[(1 + GDNC_SPLIT) * GDNC_L * 16];
    MMA_LOCAL mma_t cols[(1 + GDNC_SPLIT) * 256];
    MMA_LOCAL float prod[3 * GDNC_L * GDNC_PP];
    gdnc_state_terms_mma_barrier(in, AT(store_t, gob, goo) + (ch.first * HV + vh) * V, ch.n, r, H, HV, K, V, scale,
                                 AT(real, dqb, dqo) + part, AT(real, dkb, dko) + part, dc + r * K, tl + r * K, &dbeta,
                                 &state, &tail, cum, bet, nq, nk, rows, cols, prod);
#endif
    if (r < ch.n)
        dcum = gdnc_row_grads(in, ch.n, r, H, K, V, scale, AT(real, dqb, dqo) + part, AT(real, dkb, dko) + part,
                              dc + r * K, tl + r * K, &dbeta, &tail, state, cum, bet, nq, nk, pq, pk);
#if GDNB_GATE_K
    BARRIER();
    gdnc_channel_dg(in, ch.n, r, HV, K, V, dc, tl, AT(store_t, dgb, dgo) + (ch.first * HV + vh) * K);
    if (r < ch.n)
        STORE(AT(store_t, dbetab, dbetao), tok * HV + vh, dbeta);
#else
    for (i64 i = r; i < K; i += GDNC_L) /* the entering state's share of the last row's term, D S0 . dS_L */
        tail += rlx_exp(cum[GDNC_L - 1]) * gdnc_dot_real(in.s0 + i * V, in.dsl + i * V, V);
    for (i64 s = 0; s < GDNC_L; ++s)
        dcum += e[r * GDNC_LP + s] - e[s * GDNC_LP + r];
    dcs[r] = dcum;
    tails[r] = tail;
    BARRIER();
    real dg = (real)0; /* dg_r = sum_(t >= r) dcum_t, the last row's terms (every row's share) first */
    for (i64 t = 0; t < GDNC_L; ++t)
        dg += tails[t];
    for (i64 t = GDNC_L - 1; t >= r; --t)
        dg += dcs[t];
    if (r < ch.n) {
        STORE(AT(store_t, dgb, dgo), tok * HV + vh, dg);
        STORE(AT(store_t, dbetab, dbetao), tok * HV + vh, dbeta);
    }
#endif
}

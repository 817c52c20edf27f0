/* mamba3_backward's chunked form (ABI.md §9, §11) at the gpu target, for batch rows below f64 (packed sequences and
 * f64 keep kernels/mamba3_backward.cl's step walk): §11's informative chunked form in reverse, in the forward's
 * chunks of M3C_Q tokens (kernels/mamba3.cl's m3c_* helpers precede this text; kernels/mamba3_backward.cl follows it,
 * whose turn, per-token, angle and reduce launches run around the three below).
 *
 * Per (row, head) and chunk, with c[t] the sum of adt over the chunk up to t, e[t][s] = exp(c[t] - c[s]), the
 * trapezoid's weight w[s] = gamma[s] + beta'[s+1] (beta' = (1 - lambda) dt, 0 past the row's last token),
 * om[t][s] = w[s] for s < t and gamma[t] for s = t, Sin the (folded) state entering the chunk (chunk 0's:
 * S0 = S_init + beta'[first] vbar (x) kbar), D the gradient of the one leaving it and gy = d_dst (* silu(z)):
 *   A[t][s] = e[t][s] (q~[t] . k~[s]),  B[t][s] = gy[t] . v[s]   (s <= t)
 *   y[t]    = exp(c[t]) Sin q~[t] + sum_{s<=t} om A[t][s] v[s]
 *   dv[s]   = sum_{t>=s} om A[t][s] gy[t] + e[last][s] w[s] D k~[s]
 *   dq~[t]  = exp(c[t]) Sin^T gy[t] + sum_{s<=t} om e B[t][s] k~[s]
 *   dk~[s]  = sum_{t>=s} om e B[t][s] q~[t] + e[last][s] w[s] D^T v[s]
 *   dw[s]   = sum_{t>s} A[t][s] B[t][s] + e[last][s] v[s] . D k~[s],   dgamma[s] = dw[s] + A[s][s] B[s][s]
 *   dc[t]   = gy[t] . y[t] - v[t] . dv[t] (+ <D, S_leaving> at the chunk's last token), d_adt[t] = sum_{t'>=t} dc[t']
 * beta'[t] takes dw[t-1] (the row's first token <D0, vbar (x) kbar>, D0 the initial state's gradient), and the
 * gradient of the state entering the chunk is exp(c[last]) D + sum_t exp(c[t]) gy[t] (x) q~[t].
 * Launches (launches/mamba3_chunk_backward.py), between mamba3_backward_turn and mamba3_backward_tokens:
 *   mamba3_cb_states  a work-group per (head, slot, M3C_PT state rows), as mamba3_chunk_state: gy into scratch, the
 *                     chunk's own state sum_s e[last][s] w[s] v[s] (x) k~[s] and its share of the entering gradient
 *                     sum_t exp(c[t]) gy[t] (x) q~[t], two products over the chunk in f32 on every path (no MMA
 *                     variant: their operands rounded to 16 bits push the angles' gradient past the conformance
 *                     bounds -- the score terms of d_angle_state cancel exactly, those of the states do not, and
 *                     what is left is small beside the rounding), and the chunk's decay exp(c[last]);
 *   mamba3_cb_pass    an item per (row, head, state row p): in chunk order the state entering each chunk over its own
 *                     one, in reverse the gradient of the state leaving each over its share, each chunk's row p of
 *                     <D, S_leaving>; with carry d_state (D0), d_v_state (beta'[first] D0 kbar; its incoming value,
 *                     the last value's gradient, kept in scratch);
 *   mamba3_cb_chunk   a work-group per (head, slot): A and B in LOCAL (their RLX_MMA variant on the tensor cores,
 *                     and first the state products D k~, S_in q~, S_in^T gy, D^T v there, from split operands),
 *                     then d_v, d_z, and the shares of q~, k~, d_adt, beta', gamma into the per-token launch's
 *                     partials (one block, `direct`), d_d's share per slot; the row's first chunk with carry kbar's
 *                     share (for d_k_state) and beta'[first]'s.
 * Every sum is a loop in one fixed order (the same bytes every run); loops over s <= t or t >= s are bounded, never
 * masked by a zero. One NaN spreads further than the walk's: d_adt is a sum of dc from the step on, and a NaN in v,
 * k or adt at token t reaches dc from t on, so d_adt of the chunk's tokens before t too (the walk's stay finite:
 * their terms cancel exactly, which NaN does not). Scratch is in the compute type (f32 for 16-bit thunks); d_ outputs are rounded once, on store. */
#if defined(RLX_TARGET_GPU) && !defined(RLX_NEED_FP64) /* f64 and the cpu target: the step walk */
#define M3CB_J (M3C_LANES / M3C_Q) /* lanes per step in mamba3_cb_chunk's per-token phases */
#if M3C_LANES % M3C_Q != 0
#error "mamba3_cb_chunk gives each step of a chunk M3C_LANES / M3C_Q lanes"
#endif

/* gy = d_dst (* silu(z)) at element `at` ([T][H][P]), the gradient of y before d and the gate. */
INLINE_FN real m3cb_gy(m3_io io, GLOBAL const store_t* go, i64 at)
{
    const real g = LOAD(go, at), zv = io.has_z ? LOAD(io.z, at) : (real)0;
    return io.has_z ? g * zv * sigmoid_r(zv) : g;
}

#ifndef RLX_MMA /* mamba3_cb_states: the portable program's only (the plan launches it without the MMA variant) */
/* out[p0+p][n] = sum_s x[s][p] m[s*stride + n] over the chunk's steps, rows p < np, a lane per (column, M3C_PS
 * rows). */
INLINE_FN void m3cb_product(GLOBAL real* out, LOCAL_PTR const real* x, GLOBAL const real* m, i64 stride, int steps,
                            i64 p0, int np, i64 N, int lane)
{
    for (i64 e = lane; e < (steps > 0 ? N * (M3C_PT / M3C_PS) : 0); e += M3C_LANES) {
        const i64 pb = e / N, n = e - pb * N;
        real acc[M3C_PS];
        PRAGMA_UNROLL
        for (int c = 0; c < M3C_PS; ++c)
            acc[c] = (real)0;
        for (int s = 0; s < steps; ++s) {
            const real mv = m[s * stride + n];
            PRAGMA_UNROLL
            for (int c = 0; c < M3C_PS; ++c)
                acc[c] += x[s * M3C_PT + pb * M3C_PS + c] * mv;
        }
        PRAGMA_UNROLL
        for (int c = 0; c < M3C_PS; ++c)
            if (pb * M3C_PS + c < np)
                out[(p0 + pb * M3C_PS + c) * N + n] = acc[c];
    }
}

/* A work-group per (head, slot, M3C_PT state rows), lanes as mamba3_chunk_state's: gy of the tile's rows into gys
 * ([T][H][P]); the chunk's own state into own and its share of the entering gradient into down ([H*K][P][N] each),
 * its decay into dec ([H*K]). */
KERNEL mamba3_cb_states(i64 R, i64 S, i64 H, i64 P, i64 N, i64 A, i64 G, int carry, int dt_real, int param_real,
    GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* adtb, i64 adto, GLOBAL uchar* trb, i64 tro, int has_d, int has_z,
    GLOBAL uchar* vb, i64 vo, GLOBAL uchar* zb, i64 zo, GLOBAL uchar* skb, i64 sko, i64 K, GLOBAL uchar* gob, i64 goo,
    GLOBAL uchar* qrb, i64 qro, GLOBAL uchar* krb, i64 kro, GLOBAL uchar* gyb, i64 gyo, GLOBAL uchar* ownb, i64 owno,
    GLOBAL uchar* downb, i64 downo, GLOBAL uchar* decb, i64 deco)
{
    LOCAL real cum[M3C_Q], wgt[M3C_Q], gam[M3C_Q];
    LOCAL int rs[M3C_Q];
    LOCAL real xw[M3C_Q * M3C_PT], gw[M3C_Q * M3C_PT];
    const int lane = (int)LID(0);
    m3_io io = m3_with_coeffs(m3_io_base(H, P, N, A, G, carry, dt_real, param_real, dtb, dto), adtb, adto, trb, tro);
    io = m3_with_values(io, has_d, has_z, vb, vo, zb, zo, skb, sko);
    const m3c_tile tile = m3c_tile_of(io, GROUP(0), R, S, K);
    const int steps = (int)tile.chunk.steps;
    const i64 first = tile.chunk.first, h = tile.h;
    m3c_stage_barrier(io, tile, lane, 1, cum, rs, wgt, gam, xw);
    GLOBAL real* gys = AT(real, gyb, gyo);
    for (int e = lane; e < M3C_Q * M3C_PT; e += M3C_LANES) { /* zero past the chunk's steps, which MMA tiles cover */
        const int s = e / M3C_PT, p = e - s * M3C_PT, in = s < steps && p < tile.np;
        const i64 at = ((first + s) * H + h) * P + tile.p0 + p;
        const real gy = in ? m3cb_gy(io, AT(store_t, gob, goo), at) : (real)0;
        if (in)
            gys[at] = gy;
        gw[e] = in ? m3c_decay(cum, rs, s, -1) * gy : (real)0;
    }
    if (tile.p0 == 0 && lane == 0 && steps > 0)
        AT(real, decb, deco)[tile.slot] = m3c_decay(cum, rs, steps - 1, -1);
    BARRIER();
    GLOBAL real* own = AT(real, ownb, owno) + tile.slot * P * N;
    GLOBAL real* down = AT(real, downb, downo) + tile.slot * P * N;
    GLOBAL const real* ks = AT(real, krb, kro) + (first * H + h) * N;
    GLOBAL const real* qs = AT(real, qrb, qro) + (first * H + h) * N;
    m3cb_product(own, xw, ks, H * N, steps, tile.p0, tile.np, N, lane);
    m3cb_product(down, gw, qs, H * N, steps, tile.p0, tile.np, N, lane);
}
#endif

/* Item GID(0) = (row, head, state row p), p fastest: column by column, the row's chunks walked forward (each slot's
 * own state in own becomes the state entering it, from S0) then back (each slot's share in down becomes the
 * gradient of the state leaving it, from d_state's entry with carry, else zero), ends[slot][p] summing
 * D_leaving . S_leaving over the columns; with carry D0 over d_state, dvin = the incoming d_v_state, then
 * d_v_state = beta'[first] D0 kbar. */
KERNEL mamba3_cb_pass(i64 R, i64 S, i64 H, i64 P, i64 N, i64 A, i64 G, int carry, int dt_real, int param_real,
    GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* adtb, i64 adto, GLOBAL uchar* trb, i64 tro, GLOBAL uchar* stb, i64 sto,
    GLOBAL uchar* ksb, i64 kso, GLOBAL uchar* vsb, i64 vso, int varlen, GLOBAL uchar* cub, i64 cuo, int slotted,
    GLOBAL uchar* slb, i64 slo, i64 K, GLOBAL uchar* dstb, i64 dsto, GLOBAL uchar* dvsb, i64 dvso, GLOBAL uchar* ownb,
    i64 owno, GLOBAL uchar* downb, i64 downo, GLOBAL uchar* decb, i64 deco, GLOBAL uchar* endsb, i64 endso,
    GLOBAL uchar* dvinb, i64 dvino)
{
    const i64 item = GID(0);
    if (item >= R * H * P)
        return;
    const i64 rh = item / P, p = item - rh * P, r = rh / H, h = rh - r * H, chunks = m3c_chunks(S), PN = P * N;
    m3_io io = m3_with_coeffs(m3_io_base(H, P, N, A, G, carry, dt_real, param_real, dtb, dto), adtb, adto, trb, tro);
    io = m3_with_rows(m3_with_state(io, stb, sto, ksb, kso, vsb, vso), varlen, cub, cuo, slotted, slb, slo);
    const m3_row row = m3_row_of(io, r, h, S);
    const i64 k0 = h * K + r * chunks, head = row.entry * H + h, at = (head * P + p) * N;
    GLOBAL real* own = AT(real, ownb, owno) + k0 * PN + p * N;
    GLOBAL real* down = AT(real, downb, downo) + k0 * PN + p * N;
    GLOBAL const real* dec = AT(real, decb, deco) + k0;
    GLOBAL real* ends = AT(real, endsb, endso) + k0 * P + p;
    GLOBAL real* dstate = AT(real, dstb, dsto);
    GLOBAL real* dv_state = AT(real, dvsb, dvso);
    const real bp0 = carry ? m3c_bprime(io, row.first, h) : (real)0;
    const real vbar = carry ? io.v_state[head * P + p] : (real)0;
    for (i64 k = 0; k < chunks; ++k)
        ends[k * P] = (real)0;
    real dvk = (real)0; /* D0[p] . kbar */
    for (i64 n = 0; n < N; ++n) {
        real s = carry ? io.state[at + n] + bp0 * vbar * io.k_state[head * N + n] : (real)0;
        for (i64 k = 0; k < chunks; ++k) {
            const real leaving = dec[k] * s + own[k * PN + n];
            own[k * PN + n] = s;
            s = leaving;
        }
        real d = carry ? dstate[at + n] : (real)0;
        for (i64 k = chunks - 1; k >= 0; --k) {
            ends[k * P] += d * (k + 1 < chunks ? own[(k + 1) * PN + n] : s);
            const real share = down[k * PN + n];
            down[k * PN + n] = d;
            d = dec[k] * d + share;
        }
        if (carry) {
            dstate[at + n] = d;
            dvk += d * io.k_state[head * N + n];
        }
    }
    if (carry) {
        AT(real, dvinb, dvino)[rh * P + p] = dv_state[head * P + p];
        dv_state[head * P + p] = bp0 * dvk;
    }
}

/* What mamba3_cb_chunk's phases read, each at the chunk's first token: q~, k~ (a token's N values HN apart), v, z,
 * gy, d_v, d_z, d_dst (HP apart), the entering state and the leaving one's gradient ([P][N]), the partials (a
 * token's TW apart). */
typedef struct {
    GLOBAL const real* qs;
    GLOBAL const real* ks;
    GLOBAL const store_t* v;
    GLOBAL const store_t* z;
    GLOBAL const real* gy;
    GLOBAL store_t* dv;
    GLOBAL store_t* dz;
    GLOBAL const store_t* go;
    GLOBAL const real* sin;
    GLOBAL const real* dout;
    GLOBAL real* part;
    i64 HN, HP, TW, P, N;
    int steps;
#ifdef RLX_MMA
    GLOBAL real* pr; /* the state products D k~ and S_in q~ of each step and row ([T][H][2P], 2HP apart) */
#endif
} m3cb_chunk_at;

/* The chunk's coefficients in LOCAL (m3c_stage_barrier's cum, rs, wgt, gam) and the products in LOCAL: A and B
 * ([M3C_Q][M3C_Q]) and the per-step sums (red, [4][M3CB_J][M3C_Q]: gy.y, v.dv, v.D k~, gy.v over each step's lanes). */
typedef struct {
    LOCAL_PTR const real* cum;
    LOCAL_PTR const int* rs;
    LOCAL_PTR const real* wgt;
    LOCAL_PTR const real* gam;
    LOCAL_PTR real* am;
    LOCAL_PTR real* bm;
    LOCAL_PTR real* red;
} m3cb_local;

/* The portable scores: am[t][s] = q~[t] . k~[s] and bm[t][s] = gy[t] . v[s] for s <= t < steps (the rest unwritten,
 * never read), a lane per entry. */
INLINE_FN void m3cb_scores(m3cb_chunk_at c, m3cb_local l, int lane)
{
    for (int e = lane; e < M3C_Q * M3C_Q; e += M3C_LANES) {
        const int t = e / M3C_Q, s = e - t * M3C_Q;
        if (s > t || t >= c.steps)
            continue;
        real qk = (real)0, gv = (real)0;
        for (i64 n = 0; n < c.N; ++n)
            qk += c.qs[t * c.HN + n] * c.ks[s * c.HN + n];
        for (i64 p = 0; p < c.P; ++p)
            gv += c.gy[t * c.HP + p] * LOAD(c.v, s * c.HP + p);
        l.am[e] = qk;
        l.bm[e] = gv;
    }
}

#ifdef RLX_MMA
#if M3C_PT != 16 || M3C_Q % 16 != 0 || M3C_LANES < 128
#error "the MMA variant of mamba3's chunk products tiles 16x16: M3C_PT = 16, M3C_Q % 16 = 0, 4 warps at least"
#endif
/* The scores on the tensor cores: the tiles on and below the diagonal of q~.k~^T over N and of gy.v^T over P, in
 * slices of 16 columns staged as operands (rows, cols: [M3C_Q][16], zero past the steps and the columns); warp w
 * accumulates tiles w and w + warps (mma_scan_pair) and stores them, f32, in am and bm. */
INLINE_FN void m3cb_scores_mma_barrier(m3cb_chunk_at c, m3cb_local l, LOCAL_PTR mma_t* rows, LOCAL_PTR mma_t* cols,
                                       int lane)
{
    const int tiles = M3C_Q / 16 * (M3C_Q / 16 + 1) / 2;
    for (int which = 0; which < 2; ++which) {
        const i64 width = which ? c.P : c.N;
        mma_scan_pair pair = mma_scan_pair_of(MMA_WARP(lane), M3C_LANES / 32, tiles, 0);
        for (i64 j0 = 0; j0 < (c.steps > 0 ? width : 0); j0 += 16) {
            BARRIER(); /* the previous slice's readers are done */
            for (int e = lane; e < M3C_Q * 16; e += M3C_LANES) {
                const int s = e / 16, jj = e - s * 16, in = s < c.steps && j0 + jj < width;
                const real a = !in ? (real)0 : which ? c.gy[s * c.HP + j0 + jj] : c.qs[s * c.HN + j0 + jj];
                const real b = !in ? (real)0 : which ? LOAD(c.v, s * c.HP + j0 + jj) : c.ks[s * c.HN + j0 + jj];
                rows[e] = TO_MMA(a);
                cols[e] = TO_MMA(b);
            }
            BARRIER();
            mma_scan_pair_add(&pair, rows, cols, cols);
        }
        mma_scan_pair_store(&pair, which ? l.bm : l.am, M3C_Q, l.am, M3C_PT);
    }
}
#endif

#ifdef RLX_MMA
/* Split operands, x = hi + lo (hi = x rounded to the operand type, lo = the rest, rounded as it enters the product),
 * the products hi.hi + hi.lo + lo.hi, f32 accumulation: rounded once, q~, k~, gy and the states D, S_in move the
 * angles' gradient (the score terms of d_angle_state cancel exactly, those of the states do not; emulated on PoCL,
 * B1 S150 H2 P40 N24 with every field: d_angle_state NMSE against the FMA kernels f16 3.6e-8, bf16 1.1e-5 -- a fifth
 * of its bound --, TF32 2.0e-7); split, 1.5e-12, 1.3e-11, 2.1e-12. A 16-bit thunk's own v is exact (lo = 0: no
 * lo.hi product); at TF32 every operand is split, its hi rounded as the tensor cores round (mma_hi,
 * kernels/mma_split.cl). */
#if M3C_Q != 64 || M3C_LANES != 256
#error "mamba3_cb_chunk's MMA state products tile [64 steps][32 columns] with 8 warps: M3C_Q = 64, M3C_LANES = 256"
#endif

/* The k-th state product's row operand at (step s, sum index i < its width), s < steps: k~, q~ (over N), gy, v (over
 * P). */
INLINE_FN real m3cb_product_row(m3cb_chunk_at c, int k, int s, i64 i)
{
    return k == 0 ? c.ks[s * c.HN + i] : k == 1 ? c.qs[s * c.HN + i] : k == 2 ? c.gy[s * c.HP + i]
                                                                             : LOAD(c.v, s * c.HP + i);
}

/* The chunk's four state products on the tensor cores, each into its place: D k~ and S_in q~ per step and row of P
 * ([steps][N] x [N][P]) into pr, S_in^T gy and D^T v per step and state column ([steps][P] x [P][N]) into the
 * partials' q~ and k~ entries, which m3cb_columns completes. By slices of 32 output columns: warp w accumulates the
 * 16 x 16 tile (w % 4, w / 4) of [M3C_Q steps][32] over the sum in slices of 16 staged as operands (rows [M3C_Q][16]
 * hi, then its lo part in the same place where split; cols [16][32] hi, then lo 512 on; zero past the chunk's
 * steps, the sum and the columns), stores it f32 in prod ([M3C_Q][M3C_Q], rows M3C_Q apart: the scores' am, unused
 * yet), whose entries within the steps and the columns go out. Every lane calls it (barriers, the first before any
 * staging, the last after every read of prod). */
INLINE_FN void m3cb_state_products_mma_barrier(m3cb_chunk_at c, LOCAL_PTR float* prod, LOCAL_PTR mma_t* rows,
                                               LOCAL_PTR mma_t* cols, int lane)
{
    const int w = MMA_WARP(lane), ti = w % 4, tj = w / 4;
    PRAGMA_NO_UNROLL
    for (int k = 0; k < 4; ++k) {
        const int pside = k < 2, lo_rows = RLX_MMA == 2 || k != 3; /* P columns (pr) or N (the partials) */
        const i64 width = pside ? c.P : c.N, sum = pside ? c.N : c.P;
        GLOBAL const real* st = k == 0 || k == 3 ? c.dout : c.sin; /* [P][N] */
        for (i64 c0 = 0; c0 < (c.steps > 0 ? width : 0); c0 += 32) {
            mma_acc acc;
            mma_zero(&acc);
            for (i64 k0 = 0; k0 < sum; k0 += 16) {
                PRAGMA_NO_UNROLL /* hi, then its lo part where split */
                for (int part = 0; part < (lo_rows ? 2 : 1); ++part) {
                    BARRIER(); /* the previous operands and products are read no more */
                    PRAGMA_NO_UNROLL
                    for (int e = lane; e < M3C_Q * 16; e += M3C_LANES) {
                        const int s = e / 16;
                        const i64 i = k0 + e % 16;
                        const real v = s < c.steps && i < sum ? m3cb_product_row(c, k, s, i) : (real)0;
                        const float hi = mma_hi(v);
                        rows[e] = TO_MMA(part ? v - hi : hi);
                    }
                    PRAGMA_NO_UNROLL
                    for (int e = lane; e < (part ? 0 : 512); e += M3C_LANES) {
                        const int kk = e / 32, j = e - kk * 32; /* a step of the sum, an output column */
                        const i64 i = k0 + kk, col = c0 + j;
                        const real v = i < sum && col < width ? (pside ? st[col * c.N + i] : st[i * c.N + col])
                                                              : (real)0;
                        const float hi = mma_hi(v);
                        cols[e] = TO_MMA(hi);
                        cols[512 + e] = TO_MMA(v - hi);
                    }
                    BARRIER();
                    PRAGMA_NO_UNROLL /* hi.hi and hi.lo, then lo.hi */
                    for (int h = 0; h < (part ? 1 : 2); ++h)
                        mma_tile(&acc, MMA_ROW, rows + ti * 256, 16, MMA_ROW, cols + (h ? 512 : 0) + tj * 16, 32);
                }
            }
            BARRIER(); /* the previous slice's prod is read no more */
            mma_store(prod + ti * 16 * M3C_Q + tj * 16, &acc, M3C_Q);
            BARRIER();
            PRAGMA_NO_UNROLL
            for (int e = lane; e < M3C_Q * 32; e += M3C_LANES) {
                const int s = e / 32, j = e - s * 32;
                const i64 col = c0 + j;
                if (s < c.steps && col < width) {
                    const real x = prod[s * M3C_Q + j];
                    if (pside)
                        c.pr[s * 2 * c.HP + k * c.P + col] = x;
                    else
                        c.part[s * c.TW + 3 + (k - 2) * c.N + col] = x;
                }
            }
        }
    }
    BARRIER();
}
#endif

/* The scores turned into what the phases read, in three passes (a barrier after each): am decayed (A); then per
 * step s dws[s] = sum_{t>s} A[t][s] B[t][s] and dgd[s] = A[s][s] B[s][s]; then am = om A and bm = om e B. */
INLINE_FN void m3cb_weigh_barrier(m3cb_chunk_at c, m3cb_local l, LOCAL_PTR real* dws, LOCAL_PTR real* dgd, int lane)
{
    BARRIER();
    for (int e = lane; e < M3C_Q * M3C_Q; e += M3C_LANES) {
        const int t = e / M3C_Q, s = e - t * M3C_Q;
        if (s < t && t < c.steps)
            l.am[e] *= m3c_decay(l.cum, l.rs, t, s);
    }
    BARRIER();
    if (lane < c.steps) {
        real sum = (real)0;
        for (int t = lane + 1; t < c.steps; ++t)
            sum += l.am[t * M3C_Q + lane] * l.bm[t * M3C_Q + lane];
        dws[lane] = sum;
        dgd[lane] = l.am[lane * M3C_Q + lane] * l.bm[lane * M3C_Q + lane];
    }
    BARRIER();
    for (int e = lane; e < M3C_Q * M3C_Q; e += M3C_LANES) {
        const int t = e / M3C_Q, s = e - t * M3C_Q;
        if (s <= t && t < c.steps) {
            const real om = s < t ? l.wgt[s] : l.gam[t];
            l.am[e] *= om;
            l.bm[e] *= s < t ? om * m3c_decay(l.cum, l.rs, t, s) : om;
        }
    }
    BARRIER();
}

/* Step i's rows p = j, j + M3CB_J, ... (lane i + j*M3C_Q): d_v (with the skip, and dvin at the row's last token),
 * d_z, and the lane's shares of the step's sums into red. */
INLINE_FN void m3cb_rows(m3_io io, m3cb_chunk_at c, m3cb_local l, GLOBAL const real* dvin, real dh, int last, int i,
                         int j)
{
    real sy = (real)0, svdv = (real)0, svdk = (real)0, sgv = (real)0;
    const real fade = i < c.steps ? m3c_decay(l.cum, l.rs, c.steps - 1, i) * l.wgt[i] : (real)0;
    const real grow = i < c.steps ? m3c_decay(l.cum, l.rs, i, -1) : (real)0;
    for (i64 p = j; p < (i < c.steps ? c.P : 0); p += M3CB_J) {
        real dv = (real)0, y = (real)0, dk = (real)0, sq = (real)0;
        for (int t = i; t < c.steps; ++t)
            dv += l.am[t * M3C_Q + i] * c.gy[t * c.HP + p];
        for (int s = 0; s <= i; ++s)
            y += l.am[i * M3C_Q + s] * LOAD(c.v, s * c.HP + p);
#ifdef RLX_MMA /* the tensor cores' (m3cb_state_products_mma_barrier) */
        dk = c.pr[i * 2 * c.HP + p];
        sq = c.pr[i * 2 * c.HP + c.P + p];
#else
        for (i64 n = 0; n < c.N; ++n) {
            dk += c.dout[p * c.N + n] * c.ks[i * c.HN + n];
            sq += c.sin[p * c.N + n] * c.qs[i * c.HN + n];
        }
#endif
        dv += fade * dk;
        y += grow * sq;
        const i64 at = i * c.HP + p;
        const real xv = LOAD(c.v, at), gy = c.gy[at];
        STORE(c.dv, at, dv + dh * gy + (last && io.carry ? dvin[p] : (real)0));
        if (io.has_z) { /* out = (y + d*v) * silu(z) */
            const real zv = LOAD(c.z, at), sz = sigmoid_r(zv);
            STORE(c.dz, at, LOAD(c.go, at) * (y + dh * xv) * sz * ((real)1 + zv * ((real)1 - sz)));
        }
        sy += gy * y;
        svdv += xv * dv;
        svdk += xv * dk;
        sgv += gy * xv;
    }
    l.red[(0 * M3CB_J + j) * M3C_Q + i] = sy;
    l.red[(1 * M3CB_J + j) * M3C_Q + i] = svdv;
    l.red[(2 * M3CB_J + j) * M3C_Q + i] = svdk;
    l.red[(3 * M3CB_J + j) * M3C_Q + i] = sgv;
}

/* Step i's columns n = j, j + M3CB_J, ...: its shares of the gradients of q~ and k~ into the partials (with the
 * incoming d_k_state at the row's last token). */
INLINE_FN void m3cb_columns(m3_io io, m3cb_chunk_at c, m3cb_local l, GLOBAL const real* dks, int last, int i, int j)
{
    const real fade = i < c.steps ? m3c_decay(l.cum, l.rs, c.steps - 1, i) * l.wgt[i] : (real)0;
    const real grow = i < c.steps ? m3c_decay(l.cum, l.rs, i, -1) : (real)0;
    for (i64 n = j; n < (i < c.steps ? c.N : 0); n += M3CB_J) {
        real dq = (real)0, dk = (real)0, sg = (real)0, dv = (real)0;
        for (int s = 0; s <= i; ++s)
            dq += l.bm[i * M3C_Q + s] * c.ks[s * c.HN + n];
        for (int t = i; t < c.steps; ++t)
            dk += l.bm[t * M3C_Q + i] * c.qs[t * c.HN + n];
#ifdef RLX_MMA /* the tensor cores' (m3cb_state_products_mma_barrier), where they go */
        sg = c.part[i * c.TW + 3 + n];
        dv = c.part[i * c.TW + 3 + c.N + n];
#else
        for (i64 p = 0; p < c.P; ++p) {
            sg += c.sin[p * c.N + n] * c.gy[i * c.HP + p];
            dv += c.dout[p * c.N + n] * LOAD(c.v, i * c.HP + p);
        }
#endif
        GLOBAL real* pt = c.part + i * c.TW;
        pt[3 + n] = dq + grow * sg;
        pt[3 + c.N + n] = dk + fade * dv + (last && io.carry ? dks[n] : (real)0);
    }
}

/* Per step i (lanes j == 0): its sums over the rows (red, in lane order), dc (with <D, S_leaving> at the chunk's last
 * step, the pass's rows of it in ends summed), dw with its own-state term; after a barrier d_adt (dc summed from i
 * on) and the partials: d_adt, gamma's gradient, and beta''s of the row's next token (dw; `left`: the tokens from
 * the chunk's first to the row's end). The step's gy.v sum is left in red[3][0][i]. */
INLINE_FN void m3cb_steps_barrier(m3cb_chunk_at c, m3cb_local l, GLOBAL const real* ends, i64 left,
                                  LOCAL_PTR real* dws, LOCAL_PTR const real* dgd, LOCAL_PTR real* dcs, int i, int j)
{
    if (j == 0 && i < c.steps) {
        real sum[4];
        PRAGMA_UNROLL
        for (int k = 0; k < 4; ++k) {
            sum[k] = (real)0;
            for (int jj = 0; jj < M3CB_J; ++jj)
                sum[k] += l.red[(k * M3CB_J + jj) * M3C_Q + i];
        }
        real dc = sum[0] - sum[1];
        for (i64 p = 0; p < (i == c.steps - 1 ? c.P : 0); ++p)
            dc += ends[p];
        dcs[i] = dc;
        dws[i] += m3c_decay(l.cum, l.rs, c.steps - 1, i) * sum[2];
        l.red[(3 * M3CB_J) * M3C_Q + i] = sum[3];
    }
    BARRIER();
    if (j == 0 && i < c.steps) {
        real dadt = (real)0;
        for (int t = c.steps - 1; t >= i; --t)
            dadt += dcs[t];
        GLOBAL real* pt = c.part + i * c.TW;
        pt[0] = dadt;
        pt[2] = dws[i] + dgd[i];
        if (i + 1 < left)
            pt[c.TW + 1] = dws[i];
    }
}

/* The row's first chunk with carry: kbar's share, beta'[first] D0^T vbar, into dk0 (N values), and beta'[first]'s
 * gradient <D0, vbar (x) kbar> (lane 0's, returned; 0 elsewhere), D0 at d0, vbar, kbar of the row's entry. */
INLINE_FN real m3cb_first(m3_io io, GLOBAL const real* d0, GLOBAL const real* vbar, GLOBAL const real* kbar,
                          real bp0, GLOBAL real* dk0, int lane)
{
    real dbp = (real)0;
    for (i64 n = lane; n < io.N; n += M3C_LANES) {
        real sum = (real)0;
        for (i64 p = 0; p < io.P; ++p)
            sum += d0[p * io.N + n] * vbar[p];
        dk0[n] = bp0 * sum;
    }
    for (i64 p = 0; p < (lane == 0 ? io.P : 0); ++p) {
        real row = (real)0;
        for (i64 n = 0; n < io.N; ++n)
            row += d0[p * io.N + n] * kbar[n];
        dbp += vbar[p] * row;
    }
    return dbp;
}

/* A work-group per (head, slot) of M3C_LANES lanes: the scores, then d_v and d_z (M3CB_J lanes per step over the
 * rows), the shares of q~ and k~ (over the columns), then per step d_adt, beta' (of the next token), gamma into the
 * partials ([T][H][W]: d_adt, beta', gamma, then q~, k~), d_d's share into ddp ([K][H]); ends: the pass's
 * <D, S_leaving> rows; dvin: the incoming d_v_state; dk0 ([R][H][N]): kbar's share. */
KERNEL mamba3_cb_chunk(i64 R, i64 S, i64 H, i64 P, i64 N, i64 A, i64 G, int carry, int dt_real, int param_real,
    GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* adtb, i64 adto, GLOBAL uchar* trb, i64 tro, int has_d, int has_z,
    GLOBAL uchar* vb, i64 vo, GLOBAL uchar* zb, i64 zo, GLOBAL uchar* skb, i64 sko, GLOBAL uchar* stb, i64 sto,
    GLOBAL uchar* ksb, i64 kso, GLOBAL uchar* vsb, i64 vso, int varlen, GLOBAL uchar* cub, i64 cuo, int slotted,
    GLOBAL uchar* slb, i64 slo, i64 K, i64 W, GLOBAL uchar* gob, i64 goo, GLOBAL uchar* dvb, i64 dvo, GLOBAL uchar* dzb,
    i64 dzo, GLOBAL uchar* dstb, i64 dsto, GLOBAL uchar* dksb, i64 dkso, GLOBAL uchar* qrb, i64 qro, GLOBAL uchar* krb,
    i64 kro, GLOBAL uchar* gyb, i64 gyo, GLOBAL uchar* ownb, i64 owno, GLOBAL uchar* downb, i64 downo,
    GLOBAL uchar* endsb, i64 endso, GLOBAL uchar* dvinb, i64 dvino, GLOBAL uchar* partb, i64 parto,
    GLOBAL uchar* dk0b, i64 dk0o, GLOBAL uchar* ddpb, i64 ddpo, GLOBAL uchar* prb, i64 pro)
{
    LOCAL real cum[M3C_Q], wgt[M3C_Q], gam[M3C_Q], dws[M3C_Q], dgd[M3C_Q], dcs[M3C_Q];
    M3C_LOCAL real am[M3C_Q * M3C_Q], bm[M3C_Q * M3C_Q];
    LOCAL real red[4 * M3CB_J * M3C_Q];
    LOCAL int rs[M3C_Q];
    M3C_LOCAL m3c_op_t xs[M3C_Q * M3C_PT];
    const int lane = (int)LID(0), j = lane / M3C_Q, i = lane - j * M3C_Q;
    m3_io io = m3_with_coeffs(m3_io_base(H, P, N, A, G, carry, dt_real, param_real, dtb, dto), adtb, adto, trb, tro);
    io = m3_with_values(io, has_d, has_z, vb, vo, zb, zo, skb, sko);
    io = m3_with_rows(m3_with_state(io, stb, sto, ksb, kso, vsb, vso), varlen, cub, cuo, slotted, slb, slo);
    const m3c_tile tile = m3c_tile_of(io, GROUP(0) * ((P + M3C_PT - 1) / M3C_PT), R, S, K); /* rows from 0 */
    const m3c_chunk ch = tile.chunk;
    const i64 h = tile.h, head = ((io.slots ? (i64)io.slots[ch.row] : ch.row) * H + h);
    m3c_stage_barrier(io, tile, lane, 0, cum, rs, wgt, gam, xs);
    const m3cb_local l = {cum, rs, wgt, gam, am, bm, red};
    const m3cb_chunk_at c = {AT(real, qrb, qro) + (ch.first * H + h) * N, AT(real, krb, kro) + (ch.first * H + h) * N,
                             io.v + (ch.first * H + h) * P, io.z + (ch.first * H + h) * P,
                             AT(real, gyb, gyo) + (ch.first * H + h) * P,
                             AT(store_t, dvb, dvo) + (ch.first * H + h) * P, AT(store_t, dzb, dzo) + (ch.first * H + h) * P,
                             AT(store_t, gob, goo) + (ch.first * H + h) * P, AT(real, ownb, owno) + tile.slot * P * N,
                             AT(real, downb, downo) + tile.slot * P * N, AT(real, partb, parto) + (ch.first * H + h) * W,
                             H * N, H * P, H * W, P, N, (int)ch.steps
#ifdef RLX_MMA
                             , AT(real, prb, pro) + (ch.first * H + h) * 2 * P
#endif
                            };
#ifdef RLX_MMA
    MMA_LOCAL mma_t cols[M3C_Q * 16];
    m3cb_state_products_mma_barrier(c, am, xs, cols, lane); /* xs, cols: the operands; am: the products */
    m3cb_scores_mma_barrier(c, l, xs, cols, lane); /* xs ([M3C_Q][16]: the stage's values, unread) holds the rows */
#else
    m3cb_scores(c, l, lane);
#endif
    m3cb_weigh_barrier(c, l, dws, dgd, lane);
    const int last = ch.first + i + 1 == ch.end;
    m3cb_rows(io, c, l, AT(real, dvinb, dvino) + (ch.row * H + h) * P,
              has_d ? load_any(io.d, h, param_real) : (real)0, last, i, j);
    m3cb_columns(io, c, l, AT(real, dksb, dkso) + head * N, last, i, j);
    BARRIER();
    m3cb_steps_barrier(c, l, AT(real, endsb, endso) + tile.slot * P, ch.end - ch.first, dws, dgd, dcs, i, j);
    const int first_chunk = ch.first + S == ch.end && c.steps > 0;
    real dbp = (real)0;
    if (first_chunk && carry)
        dbp = m3cb_first(io, AT(real, dstb, dsto) + head * P * N, io.v_state + head * P, io.k_state + head * N,
                         m3c_bprime(io, ch.first, h), AT(real, dk0b, dk0o) + (ch.row * H + h) * N, lane);
    if (first_chunk && lane == 0)
        c.part[1] = dbp;
    if (lane == 0) {
        real dd = (real)0;
        for (int s = 0; s < c.steps; ++s)
            dd += red[(3 * M3CB_J) * M3C_Q + s];
        AT(real, ddpb, ddpo)[(tile.slot - h * K) * H + h] = dd;
    }
}
#endif

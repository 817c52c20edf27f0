/* State-space family (ABI.md §4), in two shapes chosen by the program's target.
 * cpu: one work-item owns one row of the state (mamba2: M2_PB rows) and walks the sequence, so no
 * step needs a barrier; the state row stays in private memory in the compute type. Each step
 * updates the row in one loop (no loop-carried dependence: vectorizable) and reduces it in another
 * with SSM_ACC independent partial sums, so the sum is not one serial add chain.
 * gpu: a row's state spread across the lanes of a work-group (decode, short sequences), and the
 * chunked forms for long sequences (selective_scan_chunked, mamba2_chunk_*); see the gpu block. */

#ifdef RLX_TARGET_CPU /* cpu target (PoCL): the kernels up to the gpu block below */
#define SSM_ACC 8 /* the stores below sum exactly these 8 partial sums */

/* Mamba-1, the walk of one channel for a state_size fixed at compile time (W, a power of two): the
 * state row lives in registers and each step is straight-line code over W contiguous values, so the
 * (plain-arithmetic) exp, the update and the products vectorize across n; y sums by a pairwise tree. */
#define SS_FIXED(W)                                                                                   \
    INLINE_FN void selective_scan_w##W(i64 S, i64 H, i64 ch, i64 bt, GLOBAL const store_t* x,          \
                                       GLOBAL const store_t* delta, GLOBAL const store_t* a,           \
                                       GLOBAL const store_t* bm, GLOBAL const store_t* cm,             \
                                       GLOBAL store_t* dst)                                            \
    {                                                                                                 \
        real h[W], av[W], y[W];                                                                       \
        PRAGMA_UNROLL                                                                                 \
        for (int n = 0; n < W; ++n) {                                                                 \
            h[n] = (real)0;                                                                           \
            av[n] = LOAD(a, n);                                                                       \
        }                                                                                             \
        for (i64 t = 0; t < S; ++t) {                                                                 \
            const i64 row = bt * S + t;                                                               \
            GLOBAL const store_t* brow = bm + row * W;                                                \
            GLOBAL const store_t* crow = cm + row * W;                                                \
            const real dl = LOAD(delta, row * H + ch), dx = dl * LOAD(x, row * H + ch);               \
            PRAGMA_UNROLL                                                                             \
            for (int n = 0; n < W; ++n) {                                                             \
                h[n] = rlx_exp(dl * av[n]) * h[n] + dx * LOAD(brow, n);                               \
                y[n] = LOAD(crow, n) * h[n];                                                          \
            }                                                                                         \
            PRAGMA_UNROLL                                                                             \
            for (int w = W / 2; w > 0; w /= 2)                                                        \
                PRAGMA_UNROLL                                                                         \
                for (int n = 0; n < w; ++n)                                                           \
                    y[n] += y[n + w];                                                                 \
            STORE(dst, row * H + ch, y[0]);                                                           \
        }                                                                                             \
    }
SS_FIXED(16)

/* Mamba-1: per (channel ch, batch row bb), h[n] = exp(delta*a[ch,n])*h[n] + delta*b[n]*x; y = sum_n c[n]*h[n]. */
KERNEL selective_scan(i64 B, i64 S, i64 H, i64 N,
                      GLOBAL uchar* xb, i64 xo, GLOBAL uchar* deb, i64 deo, GLOBAL uchar* ab, i64 ao,
                      GLOBAL uchar* bb, i64 bo, GLOBAL uchar* cb, i64 co, GLOBAL uchar* db, i64 dof)
{
    const i64 ch = GID(0), bt = GID(1);
    if (ch >= H || bt >= B)
        return;
    GLOBAL const store_t* x = AT(store_t, xb, xo);
    GLOBAL const store_t* delta = AT(store_t, deb, deo);
    GLOBAL const store_t* a = AT(store_t, ab, ao) + ch * N;
    GLOBAL const store_t* bm = AT(store_t, bb, bo);
    GLOBAL const store_t* cm = AT(store_t, cb, co);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    if (N == 16) {
        selective_scan_w16(S, H, ch, bt, x, delta, a, bm, cm, dst);
        return;
    }
    real h[STATE_MAX], av[STATE_MAX];
    for (i64 n = 0; n < N; ++n) {
        h[n] = (real)0;
        av[n] = LOAD(a, n);
    }
    for (i64 t = 0; t < S; ++t) {
        const i64 row = bt * S + t;
        GLOBAL const store_t* brow = bm + row * N;
        GLOBAL const store_t* crow = cm + row * N;
        const real dl = LOAD(delta, row * H + ch), dx = dl * LOAD(x, row * H + ch);
        for (i64 n = 0; n < N; ++n)
            h[n] = exp(dl * av[n]) * h[n] + dx * LOAD(brow, n);
        real y[SSM_ACC];
        for (int r = 0; r < SSM_ACC; ++r)
            y[r] = (real)0;
        i64 n = 0;
        for (; n + SSM_ACC <= N; n += SSM_ACC)
            for (int r = 0; r < SSM_ACC; ++r)
                y[r] += LOAD(crow, n + r) * h[n + r];
        for (; n < N; ++n)
            y[0] += LOAD(crow, n) * h[n];
        STORE(dst, row * H + ch, ((y[0] + y[1]) + (y[2] + y[3])) + ((y[4] + y[5]) + (y[6] + y[7])));
    }
}

/* Mamba-2 (SSD): per (p, head hh, batch row bt), S[p,n] = exp(dt*a[hh])*S[p,n] + dt*x[p]*b[n]; y[p] = sum_n S[p,n]*c[n].
 * One work-item owns M2_PB adjacent p (rows of the state) of one (head, batch row) and walks the
 * sequence. The item's rows are the innermost, contiguous index of its private state s[n*M2_PB + c],
 * so each b[n] / c[n] load serves M2_PB rows and the row loop (fully unrolled) vectorizes; the decay
 * is one scalar per (step, head). A step is two passes over the state: the update, then the output
 * sum with two independent partial sums per row (even and odd n), so the sum over n is not one
 * serial FMA chain. Fused into one pass, PoCL's vectorizer split and spilled the accumulators (f32
 * B=2 S=1024 H=8 P=64 N=64: 7.8 ms fused vs 4.3 ms in two passes; 16 rows per item vs 8: 4.3 vs 14;
 * four partial sums instead of two: 5.0). */
KERNEL mamba2(i64 B, i64 S, i64 HD, i64 P, i64 N,
              GLOBAL uchar* xb, i64 xo, GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* ab, i64 ao,
              GLOBAL uchar* bb, i64 bo, GLOBAL uchar* cb, i64 co, GLOBAL uchar* db, i64 dof)
{
    const i64 p0 = GID(0) * M2_PB, hh = GID(1), bt = GID(2);
    if (p0 >= P || hh >= HD || bt >= B)
        return;
    const int np = P - p0 < M2_PB ? (int)(P - p0) : M2_PB; /* rows of this item inside the head */
    GLOBAL const store_t* x = AT(store_t, xb, xo);
    GLOBAL const store_t* dt = AT(store_t, dtb, dto);
    GLOBAL const store_t* bm = AT(store_t, bb, bo);
    GLOBAL const store_t* cm = AT(store_t, cb, co);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    const real a = LOAD(AT(store_t, ab, ao), hh);
    real s[STATE_MAX * M2_PB];
    for (i64 n = 0; n < N; ++n)
        PRAGMA_UNROLL
        for (int c = 0; c < M2_PB; ++c)
            s[n * M2_PB + c] = (real)0;
    for (i64 t = 0; t < S; ++t) {
        const i64 head = (bt * S + t) * HD + hh;
        GLOBAL const store_t* brow = bm + head * N;
        GLOBAL const store_t* crow = cm + head * N;
        const real d = LOAD(dt, head), decay = exp(d * a);
        real dx[M2_PB], y0[M2_PB], y1[M2_PB];
        PRAGMA_UNROLL
        for (int c = 0; c < M2_PB; ++c) {
            dx[c] = c < np ? d * LOAD(x, head * P + p0 + c) : (real)0;
            y0[c] = y1[c] = (real)0;
        }
        for (i64 n = 0; n < N; ++n) {
            const real b0 = LOAD(brow, n);
            PRAGMA_UNROLL
            for (int c = 0; c < M2_PB; ++c)
                s[n * M2_PB + c] = decay * s[n * M2_PB + c] + dx[c] * b0;
        }
        i64 n = 0;
        for (; n + 2 <= N; n += 2) {
            const real c0 = LOAD(crow, n), c1 = LOAD(crow, n + 1);
            PRAGMA_UNROLL
            for (int c = 0; c < M2_PB; ++c) {
                y0[c] += s[n * M2_PB + c] * c0;
                y1[c] += s[(n + 1) * M2_PB + c] * c1;
            }
        }
        if (n < N) {
            const real c0 = LOAD(crow, n);
            PRAGMA_UNROLL
            for (int c = 0; c < M2_PB; ++c)
                y0[c] += s[n * M2_PB + c] * c0;
        }
        PRAGMA_UNROLL
        for (int c = 0; c < M2_PB; ++c)
            if (c < np)
                STORE(dst, head * P + p0 + c, y0[c] + y1[c]);
    }
}
#endif

#if defined(RLX_TARGET_GPU) && defined(SSM_N) /* a gpu program variant: SSM_N, SSM_L from its launch */
/* GPU shapes (target gpu): the state of one row (selective_scan: one channel of one batch row;
 * mamba2: one head_dim position p of one (batch row, head)) is spread across SSM_L lanes of a
 * work-group, each lane holding SSM_W = SSM_N / SSM_L values in registers (a fixed-size private
 * array, fully unrolled: no stack). Lane nl holds n = w*SSM_L + nl, so the lanes of a row read b and
 * c contiguously. SSM_N (the state-size variant, >= state_size) and SSM_L come from the launch's
 * defines, SSM_WG (the largest work-group) from the gpu tuning table. Each step the lanes' partial sums of y meet in LOCAL
 * memory, double-buffered so that one barrier per step suffices: the buffer written at step t is
 * rewritten only at step t+2, after every reader of step t has passed the barrier of step t+1.
 * The grid is 1-D (groups of rows folded into x), so no extent reaches CUDA's 65,535 cap on y/z. */
#define SSM_W (SSM_N / SSM_L)


/* Mamba-1, rows = (batch row, channel): h[n] = exp(delta*a[ch,n])*h[n] + delta*x*b[n]; y = sum_n c[n]*h[n]. */
KERNEL selective_scan_lanes(i64 B, i64 S, i64 H, i64 N,
                            GLOBAL uchar* xb, i64 xo, GLOBAL uchar* deb, i64 deo, GLOBAL uchar* ab, i64 ao,
                            GLOBAL uchar* bb, i64 bo, GLOBAL uchar* cb, i64 co, GLOBAL uchar* db, i64 dof)
{
    LOCAL real part[2 * SSM_WG];
    /* remainders as x - q*d, not %: LLVM turns a div/rem pair into a `freeze`, which Oclgrind rejects */
    const int lane = (int)LID(0), r = lane / SSM_L, nl = lane - r * SSM_L, first = r * SSM_L;
    const i64 rows = LSIZE(0) / SSM_L, blocks = (H + rows - 1) / rows;
    const i64 bt = GROUP(0) / blocks, ch = (GROUP(0) - bt * blocks) * rows + r;
    const int live = ch < H; /* a lane past the last channel still meets every barrier */
    GLOBAL const store_t* x = AT(store_t, xb, xo);
    GLOBAL const store_t* delta = AT(store_t, deb, deo);
    GLOBAL const store_t* a = AT(store_t, ab, ao) + (live ? ch : 0) * N;
    GLOBAL const store_t* bm = AT(store_t, bb, bo);
    GLOBAL const store_t* cm = AT(store_t, cb, co);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    real h[SSM_W], av[SSM_W];
    PRAGMA_UNROLL
    for (int w = 0; w < SSM_W; ++w) {
        const int n = w * SSM_L + nl;
        h[w] = (real)0;
        av[w] = n < N ? LOAD(a, n) : (real)0;
    }
    for (i64 t = 0; t < S; ++t) {
        const i64 row = bt * S + t;
        GLOBAL const store_t* brow = bm + row * N;
        GLOBAL const store_t* crow = cm + row * N;
        const real dl = live ? LOAD(delta, row * H + ch) : (real)0;
        const real dx = live ? dl * LOAD(x, row * H + ch) : (real)0;
        real y = (real)0;
        PRAGMA_UNROLL
        for (int w = 0; w < SSM_W; ++w) {
            const int n = w * SSM_L + nl;
            if (n < N) {
                h[w] = rlx_exp(dl * av[w]) * h[w] + dx * LOAD(brow, n);
                y += LOAD(crow, n) * h[w];
            }
        }
        const int buf = (int)(t & 1) * SSM_WG;
        part[buf + lane] = y;
        BARRIER();
        if (live && nl == 0) {
            SSM_ROW_SUM(y, part, buf + first);
            STORE(dst, row * H + ch, y);
        }
    }
}

/* Mamba-2, rows = (batch row, head, p): S[p,n] = exp(dt*a[hh])*S[p,n] + dt*x[p]*b[n]; y[p] = sum_n S[p,n]*c[n]. */
KERNEL mamba2_lanes(i64 B, i64 S, i64 HD, i64 P, i64 N,
                    GLOBAL uchar* xb, i64 xo, GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* ab, i64 ao,
                    GLOBAL uchar* bb, i64 bo, GLOBAL uchar* cb, i64 co, GLOBAL uchar* db, i64 dof)
{
    LOCAL real part[2 * SSM_WG];
    /* remainders as x - q*d, not %: LLVM turns a div/rem pair into a `freeze`, which Oclgrind rejects */
    const int lane = (int)LID(0), r = lane / SSM_L, nl = lane - r * SSM_L, first = r * SSM_L;
    const i64 rows = LSIZE(0) / SSM_L, blocks = (P + rows - 1) / rows;
    const i64 hb = GROUP(0) / blocks, bt = hb / HD, hh = hb - bt * HD, p = (GROUP(0) - hb * blocks) * rows + r;
    const int live = p < P;
    GLOBAL const store_t* x = AT(store_t, xb, xo);
    GLOBAL const store_t* dt = AT(store_t, dtb, dto);
    GLOBAL const store_t* bm = AT(store_t, bb, bo);
    GLOBAL const store_t* cm = AT(store_t, cb, co);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    const real a = LOAD(AT(store_t, ab, ao), hh);
    real s[SSM_W];
    PRAGMA_UNROLL
    for (int w = 0; w < SSM_W; ++w)
        s[w] = (real)0;
    for (i64 t = 0; t < S; ++t) {
        const i64 head = (bt * S + t) * HD + hh;
        GLOBAL const store_t* brow = bm + head * N;
        GLOBAL const store_t* crow = cm + head * N;
        const real d = LOAD(dt, head), decay = rlx_exp(d * a);
        const real dx = live ? d * LOAD(x, head * P + p) : (real)0;
        real y = (real)0;
        PRAGMA_UNROLL
        for (int w = 0; w < SSM_W; ++w) {
            const int n = w * SSM_L + nl;
            if (n < N) {
                s[w] = decay * s[w] + dx * LOAD(brow, n);
                y += s[w] * LOAD(crow, n);
            }
        }
        const int buf = (int)(t & 1) * SSM_WG;
        part[buf + lane] = y;
        BARRIER();
        if (live && nl == 0) {
            SSM_ROW_SUM(y, part, buf + first);
            STORE(dst, head * P + p, y);
        }
    }
}
#endif

#if defined(RLX_TARGET_GPU) && !defined(SSM_N) /* the gpu program without variant defines: the chunked forms */
/* Mamba-1 chunked over the sequence (target gpu, long sequences): one work-group per (batch row,
 * block of SSC_CB channels). The group walks the sequence in chunks of SSC_SL*SSC_T steps; the SSC_SL
 * lanes of a channel each own SSC_T consecutive steps of the chunk (lanes of adjacent channels are
 * adjacent, so the x/delta/y accesses of one step are contiguous). The state index n is a loop, so
 * no register array depends on state_size. Per n:
 *   1. each lane composes its own steps into (A, B): h_out = A*h_in + B, with the per-step decay
 *      exp(delta*a[n]) and input delta*x*b[n] kept in registers, and publishes (A, B) in LOCAL;
 *   2. after a barrier each lane forms its entering state from the channel's state at the chunk
 *      start (LOCAL `carry`) composed with the (A, B) of the channel's earlier lanes, in order, and
 *      reruns its steps, adding c[n]*h to its outputs;
 *   3. after a second barrier the channel's last lane stores its final h as the next chunk's start.
 * Steps past the sequence end compose as the identity (A=1, B=0): masked, never multiplied by
 * zero, so a NaN or Inf reaches only later steps. `carry` of n is rewritten only after the barrier
 * that follows every read of it; (A, B) of n+1 only after the barrier that follows every read of n's. */
KERNEL selective_scan_chunked(i64 B, i64 S, i64 H, i64 N,
                              GLOBAL uchar* xb, i64 xo, GLOBAL uchar* deb, i64 deo, GLOBAL uchar* ab, i64 ao,
                              GLOBAL uchar* bb, i64 bo, GLOBAL uchar* cb, i64 co, GLOBAL uchar* db, i64 dof)
{
    LOCAL real pa[SSC_CB * SSC_SL], pb[SSC_CB * SSC_SL], carry[SSC_CB * STATE_MAX];
    const int lane = (int)LID(0), sl = lane / SSC_CB, k = lane - sl * SSC_CB;
    const i64 blocks = (H + SSC_CB - 1) / SSC_CB, bt = GROUP(0) / blocks, ch = (GROUP(0) - bt * blocks) * SSC_CB + k;
    const int live = ch < H; /* a lane past the last channel still meets every barrier */
    GLOBAL const store_t* x = AT(store_t, xb, xo);
    GLOBAL const store_t* delta = AT(store_t, deb, deo);
    GLOBAL const store_t* a = AT(store_t, ab, ao) + (live ? ch : 0) * N;
    GLOBAL const store_t* bm = AT(store_t, bb, bo);
    GLOBAL const store_t* cm = AT(store_t, cb, co);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    for (i64 n = sl; n < N; n += SSC_SL)
        carry[k * STATE_MAX + n] = (real)0;
    BARRIER();
    for (i64 c0 = 0; c0 < S; c0 += SSC_SL * SSC_T) {
        const i64 t0 = c0 + sl * SSC_T; /* this lane's first step */
        real dl[SSC_T], dx[SSC_T], y[SSC_T];
        PRAGMA_UNROLL
        for (int i = 0; i < SSC_T; ++i) {
            const i64 at = (bt * S + t0 + i) * H + ch;
            const int in = live && t0 + i < S;
            dl[i] = in ? LOAD(delta, at) : (real)0;
            dx[i] = in ? dl[i] * LOAD(x, at) : (real)0;
            y[i] = (real)0;
        }
        for (i64 n = 0; n < N; ++n) {
            const real an = live ? LOAD(a, n) : (real)0;
            real da[SSC_T], db_[SSC_T], A = (real)1, Bv = (real)0;
            PRAGMA_UNROLL
            for (int i = 0; i < SSC_T; ++i) {
                const int in = t0 + i < S;
                da[i] = in ? rlx_exp(dl[i] * an) : (real)1;
                db_[i] = in ? dx[i] * LOAD(bm, (bt * S + t0 + i) * N + n) : (real)0;
                A *= da[i];
                Bv = da[i] * Bv + db_[i];
            }
            pa[lane] = A;
            pb[lane] = Bv;
            BARRIER();
            real h = carry[k * STATE_MAX + n];
            for (int j = 0; j < sl; ++j)
                h = pa[j * SSC_CB + k] * h + pb[j * SSC_CB + k];
            PRAGMA_UNROLL
            for (int i = 0; i < SSC_T; ++i) {
                if (t0 + i < S) {
                    h = da[i] * h + db_[i];
                    y[i] += LOAD(cm, (bt * S + t0 + i) * N + n) * h;
                }
            }
            BARRIER();
            if (sl == SSC_SL - 1)
                carry[k * STATE_MAX + n] = h;
        }
        PRAGMA_UNROLL
        for (int i = 0; i < SSC_T; ++i)
            if (live && t0 + i < S)
                STORE(dst, (bt * S + t0 + i) * H + ch, y[i]);
    }
}
#ifndef RLX_NEED_FP64 /* f64 keeps the step kernel on GPUs: its LOCAL tiles would pass CUDA's 48 KiB static limit */
/* Mamba-2 chunked (SSD, target gpu, long sequences), chunks of M2_Q steps, three launches over
 * scratch holding one state [P, N] per (batch row, head, chunk) in the compute type:
 *   mamba2_chunk_state  each chunk's own final state from zero, sum_s exp(L[last]-L[s]) dt[s] x[s] (x) b[s],
 *                       and its total decay exp(L[last]), where L[t] = a * sum_{s<=t} dt[s] in the chunk;
 *   mamba2_state_pass   per state element, in chunk order: replaces each chunk's own state by the
 *                       state entering it (the inter-chunk pass);
 *   mamba2_chunk_scan   y[t] = exp(L[t]) C[t] . S_in  +  sum_{s<=t} exp(L[t]-L[s]) dt[s] (C[t] . B[s]) x[s],
 *                       the intra-chunk product as M2_Q x M2_Q work-group tiles in LOCAL memory.
 * Groups of M2_LANES lanes own (batch row, head, chunk, M2_PT rows of P); the grid is 1-D. Sums
 * over s <= t are loops bounded by t, never products with a zero mask, so a NaN at step t reaches
 * only steps >= t: within its chunk through L and the s <= t bound, beyond it through the state. */

/* dts[t] = dt of step t0+t of this (batch row, head) and Ls[t] = a * sum_{s<=t} dts[s], for the
 * chunk's `steps` steps (lane 0 sums serially: M2_Q adds), in LOCAL. */
#define M2_STAGE_DECAY(dts, Ls, dt, a)                                                                  \
    if (lane < steps)                                                                                 \
        dts[lane] = LOAD(dt, (bt * S + t0 + lane) * HD + hh);                                          \
    BARRIER();                                                                                        \
    if (lane == 0) {                                                                                  \
        real acc_ = (real)0;                                                                          \
        for (int i_ = 0; i_ < steps; ++i_) {                                                          \
            acc_ += dts[i_] * (a);                                                                    \
            Ls[i_] = acc_;                                                                            \
        }                                                                                             \
    }                                                                                                 \
    BARRIER()

/* The (batch row, head, chunk, row tile) of this group, and the chunk's steps. */
#define M2_GROUP()                                                                                      \
    const int lane = (int)LID(0);                                                                     \
    const i64 chunks = (S + M2_Q - 1) / M2_Q, ptiles = (P + M2_PT - 1) / M2_PT;                       \
    const i64 bhc = GROUP(0) / ptiles, pt = GROUP(0) - bhc * ptiles, bh = bhc / chunks;              \
    const i64 c = bhc - bh * chunks, bt = bh / HD, hh = bh - bt * HD, t0 = c * M2_Q, p0 = pt * M2_PT; \
    const int steps = S - t0 < M2_Q ? (int)(S - t0) : M2_Q;                                          \
    GLOBAL real* states = AT(real, sb, so) + bhc * P * N /* this chunk's [P, N] */

KERNEL mamba2_chunk_state(i64 B, i64 S, i64 HD, i64 P, i64 N,
                          GLOBAL uchar* xb, i64 xo, GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* ab, i64 ao,
                          GLOBAL uchar* bb, i64 bo, GLOBAL uchar* sb, i64 so, GLOBAL uchar* eb, i64 eo)
{
    LOCAL real dts[M2_Q], Ls[M2_Q], xw[M2_Q * M2_PT];
    M2_GROUP();
    GLOBAL const store_t* x = AT(store_t, xb, xo);
    GLOBAL const store_t* dt = AT(store_t, dtb, dto);
    GLOBAL const store_t* bm = AT(store_t, bb, bo);
    const real a = LOAD(AT(store_t, ab, ao), hh);
    M2_STAGE_DECAY(dts, Ls, dt, a);
    /* xw[s][p] = exp(L[last] - L[s]) dt[s] x[s][p]: the weight of step s in the chunk's final state */
    for (int e = lane; e < steps * M2_PT; e += M2_LANES) {
        const int s = e / M2_PT, p = e - s * M2_PT;
        xw[e] = p0 + p < P ? rlx_exp(Ls[steps - 1] - Ls[s]) * dts[s] * LOAD(x, ((bt * S + t0 + s) * HD + hh) * P + p0 + p)
                           : (real)0;
    }
    if (pt == 0 && lane == 0)
        AT(real, eb, eo)[bhc] = rlx_exp(Ls[steps - 1]);
    BARRIER();
    for (i64 n = lane; n < N; n += M2_LANES) {
        real acc[M2_PT];
        PRAGMA_UNROLL
        for (int p = 0; p < M2_PT; ++p)
            acc[p] = (real)0;
        for (int s = 0; s < steps; ++s) {
            const real bv = LOAD(bm, ((bt * S + t0 + s) * HD + hh) * N + n);
            PRAGMA_UNROLL
            for (int p = 0; p < M2_PT; ++p)
                acc[p] += xw[s * M2_PT + p] * bv;
        }
        PRAGMA_UNROLL
        for (int p = 0; p < M2_PT; ++p)
            if (p0 + p < P)
                states[(p0 + p) * N + n] = acc[p];
    }
}

/* One work-item per state element of one (batch row, head): walks the chunks in order, leaving in
 * each chunk's slot the state entering it. */
KERNEL mamba2_state_pass(i64 B, i64 S, i64 HD, i64 P, i64 N, GLOBAL uchar* sb, i64 so, GLOBAL uchar* eb, i64 eo)
{
    const i64 e = GID(0), pn = P * N, chunks = (S + M2_Q - 1) / M2_Q;
    if (e >= B * HD * pn)
        return;
    const i64 bh = e / pn, k = e - bh * pn;
    GLOBAL real* st = AT(real, sb, so) + bh * chunks * pn + k;
    GLOBAL const real* dec = AT(real, eb, eo) + bh * chunks;
    real s = (real)0;
    for (i64 c = 0; c < chunks; ++c) {
        const real own = st[c * pn];
        st[c * pn] = s;
        s = dec[c] * s + own;
    }
}

#define M2_NTP (M2_NT + 1) /* LOCAL row strides padded by one so that a column walk spreads over banks */
#define M2_QP (M2_Q + 1)
#define M2_GS (M2_Q * M2_Q / M2_LANES) /* entries of C.B^T per lane: row t = lane % M2_Q, M2_GS columns */
#define M2_TS (M2_LANES / M2_PT)       /* output rows apart for one lane: p = lane % M2_PT, t = lane / M2_PT + i*M2_TS */
#define M2_YI (M2_Q / M2_TS)           /* outputs per lane */

KERNEL mamba2_chunk_scan(i64 B, i64 S, i64 HD, i64 P, i64 N,
                         GLOBAL uchar* xb, i64 xo, GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* ab, i64 ao,
                         GLOBAL uchar* bb, i64 bo, GLOBAL uchar* cb, i64 co, GLOBAL uchar* db, i64 dof,
                         GLOBAL uchar* sb, i64 so)
{
    LOCAL real dts[M2_Q], Ls[M2_Q], xs[M2_Q * M2_PT], cs[M2_Q * M2_NTP], bs[M2_Q * M2_NTP], ss[M2_PT * M2_NTP], gm[M2_Q * M2_QP];
    M2_GROUP();
    GLOBAL const store_t* x = AT(store_t, xb, xo);
    GLOBAL const store_t* dt = AT(store_t, dtb, dto);
    GLOBAL const store_t* bm = AT(store_t, bb, bo);
    GLOBAL const store_t* cm = AT(store_t, cb, co);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    const real a = LOAD(AT(store_t, ab, ao), hh);
    M2_STAGE_DECAY(dts, Ls, dt, a);
    for (int e = lane; e < steps * M2_PT; e += M2_LANES) {
        const int s = e / M2_PT, p = e - s * M2_PT;
        xs[e] = p0 + p < P ? LOAD(x, ((bt * S + t0 + s) * HD + hh) * P + p0 + p) : (real)0;
    }
    /* this lane's C.B^T entries: row tg, columns s0..; its outputs: row p0+py, steps ty + i*M2_TS
     * (remainders as x - q*d: a div/rem pair becomes an LLVM `freeze`, which Oclgrind rejects) */
    const int sh = lane / M2_Q, tg = lane - sh * M2_Q, s0 = sh * M2_GS, ty = lane / M2_PT, py = lane - ty * M2_PT;
    real g[M2_GS], yi[M2_YI];
    PRAGMA_UNROLL
    for (int j = 0; j < M2_GS; ++j)
        g[j] = (real)0;
    PRAGMA_UNROLL
    for (int i = 0; i < M2_YI; ++i)
        yi[i] = (real)0;
    for (i64 n0 = 0; n0 < N; n0 += M2_NT) {
        BARRIER(); /* the previous tile's readers are done */
        for (int e = lane; e < M2_Q * M2_NT; e += M2_LANES) {
            const int s = e / M2_NT, nn = e - s * M2_NT;
            const int in = s < steps && n0 + nn < N;
            const i64 at = ((bt * S + t0 + s) * HD + hh) * N + n0 + nn;
            cs[s * M2_NTP + nn] = in ? LOAD(cm, at) : (real)0;
            bs[s * M2_NTP + nn] = in ? LOAD(bm, at) : (real)0;
        }
        for (int e = lane; e < M2_PT * M2_NT; e += M2_LANES) {
            const int p = e / M2_NT, nn = e - p * M2_NT;
            ss[p * M2_NTP + nn] = p0 + p < P && n0 + nn < N ? states[(p0 + p) * N + n0 + nn] : (real)0;
        }
        BARRIER();
        for (int nn = 0; nn < M2_NT; ++nn) { /* not unrolled: ptxas would hoist all tile loads (204 registers) */
            const real ct = cs[tg * M2_NTP + nn], sv = ss[py * M2_NTP + nn];
            PRAGMA_UNROLL
            for (int j = 0; j < M2_GS; ++j)
                g[j] += ct * bs[(s0 + j) * M2_NTP + nn];
            PRAGMA_UNROLL
            for (int i = 0; i < M2_YI; ++i)
                yi[i] += cs[(ty + i * M2_TS) * M2_NTP + nn] * sv;
        }
    }
    /* gm[t][s] = exp(L[t] - L[s]) dt[s] (C[t] . B[s]) for s <= t < steps; the rest is never read */
    PRAGMA_UNROLL
    for (int j = 0; j < M2_GS; ++j)
        if (s0 + j <= tg && tg < steps)
            gm[tg * M2_QP + s0 + j] = rlx_exp(Ls[tg] - Ls[s0 + j]) * dts[s0 + j] * g[j];
    BARRIER();
    PRAGMA_UNROLL
    for (int i = 0; i < M2_YI; ++i) {
        const int t = ty + i * M2_TS;
        if (t < steps && p0 + py < P) {
            real y = rlx_exp(Ls[t]) * yi[i];
            for (int s = 0; s <= t; ++s)
                y += gm[t * M2_QP + s] * xs[s * M2_PT + py];
            STORE(dst, ((bt * S + t0 + t) * HD + hh) * P + p0 + py, y);
        }
    }
}
#endif
#endif

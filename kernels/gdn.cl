/* Gated delta net (ABI.md §4). cpu target below; the gpu target's gated_delta_net_lanes is in the
 * gpu block at the end. Every step of the delta rule touches column j of S only through
 * sum_i S[i,j]*k[i] and sum_i S[i,j]*q[i], so one work-item owns one column (value index j) and runs
 * the whole sequence without barriers; the column stays in private memory in the compute type.
 * One work-item owns GDN_CJ adjacent columns (see gdn_walk).
 * Per-channel gates run per block of T steps [t0, t0+T): gdn_decay first writes exp(g) for the block
 * into scratch (fully parallel), so the recurrence reads each decay instead of every column's
 * work-item recomputing all N exponentials. Between blocks the state waits in scratch in the compute
 * type; with carry_state the first block reads it from the arena and the last writes it back. */


#ifdef RLX_TARGET_CPU /* cpu target (PoCL): the kernels up to the gpu block below */
/* dec[bt, e] = exp(g[bt, t0*W + e]) for e < T*W, W = heads*N: one work-item per element. */
KERNEL gdn_decay(i64 B, i64 S, i64 W, i64 t0, i64 T, GLOBAL uchar* gb, i64 go, GLOBAL uchar* eb, i64 eo)
{
    const i64 e = GID(0), bt = GID(1);
    if (e >= T * W || bt >= B)
        return;
    AT(real, eb, eo)[bt * T * W + e] = exp(LOAD(AT(store_t, gb, go), (bt * S + t0) * W + e));
}

/* The recurrence of columns [j0, j0+GDN_CJ) of one (head hh, batch row bt) over steps [t0, t0+T).
 * `dec` holds the per-channel decays of the block (unused with per-head gates: exp(g) is taken here,
 * once per step). The item's columns are the innermost, contiguous index of its private state
 * s[i*GDN_CJ + c], so each k[i] / q[i] / decay load serves GDN_CJ columns and the column loop (fully
 * unrolled) vectorizes. A step is two passes over the state: with the decay d[i] (per channel, or one
 * per head) folded in, sum_i (d[i] S[i,j]) k[i] = sum_i S[i,j] (d[i] k[i]) reads S unchanged, then
 * S[i,j] = d[i] S[i,j] + k[i] u[j] and the output sum run in one sweep. Each sum keeps two
 * independent partial sums (even and odd i). */
DEVICE_FN void gdn_walk(i64 B, i64 S, i64 HD, i64 N, i64 t0, i64 T, int resume, int in_real, int keep, int out_real,
                        GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo,
                        GLOBAL uchar* gb, i64 go, GLOBAL uchar* beb, i64 beo, GLOBAL uchar* sb, i64 so,
                        GLOBAL uchar* ob, i64 oo, GLOBAL uchar* db, i64 dof, GLOBAL const real* dec, int per_channel)
{
    const i64 j0 = GID(0) * GDN_CJ, hh = GID(1), bt = GID(2);
    if (j0 >= N || hh >= HD || bt >= B)
        return;
    const int nc = N - j0 < GDN_CJ ? (int)(N - j0) : GDN_CJ; /* columns of this item inside the state */
    GLOBAL const store_t* q = AT(store_t, qb, qo);
    GLOBAL const store_t* k = AT(store_t, kb, ko);
    GLOBAL const store_t* v = AT(store_t, vb, vo);
    GLOBAL const store_t* g = AT(store_t, gb, go);
    GLOBAL const store_t* beta = AT(store_t, beb, beo);
    const i64 s0 = (bt * HD + hh) * N * N + j0; /* the state arrives at sb and leaves at ob: storage or compute type */
    GLOBAL const store_t* in_st = AT(store_t, sb, so) + s0;
    GLOBAL const real* in_re = AT(real, sb, so) + s0;
    GLOBAL store_t* out_st = AT(store_t, ob, oo) + s0;
    GLOBAL real* out_re = AT(real, ob, oo) + s0;
    GLOBAL store_t* dst = AT(store_t, db, dof);
    const real scale = (real)1 / sqrt((real)N);
    real s[STATE_MAX * GDN_CJ];
    /* The state moves in and out by loops unswitched on the (runtime) flags, so that a full item's
     * common case (all GDN_CJ columns, storage type) is a straight-line contiguous run per row. */
    if (resume && nc == GDN_CJ && !in_real)
        for (i64 i = 0; i < N; ++i)
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c)
                s[i * GDN_CJ + c] = LOAD(in_st, i * N + c);
    else if (resume && nc == GDN_CJ)
        for (i64 i = 0; i < N; ++i)
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c)
                s[i * GDN_CJ + c] = in_re[i * N + c];
    else
        for (i64 i = 0; i < N; ++i)
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c)
                s[i * GDN_CJ + c] = !resume || c >= nc ? (real)0 : in_real ? in_re[i * N + c] : LOAD(in_st, i * N + c);
    for (i64 tt = 0; tt < T; ++tt) {
        const i64 head = (bt * S + t0 + tt) * HD + hh, vec = head * N;
        GLOBAL const store_t* kr = k + vec;
        GLOBAL const store_t* qr = q + vec;
        GLOBAL const real* gr = dec + ((bt * T + tt) * HD + hh) * N;
        const real decay = per_channel ? (real)1 : exp(LOAD(g, head));
        real a0[GDN_CJ], a1[GDN_CJ], u[GDN_CJ];
        PRAGMA_UNROLL
        for (int c = 0; c < GDN_CJ; ++c)
            a0[c] = a1[c] = (real)0;
        i64 i = 0;
        for (; i + 2 <= N; i += 2) {
            const real k0 = per_channel ? gr[i] * LOAD(kr, i) : LOAD(kr, i);
            const real k1 = per_channel ? gr[i + 1] * LOAD(kr, i + 1) : LOAD(kr, i + 1);
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c) {
                a0[c] += s[i * GDN_CJ + c] * k0;
                a1[c] += s[(i + 1) * GDN_CJ + c] * k1;
            }
        }
        if (i < N) {
            const real k0 = per_channel ? gr[i] * LOAD(kr, i) : LOAD(kr, i);
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c)
                a0[c] += s[i * GDN_CJ + c] * k0;
        }
        const real bh = LOAD(beta, head);
        PRAGMA_UNROLL
        for (int c = 0; c < GDN_CJ; ++c) {
            u[c] = ((c < nc ? LOAD(v, vec + j0 + c) : (real)0) - decay * (a0[c] + a1[c])) * bh;
            a0[c] = a1[c] = (real)0;
        }
        for (i = 0; i + 2 <= N; i += 2) {
            const real d0 = per_channel ? gr[i] : decay, d1 = per_channel ? gr[i + 1] : decay;
            const real k0 = LOAD(kr, i), k1 = LOAD(kr, i + 1), q0 = LOAD(qr, i), q1 = LOAD(qr, i + 1);
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c) {
                const real x0 = d0 * s[i * GDN_CJ + c] + k0 * u[c], x1 = d1 * s[(i + 1) * GDN_CJ + c] + k1 * u[c];
                s[i * GDN_CJ + c] = x0;
                s[(i + 1) * GDN_CJ + c] = x1;
                a0[c] += x0 * q0;
                a1[c] += x1 * q1;
            }
        }
        if (i < N) {
            const real d0 = per_channel ? gr[i] : decay, k0 = LOAD(kr, i), q0 = LOAD(qr, i);
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c) {
                const real x0 = d0 * s[i * GDN_CJ + c] + k0 * u[c];
                s[i * GDN_CJ + c] = x0;
                a0[c] += x0 * q0;
            }
        }
        PRAGMA_UNROLL
        for (int c = 0; c < GDN_CJ; ++c)
            if (c < nc)
                STORE(dst, vec + j0 + c, scale * (a0[c] + a1[c]));
    }
    if (keep && nc == GDN_CJ && !out_real)
        for (i64 i = 0; i < N; ++i)
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c)
                STORE(out_st, i * N + c, s[i * GDN_CJ + c]);
    else if (keep && nc == GDN_CJ)
        for (i64 i = 0; i < N; ++i)
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c)
                out_re[i * N + c] = s[i * GDN_CJ + c];
    else if (keep)
        for (i64 i = 0; i < N; ++i)
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c)
                if (c < nc) {
                    if (out_real)
                        out_re[i * N + c] = s[i * GDN_CJ + c];
                    else
                        STORE(out_st, i * N + c, s[i * GDN_CJ + c]);
                }
}

/* Per-head gates: the whole sequence in one launch; the state comes from and returns to the arena
 * with carry_state. */
KERNEL gated_delta_net(i64 B, i64 S, i64 HD, i64 N, int carry,
                       GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo,
                       GLOBAL uchar* gb, i64 go, GLOBAL uchar* beb, i64 beo, GLOBAL uchar* sb, i64 so,
                       GLOBAL uchar* db, i64 dof)
{
    gdn_walk(B, S, HD, N, 0, S, carry, 0, carry, 0, qb, qo, kb, ko, vb, vo, gb, go, beb, beo, sb, so, sb, so, db, dof,
             (GLOBAL const real*)gb, 0);
}

/* Per-channel gates, one block of steps [t0, t0+T) after gdn_decay filled `dec` (scratch). */
KERNEL gated_delta_net_pc(i64 B, i64 S, i64 HD, i64 N, i64 t0, i64 T, int resume, int in_real, int keep, int out_real,
                          GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo,
                          GLOBAL uchar* beb, i64 beo, GLOBAL uchar* sb, i64 so, GLOBAL uchar* ob, i64 oo,
                          GLOBAL uchar* db, i64 dof, GLOBAL uchar* eb, i64 eo)
{
    gdn_walk(B, S, HD, N, t0, T, resume, in_real, keep, out_real, qb, qo, kb, ko, vb, vo, beb, 0, beb, beo, sb, so, ob, oo,
             db, dof,
             AT(real, eb, eo), 1);
}
#endif

#if defined(RLX_TARGET_GPU) && defined(SSM_N) /* a gpu program variant: SSM_N, SSM_L from its launch */
/* GPU shapes (target gpu): one row is a state column j of one (batch row, head); its key indices i
 * are spread across SSM_L lanes of a work-group, lane nl holding S[i, j] for i = w*SSM_L + nl,
 * w < SSM_W = SSM_N / SSM_L, in registers (fully unrolled: no stack). SSM_N (the state-size variant,
 * >= state_size) and SSM_L come from the launch's defines, SSM_WG (the largest work-group) from the
 * gpu tuning table. Both gate kinds and both carry modes run the whole sequence in one launch: a
 * per-channel decay is exp(g[i]) of the lane's own rows. Each step reduces twice across the lanes of a column through
 * LOCAL memory: sum_i S[i,j] (d[i] k[i]) (every lane reads it back: it needs u[j]) in the first half
 * of `part`, then sum_i S[i,j] q[i] in the second (one lane stores it). Each half is rewritten only
 * after the barrier that follows the other half's write, which every reader of it has passed. The
 * grid is 1-D (groups of columns folded into x): no extent reaches CUDA's 65,535 cap on y/z. */
#define SSM_W (SSM_N / SSM_L)


KERNEL gated_delta_net_lanes(i64 B, i64 S, i64 HD, i64 N, int carry, int per_channel,
                             GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo,
                             GLOBAL uchar* gb, i64 go, GLOBAL uchar* beb, i64 beo, GLOBAL uchar* sb, i64 so,
                             GLOBAL uchar* db, i64 dof)
{
    LOCAL real part[2 * SSM_WG];
    /* remainders as x - q*d, not %: LLVM turns a div/rem pair into a `freeze`, which Oclgrind rejects */
    const int lane = (int)LID(0), r = lane / SSM_L, nl = lane - r * SSM_L, first = r * SSM_L;
    const i64 rows = LSIZE(0) / SSM_L, blocks = (N + rows - 1) / rows;
    const i64 hb = GROUP(0) / blocks, bt = hb / HD, hh = hb - bt * HD, j = (GROUP(0) - hb * blocks) * rows + r;
    const int live = j < N; /* a lane past the last column still meets every barrier */
    GLOBAL const store_t* q = AT(store_t, qb, qo);
    GLOBAL const store_t* k = AT(store_t, kb, ko);
    GLOBAL const store_t* v = AT(store_t, vb, vo);
    GLOBAL const store_t* g = AT(store_t, gb, go);
    GLOBAL const store_t* beta = AT(store_t, beb, beo);
    GLOBAL store_t* st = AT(store_t, sb, so) + (bt * HD + hh) * N * N + (live ? j : 0);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    const real scale = (real)1 / sqrt((real)N);
    real s[SSM_W];
    PRAGMA_UNROLL
    for (int w = 0; w < SSM_W; ++w) {
        const int i = w * SSM_L + nl;
        s[w] = carry && live && i < N ? LOAD(st, i * N) : (real)0;
    }
    for (i64 t = 0; t < S; ++t) {
        const i64 head = (bt * S + t) * HD + hh, vec = head * N;
        const real decay = per_channel ? (real)1 : rlx_exp(LOAD(g, head));
        real kd[SSM_W], y = (real)0;
        PRAGMA_UNROLL
        for (int w = 0; w < SSM_W; ++w) {
            const int i = w * SSM_L + nl;
            kd[w] = (real)0;
            if (i < N) {
                if (per_channel)
                    s[w] *= rlx_exp(LOAD(g, vec + i));
                else
                    s[w] *= decay;
                kd[w] = LOAD(k, vec + i);
                y += s[w] * kd[w];
            }
        }
        part[lane] = y;
        BARRIER();
        SSM_ROW_SUM(y, part, first);
        const real u = ((live ? LOAD(v, vec + j) : (real)0) - y) * LOAD(beta, head);
        y = (real)0;
        PRAGMA_UNROLL
        for (int w = 0; w < SSM_W; ++w) {
            const int i = w * SSM_L + nl;
            if (i < N) {
                s[w] += kd[w] * u;
                y += s[w] * LOAD(q, vec + i);
            }
        }
        part[SSM_WG + lane] = y;
        BARRIER();
        if (live && nl == 0) {
            SSM_ROW_SUM(y, part, SSM_WG + first);
            STORE(dst, vec + j, scale * y);
        }
    }
    if (carry && live)
        PRAGMA_UNROLL
        for (int w = 0; w < SSM_W; ++w) {
            const int i = w * SSM_L + nl;
            if (i < N)
                STORE(st, i * N, s[w]);
        }
}
#endif

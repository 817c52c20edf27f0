/* Gated delta net (ABI.md §4). Every step of the delta rule touches column j of S only through
 * sum_i S[i,j]*k[i] and sum_i S[i,j]*q[i], so one work-item owns one column (value index j) and runs
 * the whole sequence without barriers; the column stays in private memory in the compute type.
 * Updates run in loops without loop-carried dependences (vectorizable); the two sums use GDN_ACC
 * independent partial sums rather than one serial add chain.
 * Per-channel gates run per block of T steps [t0, t0+T): gdn_decay first writes exp(g) for the block
 * into scratch (fully parallel), so the recurrence reads each decay instead of every column's
 * work-item recomputing all N exponentials. Between blocks the state waits in scratch in the compute
 * type; with carry_state the first block reads it from the arena and the last writes it back. */

#define GDN_ACC 4 /* the sums below add exactly these 4 partial sums */

/* dec[bt, e] = exp(g[bt, t0*W + e]) for e < T*W, W = heads*N: one work-item per element. */
KERNEL gdn_decay(i64 B, i64 S, i64 W, i64 t0, i64 T, GLOBAL uchar* gb, i64 go, GLOBAL uchar* eb, i64 eo)
{
    const i64 e = GID(0), bt = GID(1);
    if (e >= T * W || bt >= B)
        return;
    AT(real, eb, eo)[bt * T * W + e] = exp(LOAD(AT(store_t, gb, go), (bt * S + t0) * W + e));
}

/* The recurrence of columns j of one (head hh, batch row bt) over steps [t0, t0+T). `dec` holds the
 * per-channel decays of the block (unused with per-head gates: exp(g) is taken here, once per step). */
DEVICE_FN void gdn_walk(i64 B, i64 S, i64 HD, i64 N, i64 t0, i64 T, int resume, int in_real, int keep, int out_real,
                        GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo,
                        GLOBAL uchar* gb, i64 go, GLOBAL uchar* beb, i64 beo, GLOBAL uchar* sb, i64 so,
                        GLOBAL uchar* ob, i64 oo, GLOBAL uchar* db, i64 dof, GLOBAL const real* dec, int per_channel)
{
    const i64 j = GID(0), hh = GID(1), bt = GID(2);
    if (j >= N || hh >= HD || bt >= B)
        return;
    GLOBAL const store_t* q = AT(store_t, qb, qo);
    GLOBAL const store_t* k = AT(store_t, kb, ko);
    GLOBAL const store_t* v = AT(store_t, vb, vo);
    GLOBAL const store_t* g = AT(store_t, gb, go);
    GLOBAL const store_t* beta = AT(store_t, beb, beo);
    const i64 s0 = (bt * HD + hh) * N * N; /* the state arrives at sb and leaves at ob: storage or compute type */
    GLOBAL const store_t* in_st = AT(store_t, sb, so) + s0;
    GLOBAL const real* in_re = AT(real, sb, so) + s0;
    GLOBAL store_t* out_st = AT(store_t, ob, oo) + s0;
    GLOBAL real* out_re = AT(real, ob, oo) + s0;
    GLOBAL store_t* dst = AT(store_t, db, dof);
    const real scale = (real)1 / sqrt((real)N);
    real s[STATE_MAX];
    for (i64 i = 0; i < N; ++i)
        s[i] = !resume ? (real)0 : in_real ? in_re[i * N + j] : LOAD(in_st, i * N + j);
    for (i64 tt = 0; tt < T; ++tt) {
        const i64 head = (bt * S + t0 + tt) * HD + hh, vec = head * N;
        GLOBAL const store_t* kr = k + vec;
        GLOBAL const store_t* qr = q + vec;
        if (per_channel) {
            GLOBAL const real* gr = dec + ((bt * T + tt) * HD + hh) * N;
            for (i64 i = 0; i < N; ++i)
                s[i] *= gr[i];
        } else {
            const real decay = exp(LOAD(g, head));
            for (i64 i = 0; i < N; ++i)
                s[i] *= decay;
        }
        real acc[GDN_ACC];
        for (int r = 0; r < GDN_ACC; ++r)
            acc[r] = (real)0;
        i64 i = 0;
        for (; i + GDN_ACC <= N; i += GDN_ACC)
            for (int r = 0; r < GDN_ACC; ++r)
                acc[r] += s[i + r] * LOAD(kr, i + r);
        for (; i < N; ++i)
            acc[0] += s[i] * LOAD(kr, i);
        const real u = (LOAD(v, vec + j) - ((acc[0] + acc[1]) + (acc[2] + acc[3]))) * LOAD(beta, head);
        for (i = 0; i < N; ++i)
            s[i] += LOAD(kr, i) * u;
        for (int r = 0; r < GDN_ACC; ++r)
            acc[r] = (real)0;
        for (i = 0; i + GDN_ACC <= N; i += GDN_ACC)
            for (int r = 0; r < GDN_ACC; ++r)
                acc[r] += s[i + r] * LOAD(qr, i + r);
        for (; i < N; ++i)
            acc[0] += s[i] * LOAD(qr, i);
        STORE(dst, vec + j, scale * ((acc[0] + acc[1]) + (acc[2] + acc[3])));
    }
    if (keep)
        for (i64 i = 0; i < N; ++i) {
            if (out_real)
                out_re[i * N + j] = s[i];
            else
                STORE(out_st, i * N + j, s[i]);
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

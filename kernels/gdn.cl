/* Gated delta net (ABI.md §4). Every step of the delta rule touches column j of S only through
 * sum_i S[i,j]*k[i] and sum_i S[i,j]*q[i], so one work-item owns one column (value index j) and runs
 * the whole sequence without barriers; the column stays in private memory in the compute type.
 * Updates run in loops without loop-carried dependences (vectorizable); the two sums use GDN_ACC
 * independent partial sums rather than one serial add chain. */

#define GDN_ACC 4 /* the sums below add exactly these 4 partial sums */

KERNEL gated_delta_net(i64 B, i64 S, i64 HD, i64 N, int per_channel, int carry,
                       GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo,
                       GLOBAL uchar* gb, i64 go, GLOBAL uchar* beb, i64 beo, GLOBAL uchar* sb, i64 so,
                       GLOBAL uchar* db, i64 dof)
{
    const i64 j = GID(0), hh = GID(1), bt = GID(2);
    if (j >= N || hh >= HD || bt >= B)
        return;
    GLOBAL const store_t* q = AT(store_t, qb, qo);
    GLOBAL const store_t* k = AT(store_t, kb, ko);
    GLOBAL const store_t* v = AT(store_t, vb, vo);
    GLOBAL const store_t* g = AT(store_t, gb, go);
    GLOBAL const store_t* beta = AT(store_t, beb, beo);
    GLOBAL store_t* state = AT(store_t, sb, so) + (bt * HD + hh) * N * N;
    GLOBAL store_t* dst = AT(store_t, db, dof);
    const real scale = (real)1 / sqrt((real)N);
    real s[STATE_MAX];
    for (i64 i = 0; i < N; ++i)
        s[i] = carry ? LOAD(state, i * N + j) : (real)0;
    for (i64 t = 0; t < S; ++t) {
        const i64 head = (bt * S + t) * HD + hh, vec = head * N;
        GLOBAL const store_t* kr = k + vec;
        GLOBAL const store_t* qr = q + vec;
        if (per_channel) {
            GLOBAL const store_t* gr = g + vec;
            for (i64 i = 0; i < N; ++i)
                s[i] *= exp(LOAD(gr, i));
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
    if (carry)
        for (i64 i = 0; i < N; ++i)
            STORE(state, i * N + j, s[i]);
}

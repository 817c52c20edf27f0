/* Gated delta net (ABI.md §4). Every step of the delta rule touches column j of S only through
 * sum_i S[i,j]*k[i] and sum_i S[i,j]*q[i], so one work-item owns one column (value index j) and runs
 * the whole sequence without barriers; the column stays in private memory in the compute type. */

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
        const real head_decay = per_channel ? (real)0 : exp(LOAD(g, head));
        real kv = (real)0;
        for (i64 i = 0; i < N; ++i) {
            s[i] *= per_channel ? exp(LOAD(g, vec + i)) : head_decay;
            kv += s[i] * LOAD(k, vec + i);
        }
        const real u = (LOAD(v, vec + j) - kv) * LOAD(beta, head);
        real o = (real)0;
        for (i64 i = 0; i < N; ++i) {
            s[i] += LOAD(k, vec + i) * u;
            o += s[i] * LOAD(q, vec + i);
        }
        STORE(dst, vec + j, scale * o);
    }
    if (carry)
        for (i64 i = 0; i < N; ++i)
            STORE(state, i * N + j, s[i]);
}

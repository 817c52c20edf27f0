/* Gated delta net (ABI.md §4, with §8's fields). cpu target below; the gpu target's gated_delta_net_lanes
 * (decode, short sequences) and its chunked WY form (long sequences) are in the two gpu blocks at the end.
 * Every step of the delta rule touches column j of S only through
 * sum_i S[i,j]*k[i] and sum_i S[i,j]*q[i], so one work-item owns one column (value index j) and runs
 * the whole sequence without barriers; the column stays in private memory in the compute type.
 * One work-item owns GDN_CJ adjacent columns (see gated_delta_net).
 * Per-channel gates run per block of T steps [t0, t0+T): gdn_decay first writes exp(g) for the block
 * into scratch (fully parallel), so the recurrence reads each decay instead of every column's
 * work-item recomputing all K exponentials. Between blocks the state waits in scratch in the compute
 * type; with carry_state the first block reads it from the arena and the last writes it back.
 * A decode step (seq == 1) takes gated_delta_net_step instead: one launch straight on the state.
 *
 * Shapes (every target): R state rows r (batch rows, or the packed sequences of cu_seqlens), H key heads
 * of K channels (q, k), HV value heads of V channels (v, dst, beta, g, the state [K, V] of a head);
 * value head vh reads key head vh / (HV / H). Tokens are numbered flat over the batch (b * S + t).
 * The optional fields of version 2 that change what a kernel reads are runtime flags that only the
 * GDN_V2 program variant honours: in the version-1 program they are constant 0, so its loops are the
 * plain ones. varlen: row r's tokens are cu[r] .. cu[r+1]-1 (batch 1); slotted: row r reads and writes
 * state entry slots[r] of the pool; qk_norm: nrm (scratch, from gdn_qk_norm) holds 1/|q| and 1/|k| of
 * every (token, key head), folded into the step's scalars (sum_i S k' = |k|^-1 sum_i S k, and likewise
 * for the update and the output), so no loop over K changes; state_real: the state is kept in the
 * compute type (f32 state of an f16 / bf16 thunk). */
#ifndef GDN_V2
#define GDN_V2 0
#endif
#ifndef GDN_RESERVE
#define GDN_RESERVE 0 /* the cpu walk's variant that also records the saved forward (gdn_reserve_record) */
#endif

/* The first token of row r and the one past its last (packed sequence r, or batch row r of S steps). */
DEVICE_FN i64 gdn_row_start(i64 r, i64 S, GLOBAL const int* cu) { return GDN_V2 && cu ? (i64)cu[r] : r * S; }
DEVICE_FN i64 gdn_row_end(i64 r, i64 S, GLOBAL const int* cu) { return GDN_V2 && cu ? (i64)cu[r + 1] : (r + 1) * S; }

/* The state entry of row r: slots[r] with state slots, else r. */
DEVICE_FN i64 gdn_state_row(i64 r, GLOBAL const int* slots) { return GDN_V2 && slots ? (i64)slots[r] : r; }

/* The token-major inputs of gated_delta_net, as its kernels find them in their arguments: q, k ([tokens][H][K]),
 * v ([tokens][HV][V]), the gates g and beta. */
typedef struct {
    GLOBAL const store_t* q;
    GLOBAL const store_t* k;
    GLOBAL const store_t* v;
    GLOBAL const store_t* g;
    GLOBAL const store_t* beta;
} gdn_tensors;

INLINE_FN gdn_tensors gdn_tensors_of(GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo,
                                     GLOBAL uchar* gb, i64 go, GLOBAL uchar* beb, i64 beo)
{
    gdn_tensors out;
    out.q = AT(store_t, qb, qo);
    out.k = AT(store_t, kb, ko);
    out.v = AT(store_t, vb, vo);
    out.g = AT(store_t, gb, go);
    out.beta = AT(store_t, beb, beo);
    return out;
}

/* nrm[2e] = 1/sqrt(sum q^2 + 1e-6) and nrm[2e+1] the same of k, for every (token, key head) e < E: one
 * work-item each (every target). */
KERNEL gdn_qk_norm(i64 E, i64 K, GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* nb, i64 no)
{
    const i64 e = GID(0);
    if (e >= E)
        return;
    GLOBAL const store_t* q = AT(store_t, qb, qo) + e * K;
    GLOBAL const store_t* k = AT(store_t, kb, ko) + e * K;
    real sq = (real)0, sk = (real)0;
    for (i64 i = 0; i < K; ++i) {
        const real qi = LOAD(q, i), ki = LOAD(k, i);
        sq += qi * qi;
        sk += ki * ki;
    }
    GLOBAL real* nrm = AT(real, nb, no);
    nrm[2 * e] = (real)1 / sqrt(sq + (real)1e-6);
    nrm[2 * e + 1] = (real)1 / sqrt(sk + (real)1e-6);
}

#define GDN_RC 32 /* the tokens of a chunk of the saved forward (its layout: the end of this file) */

/* Where token t (of batch row b) of value head vh keeps its u in the saved forward: column 0 of its row. */
INLINE_FN GLOBAL real* gdn_reserve_u(GLOBAL uchar* ub, i64 uo, i64 b, i64 S, i64 t, i64 HV, i64 vh, i64 V)
{
    const i64 chunk = t / GDN_RC, chunks = (S + GDN_RC - 1) / GDN_RC;
    return AT(real, ub, uo) + (((b * chunks + chunk) * HV + vh) * GDN_RC + t - chunk * GDN_RC) * V;
}

#ifdef RLX_TARGET_CPU /* cpu target (PoCL): the kernels up to the gpu block below */
/* dec[bt, e] = exp(g[bt, t0*W + e]) for e < T*W, W = HV*K: one work-item per element. */
KERNEL gdn_decay(i64 B, i64 S, i64 W, i64 t0, i64 T, GLOBAL uchar* gb, i64 go, GLOBAL uchar* eb, i64 eo)
{
    const i64 e = GID(0), bt = GID(1);
    if (e >= T * W || bt >= B)
        return;
    AT(real, eb, eo)[bt * T * W + e] = exp(LOAD(AT(store_t, gb, go), (bt * S + t0) * W + e));
}

/* After token t of batch row b: the walk's columns [j0, j0+nc) of the state s (s[i*GDN_CJ + c]) as the state
 * leaving the chunk when t ends one (or the row), and, at the row's last token, zeros for u past it. */
INLINE_FN void gdn_reserve_record(GLOBAL uchar* hb, i64 ho, GLOBAL uchar* ub, i64 uo, i64 b, i64 S, i64 t, i64 HV,
                                  i64 vh, i64 K, i64 V, i64 j0, int nc, const real* s)
{
    if ((t + 1) % GDN_RC && t + 1 < S)
        return;
    const i64 chunk = t / GDN_RC, chunks = (S + GDN_RC - 1) / GDN_RC;
    GLOBAL real* out = AT(real, hb, ho) + ((b * chunks + chunk) * HV + vh) * K * V + j0;
    for (i64 i = 0; i < K; ++i)
        for (int c = 0; c < nc; ++c)
            out[i * V + c] = s[i * GDN_CJ + c];
    for (i64 p = t + 1; p < chunks * GDN_RC && t + 1 == S; ++p)
        for (int c = 0; c < nc; ++c)
            gdn_reserve_u(ub, uo, b, S, p, HV, vh, V)[j0 + c] = (real)0;
}

/* The recurrence of columns [j0, j0+GDN_CJ) of one (value head vh, row r) over the steps of block
 * [t0, t0+T) of its batch row (the whole sequence with per-head gates: t0 = 0, T = S). The row's state
 * enters from the arena (`st`, at its state entry; zeros without carry_state) in the block that holds
 * its first token, else from `park` (scratch, compute type, at row r), and leaves to the arena (with
 * carry_state) in the block that holds its last token, else to `park`. `dec` holds the per-channel
 * decays of the block (unused with per-head gates: exp(g) is taken here, once per step). The item's
 * columns are the innermost, contiguous index of its private state s[i*GDN_CJ + c], so each k[i] /
 * q[i] / decay load serves GDN_CJ columns and the column loop (fully unrolled) vectorizes. A step is two
 * passes over the state: with the decay d[i] (per channel, or one per head) folded in,
 * sum_i (d[i] S[i,j]) k[i] = sum_i S[i,j] (d[i] k[i]) reads S unchanged, then
 * S[i,j] = d[i] S[i,j] + k[i] u[j] and the output sum run in one sweep. Each sum keeps two independent
 * partial sums (even and odd i). */
KERNEL gated_delta_net(i64 R, i64 S, i64 H, i64 HV, i64 K, i64 V, i64 t0, i64 T, int carry, int per_channel,
                       int state_real, int varlen, int slotted, int qk_norm, real scale,
                       GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo,
                       GLOBAL uchar* gb, i64 go, GLOBAL uchar* beb, i64 beo, GLOBAL uchar* sb, i64 so,
                       GLOBAL uchar* pb, i64 po, GLOBAL uchar* db, i64 dof, GLOBAL uchar* eb, i64 eo,
                       GLOBAL uchar* cb, i64 co, GLOBAL uchar* slb, i64 slo, GLOBAL uchar* nb, i64 no,
                       GLOBAL uchar* hb, i64 ho, GLOBAL uchar* ub, i64 uo)
{
    const i64 j0 = GID(0) * GDN_CJ, vh = GID(1), r = GID(2);
    if (j0 >= V || vh >= HV || r >= R)
        return;
    GLOBAL const int* cu = GDN_V2 && varlen ? AT(int, cb, co) : 0;
    const i64 first = gdn_row_start(r, S, cu), end = gdn_row_end(r, S, cu);
    const i64 bt = cu ? 0 : r, from = bt * S + t0, to = from + T; /* the block's tokens */
    const i64 lo = first > from ? first : from, hi = end < to ? end : to;
    if (lo >= hi)
        return; /* no token of this row in the block (an empty sequence keeps its state as it is) */
    const int nc = V - j0 < GDN_CJ ? (int)(V - j0) : GDN_CJ; /* columns of this item inside the state */
    const i64 kh = vh / (HV / H);
    const gdn_tensors io = gdn_tensors_of(qb, qo, kb, ko, vb, vo, gb, go, beb, beo);
    GLOBAL const real* dec = AT(real, eb, eo);
    GLOBAL const real* nrm = AT(real, nb, no);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    const int resume = first < from ? 1 : carry, in_park = first < from, keep = end > to ? 1 : carry, out_park = end > to;
    GLOBAL const int* slots = GDN_V2 && slotted ? AT(int, slb, slo) : 0;
    const i64 entry = ((in_park ? r : gdn_state_row(r, slots)) * HV + vh) * K * V + j0;
    const i64 leave = ((out_park ? r : gdn_state_row(r, slots)) * HV + vh) * K * V + j0;
    /* parked rows, and with state_real every row, hold the state in the compute type (a select, not `||`: with
     * GDN_V2 0 the right operand is a constant, which clang warns of) */
    const int st_real = GDN_V2 && state_real, in_real = st_real ? 1 : in_park, out_real = st_real ? 1 : out_park;
    GLOBAL const store_t* in_st = (in_park ? AT(store_t, pb, po) : AT(store_t, sb, so)) + entry;
    GLOBAL const real* in_re = (in_park ? AT(real, pb, po) : AT(real, sb, so)) + entry;
    GLOBAL store_t* out_st = (out_park ? AT(store_t, pb, po) : AT(store_t, sb, so)) + leave;
    GLOBAL real* out_re = (out_park ? AT(real, pb, po) : AT(real, sb, so)) + leave;
    real s[STATE_MAX * GDN_CJ];
    /* The state moves in and out by loops unswitched on the (runtime) flags, so that a full item's
     * common case (all GDN_CJ columns, storage type) is a straight-line contiguous run per row. */
    if (resume && nc == GDN_CJ && !in_real)
        for (i64 i = 0; i < K; ++i)
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c)
                s[i * GDN_CJ + c] = LOAD(in_st, i * V + c);
    else if (resume && nc == GDN_CJ)
        for (i64 i = 0; i < K; ++i)
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c)
                s[i * GDN_CJ + c] = in_re[i * V + c];
    else
        for (i64 i = 0; i < K; ++i)
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c)
                s[i * GDN_CJ + c] = !resume || c >= nc ? (real)0 : in_real ? in_re[i * V + c] : LOAD(in_st, i * V + c);
    for (i64 tok = lo; tok < hi; ++tok) {
        const i64 head = tok * HV + vh, vec = head * V, key = (tok * H + kh) * K;
        GLOBAL const store_t* kr = io.k + key;
        GLOBAL const store_t* qr = io.q + key;
        GLOBAL const real* gr = dec + ((bt * T + tok - from) * HV + vh) * K;
        const real decay = per_channel ? (real)1 : exp(LOAD(io.g, head));
        const real rq = GDN_V2 && qk_norm ? nrm[2 * (tok * H + kh)] : (real)1;
        const real rk = GDN_V2 && qk_norm ? nrm[2 * (tok * H + kh) + 1] : (real)1;
        real a0[GDN_CJ], a1[GDN_CJ], u[GDN_CJ];
        PRAGMA_UNROLL
        for (int c = 0; c < GDN_CJ; ++c)
            a0[c] = a1[c] = (real)0;
        i64 i = 0;
        for (; i + 2 <= K; i += 2) {
            const real k0 = per_channel ? gr[i] * LOAD(kr, i) : LOAD(kr, i);
            const real k1 = per_channel ? gr[i + 1] * LOAD(kr, i + 1) : LOAD(kr, i + 1);
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c) {
                a0[c] += s[i * GDN_CJ + c] * k0;
                a1[c] += s[(i + 1) * GDN_CJ + c] * k1;
            }
        }
        if (i < K) {
            const real k0 = per_channel ? gr[i] * LOAD(kr, i) : LOAD(kr, i);
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c)
                a0[c] += s[i * GDN_CJ + c] * k0;
        }
        const real bh = LOAD(io.beta, head), dk = decay * rk;
        PRAGMA_UNROLL
        for (int c = 0; c < GDN_CJ; ++c) { /* u as the update takes it: times 1/|k| */
            u[c] = ((c < nc ? LOAD(io.v, vec + j0 + c) : (real)0) - dk * (a0[c] + a1[c])) * bh;
            if (GDN_RESERVE && c < nc)
                gdn_reserve_u(ub, uo, r, S, tok - first, HV, vh, V)[j0 + c] = u[c];
            u[c] *= rk;
            a0[c] = a1[c] = (real)0;
        }
        for (i = 0; i + 2 <= K; i += 2) {
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
        if (i < K) {
            const real d0 = per_channel ? gr[i] : decay, k0 = LOAD(kr, i), q0 = LOAD(qr, i);
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c) {
                const real x0 = d0 * s[i * GDN_CJ + c] + k0 * u[c];
                s[i * GDN_CJ + c] = x0;
                a0[c] += x0 * q0;
            }
        }
        const real sq = scale * rq;
        PRAGMA_UNROLL
        for (int c = 0; c < GDN_CJ; ++c)
            if (c < nc)
                STORE(dst, vec + j0 + c, sq * (a0[c] + a1[c]));
        if (GDN_RESERVE)
            gdn_reserve_record(hb, ho, ub, uo, r, S, tok - first, HV, vh, K, V, j0, nc, s);
    }
    if (keep && nc == GDN_CJ && !out_real)
        for (i64 i = 0; i < K; ++i)
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c)
                STORE(out_st, i * V + c, s[i * GDN_CJ + c]);
    else if (keep && nc == GDN_CJ)
        for (i64 i = 0; i < K; ++i)
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c)
                out_re[i * V + c] = s[i * GDN_CJ + c];
    else if (keep)
        for (i64 i = 0; i < K; ++i)
            PRAGMA_UNROLL
            for (int c = 0; c < GDN_CJ; ++c)
                if (c < nc) {
                    if (out_real)
                        out_re[i * V + c] = s[i * GDN_CJ + c];
                    else
                        STORE(out_st, i * V + c, s[i * GDN_CJ + c]);
                }
}

/* Columns [j0, j0+nc) of one decode step, on the state where it lives (`st`, the bytes of the head's
 * [K, V] entry, storage type or with st_real the compute type; null without carry_state: the step
 * starts from zeros and keeps nothing), reading S once from memory and writing it once: no private copy
 * to fill and drain, which at one step costs more than the step. With d[i] the decay (per channel, or 1
 * and the head's `decay` applied after) a first sweep over the old state gives a[j] = sum_i S[i,j] d[i]
 * k[i], so u = (v - decay rk a) beta (rk = 1/|k| with qk_norm, else 1); a second sweep (the item's
 * columns, still in L1) forms S[i,j] = d[i] decay S[i,j] + k[i] rk u[j] in the compute type, stores it
 * and sums the output sum_i q[i] S[i,j] from it: the ABI's order, so a NaN or an Inf lands in the same
 * class as on every other device. Called with constant nc (GDN_DJ) and st_real, or the tail's column
 * count: after inlining the column loops vectorize and the state's element type is fixed. */
INLINE_FN void gdn_step_columns(i64 vec, i64 j0, const int nc, i64 K, i64 V, real decay, int per_channel,
                                GLOBAL const store_t* qr, GLOBAL const store_t* kr, GLOBAL const store_t* v,
                                GLOBAL const store_t* gr, real bh, real rk, real sq, GLOBAL uchar* st,
                                const int st_real, GLOBAL store_t* dst)
{
    real a[GDN_DJ], y[GDN_DJ], d[STATE_MAX];
    for (int c = 0; c < nc; ++c)
        a[c] = y[c] = (real)0;
    /* without a state the zeros are decayed all the same: an infinite decay makes them NaN, as the ABI's
     * order does */
    for (i64 i = 0; i < K; ++i) {
        d[i] = per_channel ? exp(LOAD(gr, i)) : (real)1;
        const real dk = d[i] * LOAD(kr, i);
        for (int c = 0; c < nc; ++c)
            a[c] += (st ? load_any(st, i * V + j0 + c, st_real) : (real)0) * dk;
    }
    for (int c = 0; c < nc; ++c)
        a[c] = (LOAD(v, vec + j0 + c) - decay * rk * a[c]) * bh * rk; /* from here on a holds rk u */
    for (i64 i = 0; i < K; ++i) {
        const real di = d[i] * decay, k0 = LOAD(kr, i), q0 = LOAD(qr, i);
        for (int c = 0; c < nc; ++c) {
            const real s = di * (st ? load_any(st, i * V + j0 + c, st_real) : (real)0) + k0 * a[c];
            if (st)
                store_any(st, i * V + j0 + c, st_real, s);
            y[c] += q0 * s;
        }
    }
    for (int c = 0; c < nc; ++c)
        STORE(dst, vec + j0 + c, sq * y[c]);
}

/* seq == 1 (decode), both gate kinds, one launch and no scratch: one work-item per GDN_DJ value columns
 * of a (value head vh, row r) and the row's token (none for an empty sequence of a varlen batch); a
 * per-channel decay is taken where it is used (K exps per item). */
KERNEL gated_delta_net_step(i64 R, i64 H, i64 HV, i64 K, i64 V, int carry, int per_channel, int state_real,
                            int varlen, int slotted, int qk_norm, real scale,
                            GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo,
                            GLOBAL uchar* gb, i64 go, GLOBAL uchar* beb, i64 beo, GLOBAL uchar* sb, i64 so,
                            GLOBAL uchar* db, i64 dof, GLOBAL uchar* cb, i64 co, GLOBAL uchar* slb, i64 slo,
                            GLOBAL uchar* nb, i64 no)
{
    const i64 j0 = GID(0) * GDN_DJ, vh = GID(1), r = GID(2);
    if (j0 >= V || vh >= HV || r >= R)
        return;
    GLOBAL const int* cu = GDN_V2 && varlen ? AT(int, cb, co) : 0;
    const i64 tok = gdn_row_start(r, 1, cu);
    if (gdn_row_end(r, 1, cu) <= tok)
        return;
    const i64 kh = vh / (HV / H), head = tok * HV + vh, vec = head * V, key = (tok * H + kh) * K;
    GLOBAL const store_t* g = AT(store_t, gb, go);
    GLOBAL const int* slots = GDN_V2 && slotted ? AT(int, slb, slo) : 0;
    const int st_real = GDN_V2 && state_real;
    const i64 entry = (gdn_state_row(r, slots) * HV + vh) * K * V;
    GLOBAL uchar* st = carry ? (st_real ? (GLOBAL uchar*)(AT(real, sb, so) + entry) : (GLOBAL uchar*)(AT(store_t, sb, so) + entry)) : 0;
    const real decay = per_channel ? (real)1 : exp(LOAD(g, head)), bh = LOAD(AT(store_t, beb, beo), head);
    GLOBAL const real* nrm = AT(real, nb, no);
    const real rq = GDN_V2 && qk_norm ? nrm[2 * (tok * H + kh)] : (real)1;
    const real rk = GDN_V2 && qk_norm ? nrm[2 * (tok * H + kh) + 1] : (real)1;
    GLOBAL const store_t* qr = AT(store_t, qb, qo) + key;
    GLOBAL const store_t* kr = AT(store_t, kb, ko) + key;
    GLOBAL const store_t* v = AT(store_t, vb, vo);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    const real sq = scale * rq;
    if (V - j0 >= GDN_DJ) { /* st_real by itself: `&& st_real` is a constant operand with GDN_V2 0 (clang warns) */
        if (st_real)
            gdn_step_columns(vec, j0, GDN_DJ, K, V, decay, per_channel, qr, kr, v, g + head * K, bh, rk, sq, st, 1, dst);
        else
            gdn_step_columns(vec, j0, GDN_DJ, K, V, decay, per_channel, qr, kr, v, g + head * K, bh, rk, sq, st, 0, dst);
    } else
        gdn_step_columns(vec, j0, (int)(V - j0), K, V, decay, per_channel, qr, kr, v, g + head * K, bh, rk, sq, st,
                         st_real, dst);
}
#endif

#if defined(RLX_TARGET_GPU) && defined(SSM_N) /* a gpu program variant: SSM_N, SSM_L from its launch */
/* GPU shapes (target gpu): one row is a state column j of one (row r, value head vh); its key indices i
 * are spread across SSM_L lanes of a work-group, lane nl holding S[i, j] for i = w*SSM_L + nl,
 * w < SSM_W = SSM_N / SSM_L, in registers (fully unrolled: no stack). SSM_N (the state-size variant,
 * >= K) and SSM_L come from the launch's defines, SSM_WG (the largest work-group) from the
 * gpu tuning table. Both gate kinds and both carry modes run the whole sequence in one launch: a
 * per-channel decay is exp(g[i]) of the lane's own rows. Each step reduces twice across the lanes of a column through
 * LOCAL memory: sum_i S[i,j] (d[i] k[i]) (every lane reads it back: it needs u[j]) in the first half
 * of `part`, then sum_i S[i,j] q[i] in the second (one lane stores it). Each half is rewritten only
 * after the barrier that follows the other half's write, which every reader of it has passed. The
 * grid is 1-D (groups of columns folded into x): no extent reaches CUDA's 65,535 cap on y/z.
 * The version-2 flags are those of the cpu kernels (see the top of this file). */
#define SSM_W (SSM_N / SSM_L)


KERNEL gated_delta_net_lanes(i64 R, i64 S, i64 H, i64 HV, i64 K, i64 V, int carry, int per_channel, int state_real,
                             int varlen, int slotted, int qk_norm, real scale,
                             GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo,
                             GLOBAL uchar* gb, i64 go, GLOBAL uchar* beb, i64 beo, GLOBAL uchar* sb, i64 so,
                             GLOBAL uchar* db, i64 dof, GLOBAL uchar* cb, i64 co, GLOBAL uchar* slb, i64 slo,
                             GLOBAL uchar* nb, i64 no)
{
    LOCAL real part[2 * SSM_WG];
    /* remainders as x - q*d, not %: LLVM turns a div/rem pair into a `freeze`, which Oclgrind rejects */
    const int lane = (int)LID(0), rw = lane / SSM_L, nl = lane - rw * SSM_L, first = rw * SSM_L;
    const i64 rows = LSIZE(0) / SSM_L, blocks = (V + rows - 1) / rows;
    const i64 hb = GROUP(0) / blocks, r = hb / HV, vh = hb - r * HV, j = (GROUP(0) - hb * blocks) * rows + rw;
    const int live = j < V; /* a lane past the last column still meets every barrier */
    const i64 kh = vh / (HV / H);
    GLOBAL const int* cu = GDN_V2 && varlen ? AT(int, cb, co) : 0;
    GLOBAL const int* slots = GDN_V2 && slotted ? AT(int, slb, slo) : 0;
    const i64 lo = gdn_row_start(r, S, cu), hi = gdn_row_end(r, S, cu); /* the same for the whole group */
    const int st_real = GDN_V2 && state_real;
    const gdn_tensors io = gdn_tensors_of(qb, qo, kb, ko, vb, vo, gb, go, beb, beo);
    GLOBAL const real* nrm = AT(real, nb, no);
    const i64 entry = (gdn_state_row(r, slots) * HV + vh) * K * V + (live ? j : 0);
    GLOBAL uchar* st = st_real ? (GLOBAL uchar*)(AT(real, sb, so) + entry) : (GLOBAL uchar*)(AT(store_t, sb, so) + entry);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    real s[SSM_W];
    PRAGMA_UNROLL
    for (int w = 0; w < SSM_W; ++w) {
        const int i = w * SSM_L + nl;
        s[w] = carry && live && i < K ? load_any(st, i * V, st_real) : (real)0;
    }
    for (i64 tok = lo; tok < hi; ++tok) {
        const i64 head = tok * HV + vh, vec = head * V, key = (tok * H + kh) * K;
        const real decay = per_channel ? (real)1 : rlx_exp(LOAD(io.g, head));
        const real rq = GDN_V2 && qk_norm ? nrm[2 * (tok * H + kh)] : (real)1;
        const real rk = GDN_V2 && qk_norm ? nrm[2 * (tok * H + kh) + 1] : (real)1;
        real kd[SSM_W], y = (real)0;
        PRAGMA_UNROLL
        for (int w = 0; w < SSM_W; ++w) {
            const int i = w * SSM_L + nl;
            kd[w] = (real)0;
            if (i < K) {
                if (per_channel)
                    s[w] *= rlx_exp(LOAD(io.g, head * K + i));
                else
                    s[w] *= decay;
                kd[w] = LOAD(io.k, key + i);
                y += s[w] * kd[w];
            }
        }
        part[lane] = y;
        BARRIER();
        y = ssm_row_sum(part, first);
        const real u = ((live ? LOAD(io.v, vec + j) : (real)0) - rk * y) * LOAD(io.beta, head) * rk; /* times 1/|k| */
        y = (real)0;
        PRAGMA_UNROLL
        for (int w = 0; w < SSM_W; ++w) {
            const int i = w * SSM_L + nl;
            if (i < K) {
                s[w] += kd[w] * u;
                y += s[w] * LOAD(io.q, key + i);
            }
        }
        part[SSM_WG + lane] = y;
        BARRIER();
        if (live && nl == 0) {
            y = ssm_row_sum(part, SSM_WG + first);
            STORE(dst, vec + j, scale * rq * y);
        }
    }
    if (carry && live)
        PRAGMA_UNROLL
        for (int w = 0; w < SSM_W; ++w) {
            const int i = w * SSM_L + nl;
            if (i < K)
                store_any(st, i * V, st_real, s[w]);
        }
}
#endif

#if defined(RLX_TARGET_GPU) && !defined(SSM_N) && !defined(RLX_NEED_FP64)
/* Gated delta net chunked (target gpu, long sequences; f64 keeps the lanes kernel: its LOCAL tiles
 * would pass CUDA's 48 KiB of static shared memory). Chunks of GDN_Q steps. Inside a chunk, with
 * G[t] = sum_{s<=t} g[s] the cumulative log-decay from the chunk start (per key channel i with
 * per-channel gates, the same for every i per head), S0 the state entering the chunk and
 * D[t][s] = exp(G[t] - G[s]) (a diagonal over i per channel):
 *   u[t] = beta[t] (v[t] - (exp(G[t]) k[t]) S0 - sum_{s<t} (k[t] . D[t][s] k[s]) u[s])
 * is the unit lower triangular system (I + M) U = beta V - beta (exp(G) K) S0 with
 * M[t][s] = beta[t] (k[t] . D[t][s] k[s]), s < t; with T = (I + M)^-1 (the WY/UT form)
 *   U = U0 - W S0,   U0 = T beta V,   W = T beta exp(G) K,
 *   out[t] = scale ((exp(G[t]) q[t]) S0 + sum_{s<=t} P[t][s] u[s]),   P[t][s] = q[t] . D[t][s] k[s],
 *   S_next = exp(G[last]) S0 + sum_s (exp(G[last] - G[s]) k[s]) (x) u[s].
 * q and k enter every product scaled by 1/|q|, 1/|k| with qk_norm. Three launches over scratch in the
 * compute type, one slot per (value head, chunk):
 *   gated_delta_net_chunk_prep   G (floored log-decays summed), P, T by forward substitution in LOCAL
 *                                memory, then W and U0: one work-group of GDN_LANES per chunk;
 *   gated_delta_net_state_pass   in chunk order: stores the state entering the chunk, turns U0 into
 *                                U = U0 - W S0 and steps the state; one work-group per (row, value
 *                                head, block of value columns), each lane one key row i of the block's
 *                                GDN_PJ-column strips in registers (the state is column-separable);
 *   gated_delta_net_chunk_out    the outputs of one chunk and GDN_OT value columns per work-group, the
 *                                products staged through LOCAL tiles.
 * Log-decays below GDN_LOG_FLOOR (log of the smallest f32 subnormal, minus 1) are raised to it: exp
 * of either is exactly 0, but a -inf (a state reset) would meet another in a difference G[t] - G[s]
 * (NaN), and a huge finite one would drown the digits of every later G of its chunk. Every sum over
 * steps is bounded by t (no product with a zero mask), so a NaN at step t of a lane reaches only its
 * outputs from t on: in its chunk through G, P, T and U, beyond it through the state. */
#define GDN_LOG_FLOOR (-104.2789f)
#ifdef RLX_MMA
#define GDN_QP GDN_Q /* chunk_prep's M and T take accumulator tiles (TF32: are operands) where they lie */
#define GDN_AS (16 * GDN_Q / GDN_LANES) /* f32 Gram entries per lane: row t = lane % GDN_Q, in its diagonal tile */
#else
#define GDN_QP (GDN_Q + 1) /* LOCAL row strides padded by one so that a column walk spreads over banks */
#define GDN_AS (GDN_Q * GDN_Q / GDN_LANES) /* Gram entries per lane: row t = lane % GDN_Q, GDN_AS columns */
#endif
#define GDN_NTP (GDN_NT + 1)
#define GDN_OTP (GDN_OT + 1)
#define GDN_TS (GDN_LANES / GDN_OT)        /* output rows apart for one lane of chunk_out */
#define GDN_OY (GDN_Q / GDN_TS)            /* outputs per lane of chunk_out */

/* Chunks never hold tokens of two rows: a row (a batch row, or a sequence of a varlen batch) of n tokens
 * has ceil(n / GDN_Q) chunks of its own, the first at its first token (as fla's varlen chunk indices),
 * so every chunk starts from the state its row's previous chunk left, or the row's initial state, and
 * the state pass of each row runs on its own. The chunks of all rows are numbered one row after another;
 * NC (the planner's) bounds their count: ceil(S / GDN_Q) per batch row, S / GDN_Q + R with varlen. */

/* Row r's chunk count, and through *slot0 the number of its first chunk. */
DEVICE_FN i64 gdn_row_chunks(i64 r, i64 S, GLOBAL const int* cu, i64* slot0)
{
    if (!(GDN_V2 && cu)) {
        const i64 per = (S + GDN_Q - 1) / GDN_Q;
        *slot0 = r * per;
        return per;
    }
    i64 acc = 0;
    for (i64 x = 0; x < r; ++x)
        acc += ((i64)cu[x + 1] - cu[x] + GDN_Q - 1) / GDN_Q;
    *slot0 = acc;
    return ((i64)cu[r + 1] - cu[r] + GDN_Q - 1) / GDN_Q;
}

/* Chunk number `slot`: its first (flat) token through *t0, and its steps (0 past the last chunk). */
DEVICE_FN int gdn_chunk(i64 slot, i64 R, i64 S, GLOBAL const int* cu, i64* t0)
{
    i64 acc = 0, first = 0, end = 0;
    if (!(GDN_V2 && cu)) {
        const i64 per = (S + GDN_Q - 1) / GDN_Q, r = slot / per;
        first = r * S + (slot - r * per) * GDN_Q;
        end = (r + 1) * S;
    } else {
        for (i64 r = 0; r < R && end == 0; ++r) {
            const i64 n = ((i64)cu[r + 1] - cu[r] + GDN_Q - 1) / GDN_Q;
            if (slot < acc + n) {
                first = cu[r] + (slot - acc) * GDN_Q;
                end = cu[r + 1];
            }
            acc += n;
        }
    }
    *t0 = first;
    return end - first < GDN_Q ? (int)(end - first) : GDN_Q;
}

/* Chunk `slot` of value head vh (its key head kh), slot `bhc` = vh * NC + slot of the scratch arrays:
 * its first token t0 and its steps. */
typedef struct {
    i64 bhc, vh, kh, t0;
    int steps;
} gdn_chunk_slot;

INLINE_FN gdn_chunk_slot gdn_chunk_slot_of(i64 bhc, i64 R, i64 S, i64 H, i64 HV, i64 NC, GLOBAL const int* cu)
{
    gdn_chunk_slot out;
    out.bhc = bhc;
    out.vh = bhc / NC;
    out.kh = out.vh / (HV / H);
    out.steps = gdn_chunk(bhc - out.vh * NC, R, S, cu, &out.t0);
    return out;
}

/* chunk_prep's Gram products in f32 (the portable path's every entry; the MMA variant's diagonal tiles with
 * per-channel gates): key channels i0 .. i0+GDN_NT of the chunk's steps staged in LOCAL, rows GDN_NTP apart,
 * k and q scaled by their norms, and with per-channel gates the cumulative log-decays G; zero past the steps
 * and past K. Step s's key row at k + (key0 + s*H) * K (and q's). */
INLINE_FN void gdn_stage_gram_slice(LOCAL_PTR real* kt, LOCAL_PTR real* qt, LOCAL_PTR real* gt, GLOBAL const store_t* q,
                                    GLOBAL const store_t* k, GLOBAL const real* gam, i64 key0, i64 H, i64 K, i64 i0,
                                    LOCAL_PTR const real* rqs, LOCAL_PTR const real* rks, int per_channel, int steps,
                                    int lane)
{
    for (int e = lane; e < GDN_Q * GDN_NT; e += GDN_LANES) {
        const int s = e / GDN_NT, ii = e - s * GDN_NT;
        const int in = s < steps && i0 + ii < K;
        const i64 at = (key0 + s * H) * K + i0 + ii;
        kt[s * GDN_NTP + ii] = in ? LOAD(k, at) * rks[s] : (real)0;
        qt[s * GDN_NTP + ii] = in ? LOAD(q, at) * rqs[s] : (real)0;
        gt[s * GDN_NTP + ii] = in && per_channel ? gam[s * K + i0 + ii] : (real)0;
    }
}

/* Row tg's Gram entries at columns s0 .. s0+GDN_AS-1 (those s <= tg) over the staged channels: a[j] += k[tg] . D k[s],
 * p[j] += q[tg] . D k[s], with D = exp(G[tg] - G[s]) per channel (per-channel gates; one gate per head: 1 here,
 * its decay taken in gdn_gram_fma_store) */
INLINE_FN void gdn_gram_fma_slice(real* a, real* p, LOCAL_PTR const real* kt, LOCAL_PTR const real* qt,
                                  LOCAL_PTR const real* gt, int tg, int s0, int per_channel)
{
    for (int ii = 0; ii < GDN_NT; ++ii) { /* not unrolled: the tile loads would all be hoisted */
        const real kv = kt[tg * GDN_NTP + ii], qv = qt[tg * GDN_NTP + ii], gv = gt[tg * GDN_NTP + ii];
        PRAGMA_UNROLL
        for (int j = 0; j < GDN_AS; ++j)
            if (s0 + j <= tg) {
                const real ks = per_channel ? kt[(s0 + j) * GDN_NTP + ii] * rlx_exp(gv - gt[(s0 + j) * GDN_NTP + ii])
                                            : kt[(s0 + j) * GDN_NTP + ii];
                a[j] += kv * ks;
                p[j] += qv * ks;
            }
    }
}

/* Row tg's summed entries at s0.. (s <= tg < steps): P to scratch, M[t][s] = beta[t] (k[t] . D[t][s] k[s]) for
 * s < t into LOCAL; one gate per head takes its decay exp(G[t] - G[s]) here */
INLINE_FN void gdn_gram_fma_store(GLOBAL real* pm, LOCAL_PTR real* m, const real* a, const real* p,
                                  LOCAL_PTR const real* bs, GLOBAL const real* gam, int tg, int s0, int per_channel,
                                  int steps)
{
    PRAGMA_UNROLL
    for (int j = 0; j < GDN_AS; ++j)
        if (s0 + j <= tg && tg < steps) {
            const real d = per_channel ? (real)1 : rlx_exp(gam[tg] - gam[s0 + j]);
            pm[tg * GDN_Q + s0 + j] = d * p[j];
            if (s0 + j < tg)
                m[tg * GDN_QP + s0 + j] = bs[tg] * d * a[j];
        }
}

#ifdef RLX_MMA
#if GDN_NT != 16 || GDN_Q % 16 != 0 || GDN_LANES / 32 < GDN_Q / 16
#error "the MMA variant of gated_delta_net_chunk_prep tiles 16x16, GDN_NT = 16 columns at a time"
#endif
#if RLX_MMA == 1
/* T's tiles below the diagonal (m, its strict lower triangle, f32) as 16-bit operands in tl, rows GDN_Q
 * apart; zero past the chunk's steps. TF32 takes m where it lies (GDN_QP = GDN_Q). */
INLINE_FN void gdn_stage_t(LOCAL_PTR mma_t* tl, LOCAL_PTR const real* m, int steps, int lane)
{
    for (int e = lane; e < GDN_Q * GDN_Q; e += GDN_LANES) {
        const int t = e / GDN_Q, s = e - t * GDN_Q;
        if (s / 16 < t / 16)
            tl[e] = TO_MMA(t < steps ? m[t * GDN_QP + s] : (real)0);
    }
}
#endif

/* out[t][i0+ii] = x[t] + sum_{s<t} T[t][s] x[s] for the GDN_NT columns staged in kt (f32) and xs (operands):
 * each lane sums the diagonal tile's terms in f32, the warps w < GDN_Q/16 add T's tiles below the
 * diagonal times xs on the tensor cores (steps 16w..), and the lanes store. */
INLINE_FN void gdn_wu_tiles_barrier(GLOBAL real* out, i64 width, i64 i0, LOCAL_PTR const mma_t* tl,
                                    LOCAL_PTR const real* m, LOCAL_PTR const real* kt, LOCAL_PTR const mma_t* xs,
                                    LOCAL_PTR float* yl, int steps, int lane)
{
    for (int e = lane; e < GDN_Q * 16; e += GDN_LANES) {
        const int t = e / 16, ii = e - t * 16;
        real x = kt[t * GDN_NTP + ii];
        for (int s = t / 16 * 16; s < t; ++s)
            x += m[t * GDN_QP + s] * kt[s * GDN_NTP + ii];
        yl[e] = t < steps ? x : (real)0;
    }
    BARRIER();
    const int w = MMA_WARP(lane);
    if (w < GDN_Q / 16 && w * 16 < steps) {
        mma_acc y;
        mma_load(&y, yl + w * 256, 16);
        for (int sj = 0; sj < w; ++sj)
            mma_tile(&y, MMA_ROW, tl + w * 16 * GDN_Q + sj * 16, GDN_Q, MMA_ROW, xs + sj * 256, 16);
        mma_store(yl + w * 256, &y, 16);
    }
    BARRIER();
    for (int e = lane; e < steps * 16; e += GDN_LANES) {
        const int t = e / 16, ii = e - t * 16;
        if (i0 + ii < width)
            out[t * width + i0 + ii] = yl[e];
    }
}
#endif

#ifdef RLX_MMA
#define GDN_GT ((GDN_Q / 16) * (GDN_Q / 16 + 1) / 2) /* tiles on and below the diagonal of a chunk's Gram */
#if (GDN_LANES / 32) * 2 < GDN_GT
#error "the MMA Gram products of gated_delta_net_chunk_prep give each warp at most two tiles"
#endif
/* One gate per head: the Gram products on the tensor cores, k.k^T (pass 0, into m) and then q.k^T (pass 1,
 * into pm), the tiles on and below the diagonal (warp w: tiles w and w + warps), over K in slices of 16 of
 * the scaled rows (ks, qs: operands); then each entry s <= t < steps takes its decay d = exp(G[t] - G[s]):
 * P = d p, and M = beta[t] d a below the diagonal. Entries above it hold what the tiles held; no reader
 * looks there. Step t's key row at k + (key0 + t*H) * K (and q's). */
INLINE_FN void gdn_gram_mma_barrier(LOCAL_PTR real* m, GLOBAL real* pm, LOCAL_PTR mma_t* ks, LOCAL_PTR mma_t* qs,
                                    GLOBAL const store_t* q, GLOBAL const store_t* k, i64 key0, i64 H, i64 K,
                                    LOCAL_PTR const real* rqs, LOCAL_PTR const real* rks, LOCAL_PTR const real* bs,
                                    GLOBAL const real* gam, int steps, int lane)
{
    const int w = MMA_WARP(lane), k1 = w + GDN_LANES / 32, has0 = w < GDN_GT, has1 = k1 < GDN_GT;
    int s0 = 0, s1 = 0;
    const int t0 = has0 ? mma_lower_tile(w, &s0) : 0, t1 = has1 ? mma_lower_tile(k1, &s1) : 0;
    for (int pass = 0; pass < 2; ++pass) {
        mma_acc g0, g1;
        mma_zero(&g0);
        mma_zero(&g1);
        for (i64 i0 = 0; i0 < (steps > 0 ? K : 0); i0 += 16) {
            BARRIER(); /* the norms and beta are written (first slice), or the previous slice's readers are done */
            for (int e = lane; e < GDN_Q * 16; e += GDN_LANES) {
                const int t = e / 16, ii = e - t * 16;
                const i64 at = (key0 + t * H) * K + i0 + ii;
                const int in = t < steps && i0 + ii < K;
                ks[e] = TO_MMA(in ? LOAD(k, at) * rks[t] : (real)0);
                qs[e] = TO_MMA(in && pass ? LOAD(q, at) * rqs[t] : (real)0);
            }
            BARRIER();
            if (has0)
                mma_tile(&g0, MMA_ROW, (pass ? qs : ks) + t0 * 256, 16, MMA_COL, ks + s0 * 256, 16);
            if (has1)
                mma_tile(&g1, MMA_ROW, (pass ? qs : ks) + t1 * 256, 16, MMA_COL, ks + s1 * 256, 16);
        }
        if (has0 && pass)
            mma_store_global(pm + t0 * 16 * GDN_Q + s0 * 16, &g0, GDN_Q);
        if (has1 && pass)
            mma_store_global(pm + t1 * 16 * GDN_Q + s1 * 16, &g1, GDN_Q);
        if (has0 && !pass)
            mma_store(m + t0 * 16 * GDN_QP + s0 * 16, &g0, GDN_QP);
        if (has1 && !pass)
            mma_store(m + t1 * 16 * GDN_QP + s1 * 16, &g1, GDN_QP);
    }
    BARRIER();
    for (int e = lane; e < GDN_Q * GDN_Q; e += GDN_LANES) {
        const int t = e / GDN_Q, s = e - t * GDN_Q;
        if (s <= t && t < steps) {
            const real d = rlx_exp(gam[t] - gam[s]);
            pm[e] = d * pm[e];
            if (s < t)
                m[t * GDN_QP + s] = bs[t] * d * m[t * GDN_QP + s];
        }
    }
}

#define GDN_OFF ((GDN_Q / 16) * (GDN_Q / 16 - 1) / 2) /* tiles below the diagonal of a chunk's Gram */
#if GDN_OFF > GDN_LANES / 32 || 2 * GDN_Q * 16 + GDN_OFF * 256 > GDN_Q * GDN_Q || GDN_LANES % GDN_Q != 0
#error "the per-channel MMA Gram of gated_delta_net_chunk_prep: a tile below the diagonal per warp, its operands in Q*Q"
#endif
/* One slice's operands of the per-channel Gram tiles below the diagonal, from the f32 slice in kt, qt, gt: row t
 * of ka (beta[t] k[t]) and qa (q[t]) weighed by exp(G[t] - G[m]), m the first step of t's 16-row block; in kb,
 * per tile w = (ti, sj) below the diagonal, row s of k weighed by exp(G[16 ti] - G[s]). Rows past the steps, and
 * the tiles whose row block starts past them, are zero (no difference with an unstaged G is taken). */
INLINE_FN void gdn_gram_channel_operands(LOCAL_PTR mma_t* ka, LOCAL_PTR mma_t* qa, LOCAL_PTR mma_t* kb,
                                         LOCAL_PTR const real* kt, LOCAL_PTR const real* qt, LOCAL_PTR const real* gt,
                                         LOCAL_PTR const real* bs, int steps, int lane)
{
    for (int e = lane; e < GDN_Q * 16; e += GDN_LANES) {
        const int t = e / 16, ii = e - t * 16, from = t / 16 * 16;
        const real d = t < steps ? rlx_exp(gt[t * GDN_NTP + ii] - gt[from * GDN_NTP + ii]) : (real)0;
        ka[e] = TO_MMA(t < steps ? bs[t] * kt[t * GDN_NTP + ii] * d : (real)0);
        qa[e] = TO_MMA(qt[t * GDN_NTP + ii] * d);
    }
    for (int e = lane; e < GDN_OFF * 256; e += GDN_LANES) {
        const int w = e / 256, r = (e - w * 256) / 16, ii = e - w * 256 - r * 16;
        int sj = 0;
        const int from = (mma_lower_tile(w, &sj) + 1) * 16, s = sj * 16 + r;
        kb[e] = TO_MMA(from < steps ? kt[s * GDN_NTP + ii] * rlx_exp(gt[from * GDN_NTP + ii] - gt[s * GDN_NTP + ii])
                                    : (real)0);
    }
}

/* Per-channel gates: D[t][s] = diag_i exp(G[t][i] - G[s][i]) varies with the key channel, so the Gram products are
 * tile products only once the decay is split. A tile below the diagonal (rows from step m = 16 ti, columns s < m)
 * splits it at m: k[t] . D[t][s] k[s] = sum_i (k[t][i] exp(G[t][i] - G[m][i])) (k[s][i] exp(G[m][i] - G[s][i])),
 * both exponents <= 0 where the log-decays are (G falls step by step), so neither weighed operand overflows. Per
 * slice of 16 channels, staged in f32 (kt, qt, gt), warp w < GDN_OFF sums tile w of M (beta folded into its rows)
 * and of P on the tensor cores from the operands in ops (ka, qa, kb: 2 Q x 16 + GDN_OFF tiles); the diagonal
 * tiles stay f32 FMA over s <= t (GDN_AS columns of one row per lane), as the portable path sums them. Entries
 * above the diagonal are not written. */
INLINE_FN void gdn_gram_channel_mma_barrier(LOCAL_PTR real* m, GLOBAL real* pm, LOCAL_PTR mma_t* ops,
                                            LOCAL_PTR real* kt, LOCAL_PTR real* qt, LOCAL_PTR real* gt,
                                            GLOBAL const store_t* q, GLOBAL const store_t* k, GLOBAL const real* gam,
                                            i64 key0, i64 H, i64 K, LOCAL_PTR const real* rqs,
                                            LOCAL_PTR const real* rks, LOCAL_PTR const real* bs, int steps, int lane)
{
    LOCAL_PTR mma_t* const ka = ops;
    LOCAL_PTR mma_t* const qa = ops + GDN_Q * 16;
    LOCAL_PTR mma_t* const kb = ops + 2 * GDN_Q * 16;
    const int w = MMA_WARP(lane), has = w < GDN_OFF;
    int sj = 0;
    const int ti = has ? mma_lower_tile(w, &sj) + 1 : 0;
    const int sh = lane / GDN_Q, tg = lane - sh * GDN_Q, s0 = tg / 16 * 16 + sh * GDN_AS;
    real a[GDN_AS], p[GDN_AS];
    PRAGMA_UNROLL
    for (int j = 0; j < GDN_AS; ++j)
        a[j] = p[j] = (real)0;
    mma_acc ma, mp;
    mma_zero(&ma);
    mma_zero(&mp);
    for (i64 i0 = 0; i0 < (steps > 0 ? K : 0); i0 += 16) {
        BARRIER(); /* G, beta and the norms are written (first slice), or the previous slice's readers are done */
        gdn_stage_gram_slice(kt, qt, gt, q, k, gam, key0, H, K, i0, rqs, rks, 1, steps, lane);
        BARRIER();
        gdn_gram_fma_slice(a, p, kt, qt, gt, tg, s0, 1);
        gdn_gram_channel_operands(ka, qa, kb, kt, qt, gt, bs, steps, lane);
        BARRIER();
        if (has) {
            mma_tile(&ma, MMA_ROW, ka + ti * 256, 16, MMA_COL, kb + w * 256, 16);
            mma_tile(&mp, MMA_ROW, qa + ti * 256, 16, MMA_COL, kb + w * 256, 16);
        }
    }
    BARRIER(); /* every tile is summed: ops may be m itself (TF32) */
    if (has) {
        mma_store(m + ti * 16 * GDN_QP + sj * 16, &ma, GDN_QP);
        mma_store_global(pm + ti * 16 * GDN_Q + sj * 16, &mp, GDN_Q);
    }
    gdn_gram_fma_store(pm, m, a, p, bs, gam, tg, s0, 1, steps);
}
#endif

/* bounded to two groups per SM (128 registers): the MMA variant's per-channel Gram would take a few more */
KERNEL_BOUNDED(GDN_LANES, 2) gated_delta_net_chunk_prep(i64 R, i64 S, i64 H, i64 HV, i64 K, i64 V, i64 NC,
                                                        int per_channel, int qk_norm, int varlen, GLOBAL uchar* cb,
                                                        i64 co, GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko,
                                                        GLOBAL uchar* vb, i64 vo, GLOBAL uchar* gb, i64 go,
                                                        GLOBAL uchar* beb, i64 beo, GLOBAL uchar* nb, i64 no,
                                                        GLOBAL uchar* gmb, i64 gmo, GLOBAL uchar* pb, i64 po,
                                                        GLOBAL uchar* wb, i64 wo, GLOBAL uchar* ub, i64 uo)
{
    LOCAL real kt[GDN_Q * GDN_NTP], qt[GDN_Q * GDN_NTP], gt[GDN_Q * GDN_NTP], bs[GDN_Q];
    LOCAL real rqs[GDN_Q], rks[GDN_Q];
#ifdef RLX_MMA
    MMA_LOCAL real m[GDN_Q * GDN_QP];
    MMA_LOCAL mma_t xs[GDN_Q * 16];
    MMA_LOCAL float yl[GDN_Q * 16];
#if RLX_MMA == 2
    LOCAL_PTR const mma_t* const tl = m;
    LOCAL_PTR mma_t* const gram_qs = yl; /* the Gram's q slices: yl is free until W and U0 (f32 operands) */
    LOCAL_PTR mma_t* const gram_ops = m; /* the per-channel Gram's operands: m is free until its tiles are stored */
#else
    MMA_LOCAL mma_t tl[GDN_Q * GDN_Q];
    LOCAL_PTR mma_t* const gram_qs = tl; /* the Gram's q slices: tl is free until T's tiles are staged */
    LOCAL_PTR mma_t* const gram_ops = tl; /* the per-channel Gram's operands, as gram_qs */
#endif
#else
    LOCAL real m[GDN_Q * GDN_QP];
#endif
    /* a number past the last chunk of a varlen batch has no steps: the whole group walks empty loops to every
     * barrier (a work-item that returns before a barrier is undefined in OpenCL; Intel's CPU runtime crashed on
     * it in mamba2_chunk_state) */
    const int lane = (int)LID(0);
    GLOBAL const int* cu = GDN_V2 && varlen ? AT(int, cb, co) : 0;
    const gdn_chunk_slot chunk = gdn_chunk_slot_of(GROUP(0), R, S, H, HV, NC, cu);
    const i64 bhc = chunk.bhc, vh = chunk.vh, kh = chunk.kh, t0 = chunk.t0;
    const i64 gw = per_channel ? K : 1; /* log-decays per step: one per key channel, or one */
    const int steps = chunk.steps;
    GLOBAL real* gam = AT(real, gmb, gmo) + bhc * GDN_Q * gw;
    GLOBAL const store_t* q = AT(store_t, qb, qo);
    GLOBAL const store_t* k = AT(store_t, kb, ko);
    GLOBAL const store_t* v = AT(store_t, vb, vo);
    GLOBAL const store_t* g = AT(store_t, gb, go);
    GLOBAL real* pm = AT(real, pb, po) + bhc * GDN_Q * GDN_Q;
    GLOBAL real* wm = AT(real, wb, wo) + bhc * GDN_Q * K;
    GLOBAL real* um = AT(real, ub, uo) + bhc * GDN_Q * V;
    GLOBAL const real* nrm = AT(real, nb, no);
    /* G: each lane sums the floored log-decays of one channel (or the head's) over the chunk */
    for (i64 i = lane; i < gw; i += GDN_LANES) {
        real acc = (real)0;
        for (int t = 0; t < steps; ++t) {
            const real gv = LOAD(g, ((t0 + t) * HV + vh) * gw + i);
            acc += gv < GDN_LOG_FLOOR ? (real)GDN_LOG_FLOOR : gv; /* NaN stays NaN */
            gam[t * gw + i] = acc;
        }
    }
    if (lane < steps) { /* beta, and with qk_norm 1/|q| and 1/|k| of each step (q and k enter every product scaled) */
        bs[lane] = LOAD(AT(store_t, beb, beo), (t0 + lane) * HV + vh);
        rqs[lane] = GDN_V2 && qk_norm ? nrm[2 * ((t0 + lane) * H + kh)] : (real)1;
        rks[lane] = GDN_V2 && qk_norm ? nrm[2 * ((t0 + lane) * H + kh) + 1] : (real)1;
    }
#ifdef RLX_MMA
    if (!per_channel) /* one gate per head: the Gram products are GEMMs, decayed after */
        gdn_gram_mma_barrier(m, pm, xs, gram_qs, q, k, t0 * H + kh, H, K, rqs, rks, bs, gam, steps, lane);
    else
        gdn_gram_channel_mma_barrier(m, pm, gram_ops, kt, qt, gt, q, k, gam, t0 * H + kh, H, K, rqs, rks, bs, steps,
                                     lane);
#else
    {
        /* this lane's Gram entries: row tg, columns s0 .. s0+GDN_AS of k.D.k (a) and q.D.k (p), s <= tg
         * (remainders as x - q*d: a div/rem pair becomes an LLVM `freeze`, which Oclgrind rejects) */
        const int sh = lane / GDN_Q, tg = lane - sh * GDN_Q, s0 = sh * GDN_AS;
        real a[GDN_AS], p[GDN_AS];
        PRAGMA_UNROLL
        for (int j = 0; j < GDN_AS; ++j)
            a[j] = p[j] = (real)0;
        for (i64 i0 = 0; i0 < (steps > 0 ? K : 0); i0 += GDN_NT) {
            BARRIER(); /* G, beta and the norms are written (first tile), or the previous tile's readers are done */
            gdn_stage_gram_slice(kt, qt, gt, q, k, gam, t0 * H + kh, H, K, i0, rqs, rks, per_channel, steps, lane);
            BARRIER();
            gdn_gram_fma_slice(a, p, kt, qt, gt, tg, s0, per_channel);
        }
        gdn_gram_fma_store(pm, m, a, p, bs, gam, tg, s0, per_channel, steps);
    }
#endif
    BARRIER();
    /* T = (I + M)^-1 over M's strict lower triangle, row by row (row t needs rows < t):
     * T[t][l] = -(M[t][l] + sum_{l<s<t} M[t][s] T[s][l]); the unit diagonal stays implicit */
    for (int t = 1; t < steps; ++t) {
        real x = (real)0;
        if (lane < t) {
            x = m[t * GDN_QP + lane];
            for (int s = lane + 1; s < t; ++s)
                x += m[t * GDN_QP + s] * m[s * GDN_QP + lane];
        }
        BARRIER(); /* row t of M read by every lane before any of it is replaced */
        if (lane < t)
            m[t * GDN_QP + lane] = -x;
        BARRIER();
    }
    /* W = T beta exp(G) K (pass 0, K columns) and U0 = T beta V (pass 1, V columns), GDN_NT columns at a
     * time through kt (zero past the chunk's steps, which MMA tiles cover) */
#if RLX_MMA == 1
    gdn_stage_t(tl, m, steps, lane);
#endif
    for (int pass = 0; pass < 2; ++pass) {
        const i64 width = steps == 0 ? 0 : pass ? V : K;
        for (i64 i0 = 0; i0 < width; i0 += GDN_NT) {
            BARRIER();
            for (int e = lane; e < GDN_Q * GDN_NT; e += GDN_LANES) {
                const int s = e / GDN_NT, ii = e - s * GDN_NT;
                real x = (real)0;
                if (s < steps && i0 + ii < width) {
                    const i64 tok = t0 + s;
                    x = bs[s] * (pass ? LOAD(v, (tok * HV + vh) * V + i0 + ii)
                                      : LOAD(k, (tok * H + kh) * K + i0 + ii) * rks[s]
                                            * rlx_exp(gam[s * gw + (per_channel ? i0 + ii : 0)]));
                }
                kt[s * GDN_NTP + ii] = x;
#ifdef RLX_MMA
                xs[e] = TO_MMA(x);
#endif
            }
            BARRIER();
#ifdef RLX_MMA
            gdn_wu_tiles_barrier(pass ? um : wm, width, i0, tl, m, kt, xs, yl, steps, lane);
#else
            for (int e = lane; e < steps * GDN_NT; e += GDN_LANES) {
                const int t = e / GDN_NT, ii = e - t * GDN_NT;
                if (i0 + ii < width) {
                    real x = kt[t * GDN_NTP + ii];
                    for (int s = 0; s < t; ++s)
                        x += m[t * GDN_QP + s] * kt[s * GDN_NTP + ii];
                    (pass ? um : wm)[t * width + i0 + ii] = x;
                }
            }
#endif
        }
    }
}

#ifdef RLX_MMA
/* The MMA variant of the state pass: a work-group per (row, value head, 16 value columns) keeps the block's
 * state, every key row, f32 in LOCAL memory, and per chunk takes U = U0 - W S0 (the warps w < GDN_Q/16, a
 * 16-step tile each, over K in slices of 16) and the state update S = exp(G[last]) S + sum_t kd[t] (x) u[t]
 * (a 16-row tile per warp, GDN_KDW rows of kd staged at a time) on the tensor cores; W, S0, kd and U round
 * to the operand type (as fla's chunk kernels round them), the state accumulates in f32. */
#define GDN_KDW (RLX_MMA == 2 ? 64 : 128) /* key rows of kd staged at a time (LOCAL: 16 KiB either way) */
/* groups per SM the pass is bounded to: two (their LOCAL tiles allow no more), so 128 registers, which bf16's
 * conversions would pass when left free */
#define GDN_PASS_GROUPS 2
#if GDN_Q % 16 != 0 || GDN_LANES / 32 < GDN_Q / 16 || GDN_KDW / 16 > GDN_LANES / 32
#error "the MMA variant of gated_delta_net_state_pass: a 16-step tile per warp, a kd tile per warp"
#endif
/* One chunk's scratch as the MMA state pass reads it: the cumulative log-decays, W, and U0 (U once done)
 * and the entering state from the block's first column. */
typedef struct {
    GLOBAL const real* gam;
    GLOBAL const real* wm;
    GLOBAL real* um;
    GLOBAL real* states;
} gdn_walk_chunk;

/* U = U0 - W S0 for the block's columns (cols of them in range; rows V apart in scratch): in place in
 * scratch, and as operands in ul (zero past the chunk's steps); kd holds W's slices on the way. */
INLINE_FN void gdn_walk_u_barrier(gdn_walk_chunk at, LOCAL_PTR const mma_t* s16, LOCAL_PTR mma_t* kd,
                                  LOCAL_PTR float* uf, LOCAL_PTR mma_t* ul, i64 K, i64 V, i64 cols, int steps,
                                  int lane)
{
    const int w = MMA_WARP(lane);
    mma_acc u;
    mma_zero(&u);
    for (i64 i0 = 0; i0 < K; i0 += 16) {
        BARRIER(); /* s16 is written, or the previous slice's readers are done */
        for (int e = lane; e < GDN_Q * 16; e += GDN_LANES) {
            const int t = e / 16, ii = e - t * 16;
            kd[e] = TO_MMA(t < steps && i0 + ii < K ? at.wm[t * K + i0 + ii] : (real)0);
        }
        BARRIER();
        if (w < GDN_Q / 16)
            mma_tile(&u, MMA_ROW, kd + w * 256, 16, MMA_ROW, s16 + i0 * 16, 16);
    }
    if (w < GDN_Q / 16)
        mma_store(uf + w * 256, &u, 16);
    BARRIER();
    for (int e = lane; e < GDN_Q * 16; e += GDN_LANES) {
        const int t = e / 16, jj = e - t * 16;
        real x = (real)0;
        if (t < steps && jj < cols) {
            x = at.um[t * V + jj] - uf[e];
            at.um[t * V + jj] = x;
        }
        ul[e] = TO_MMA(x);
    }
}

/* S = exp(G[last]) S + sum_t kd[t] (x) u[t] with kd[t][i] = exp(G[last][i] - G[t][i]) k[t][i] (over |k| with
 * norm), step t's key row at k + (key0 + t*H) * K: the lanes scale sf, then GDN_KDW key rows of kd at a time
 * are staged and each warp adds its 16-row tile's sum over the steps to its accumulator, loaded from sf and
 * stored back. The caller's next barrier orders sf for its readers. */
INLINE_FN void gdn_walk_state_barrier(gdn_walk_chunk at, LOCAL_PTR float* sf, LOCAL_PTR mma_t* kd,
                                      LOCAL_PTR const mma_t* ul, GLOBAL const store_t* k, GLOBAL const real* nrm,
                                      int norm, i64 key0, i64 H, i64 gw, int per_channel, i64 K, int steps, int lane)
{
    const int w = MMA_WARP(lane);
    GLOBAL const real* last = at.gam + (steps - 1) * gw;
    for (i64 e = lane; e < K * 16; e += GDN_LANES) /* sf's last reader was W S0, before ul's barrier */
        sf[e] *= rlx_exp(last[per_channel ? e / 16 : 0]);
    for (i64 i0 = 0; i0 < K; i0 += GDN_KDW) {
        BARRIER(); /* sf scaled and ul written, or the previous rows' readers are done */
        for (int e = lane; e < GDN_Q * GDN_KDW; e += GDN_LANES) {
            const int t = e / GDN_KDW, ii = e - t * GDN_KDW;
            const i64 i = i0 + ii, key = key0 + t * H, g = per_channel ? i : 0;
            kd[e] = TO_MMA(t < steps && i < K ? rlx_exp(last[g] - at.gam[t * gw + g]) * LOAD(k, key * K + i)
                                                    * (norm ? nrm[2 * key + 1] : (real)1) : (real)0);
        }
        BARRIER();
        if (w < GDN_KDW / 16 && i0 + w * 16 < K) {
            mma_acc s;
            mma_load(&s, sf + (i0 + w * 16) * 16, 16);
            for (int s0 = 0; s0 < steps; s0 += 16)
                mma_tile(&s, MMA_COL, kd + s0 * GDN_KDW + w * 16, GDN_KDW, MMA_ROW, ul + s0 * 16, 16);
            mma_store(sf + (i0 + w * 16) * 16, &s, 16);
        }
    }
}
#endif

#ifndef GDN_PASS_GROUPS
#define GDN_PASS_GROUPS 1 /* the portable pass: bounded by its lanes alone */
#endif
/* Key rows of the state per work-group lane and value columns per work-group of the state pass:
 * GDN_LANES / K strips of GDN_PJ columns (at most GDN_SPMAX strips), one lane per (key row, strip). */
#define GDN_STRIPS(K) (GDN_LANES / (K) < GDN_SPMAX ? GDN_LANES / (K) : GDN_SPMAX)

KERNEL_BOUNDED(GDN_LANES, GDN_PASS_GROUPS) gated_delta_net_state_pass(i64 R, i64 S, i64 H, i64 HV, i64 K, i64 V,
    i64 NC, int per_channel, int qk_norm, int varlen, GLOBAL uchar* cb, i64 co, int carry, int state_real,
    int slotted, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* sb, i64 so, GLOBAL uchar* slb, i64 slo, GLOBAL uchar* nb,
    i64 no, GLOBAL uchar* gmb, i64 gmo, GLOBAL uchar* wb, i64 wo, GLOBAL uchar* ub, i64 uo, GLOBAL uchar* hb,
    i64 ho)
{
#ifdef RLX_MMA
    const i64 rc = 16; /* the MMA variant's block: one tile of 16 columns, every key row */
#else
    LOCAL real sl[GDN_LANES * GDN_PJ], ul[GDN_Q * GDN_PJ * GDN_SPMAX];
    const i64 strips = GDN_STRIPS(K), rc = strips * GDN_PJ;
#endif
    const int lane = (int)LID(0);
    const i64 blocks = (V + rc - 1) / rc, bh = GROUP(0) / blocks, jc0 = (GROUP(0) - bh * blocks) * rc;
    const i64 r = bh / HV, vh = bh - r * HV, kh = vh / (HV / H);
    const i64 gw = per_channel ? K : 1;
    const int st_real = GDN_V2 && state_real;
    GLOBAL const int* cu = GDN_V2 && varlen ? AT(int, cb, co) : 0;
    i64 slot0 = 0;
    const i64 chunks = gdn_row_chunks(r, S, cu, &slot0), first = gdn_row_start(r, S, cu), end = gdn_row_end(r, S, cu);
    /* an empty sequence (no chunks) keeps its state as it is: no store, every barrier met */
    GLOBAL const store_t* k = AT(store_t, kb, ko);
    GLOBAL const real* nrm = AT(real, nb, no);
    GLOBAL const int* slots = GDN_V2 && slotted ? AT(int, slb, slo) : 0;
    const i64 entry = (gdn_state_row(r, slots) * HV + vh) * K * V;
    GLOBAL uchar* st = st_real ? (GLOBAL uchar*)(AT(real, sb, so) + entry) : (GLOBAL uchar*)(AT(store_t, sb, so) + entry);
#ifdef RLX_MMA
    MMA_LOCAL float sf[STATE_MAX * 16], uf[GDN_Q * 16];
    MMA_LOCAL mma_t kd[GDN_Q * GDN_KDW];
#if RLX_MMA == 2
    LOCAL_PTR float* const s16 = sf; /* TF32 operands are f32: the state where it lies */
    LOCAL_PTR float* const ul = uf;
#else
    MMA_LOCAL mma_t s16[STATE_MAX * 16], ul[GDN_Q * 16];
#endif
    const i64 k16 = (K + 15) / 16 * 16; /* key rows in whole tiles, those past K zero */
    for (i64 e = lane; e < k16 * 16; e += GDN_LANES) {
        const i64 i = e / 16, jj = e - i * 16;
        sf[e] = carry && i < K && jc0 + jj < V ? load_any(st, i * V + jc0 + jj, st_real) : (real)0;
    }
    for (i64 c = 0; c < chunks; ++c) {
        const i64 bhc = vh * NC + slot0 + c, t0 = first + c * GDN_Q;
        const int steps = end - t0 < GDN_Q ? (int)(end - t0) : GDN_Q;
        const gdn_walk_chunk at = {AT(real, gmb, gmo) + bhc * GDN_Q * gw, AT(real, wb, wo) + bhc * GDN_Q * K,
                                   AT(real, ub, uo) + bhc * GDN_Q * V + jc0, AT(real, hb, ho) + bhc * K * V + jc0};
        BARRIER(); /* the state is complete: carried in, or the previous chunk's */
        for (i64 e = lane; e < k16 * 16; e += GDN_LANES) {
            const i64 i = e / 16, jj = e - i * 16;
            if (i < K && jc0 + jj < V)
                at.states[i * V + jj] = sf[e]; /* the state entering chunk c, for chunk_out */
#if RLX_MMA == 1
            s16[e] = TO_MMA(sf[e]);
#endif
        }
        gdn_walk_u_barrier(at, s16, kd, uf, ul, K, V, V - jc0, steps, lane);
        gdn_walk_state_barrier(at, sf, kd, ul, k, nrm, GDN_V2 && qk_norm, t0 * H + kh, H, gw, per_channel, K, steps,
                               lane);
    }
    BARRIER();
    for (i64 e = lane; e < (carry && chunks > 0 ? K * 16 : 0); e += GDN_LANES) {
        const i64 i = e / 16, jj = e - i * 16;
        if (jc0 + jj < V)
            store_any(st, i * V + jc0 + jj, st_real, sf[e]);
    }
#else
    const i64 jb = lane / K, i = lane - jb * K;
    const int live = jb < strips; /* a lane past the last strip still meets every barrier */
    real s[GDN_PJ];
    PRAGMA_UNROLL
    for (int cj = 0; cj < GDN_PJ; ++cj) {
        const i64 j = jc0 + jb * GDN_PJ + cj;
        s[cj] = carry && live && j < V ? load_any(st, i * V + j, st_real) : (real)0;
    }
    for (i64 c = 0; c < chunks; ++c) {
        const i64 bhc = vh * NC + slot0 + c, t0 = first + c * GDN_Q;
        const int steps = end - t0 < GDN_Q ? (int)(end - t0) : GDN_Q;
        GLOBAL const real* gam = AT(real, gmb, gmo) + bhc * GDN_Q * gw;
        GLOBAL const real* wm = AT(real, wb, wo) + bhc * GDN_Q * K;
        GLOBAL real* um = AT(real, ub, uo) + bhc * GDN_Q * V;
        GLOBAL real* states = AT(real, hb, ho) + bhc * K * V;
        BARRIER(); /* the previous chunk's readers of sl and ul are done */
        PRAGMA_UNROLL
        for (int cj = 0; cj < GDN_PJ; ++cj) {
            const i64 j = jc0 + jb * GDN_PJ + cj;
            if (live && j < V) {
                states[i * V + j] = s[cj]; /* the state entering chunk c, for chunk_out */
                sl[i * rc + jb * GDN_PJ + cj] = s[cj];
            }
        }
        BARRIER();
        /* U = U0 - W S0 over the block's columns, in place in scratch and into ul */
        for (i64 e = lane; e < steps * rc; e += GDN_LANES) {
            const i64 t = e / rc, jj = e - t * rc;
            if (jc0 + jj < V) {
                real x = um[t * V + jc0 + jj];
                for (i64 r = 0; r < K; ++r)
                    x -= wm[t * K + r] * sl[r * rc + jj];
                um[t * V + jc0 + jj] = x;
                ul[t * rc + jj] = x;
            }
        }
        BARRIER();
        if (live) {
            const real last = gam[(steps - 1) * gw + (per_channel ? i : 0)], through = rlx_exp(last);
            PRAGMA_UNROLL
            for (int cj = 0; cj < GDN_PJ; ++cj)
                s[cj] *= through;
            for (int t = 0; t < steps; ++t) {
                const i64 key = (t0 + t) * H + kh;
                const real rk = GDN_V2 && qk_norm ? nrm[2 * key + 1] : (real)1;
                const real kd = rlx_exp(last - gam[t * gw + (per_channel ? i : 0)]) * LOAD(k, key * K + i) * rk;
                PRAGMA_UNROLL
                for (int cj = 0; cj < GDN_PJ; ++cj)
                    if (jc0 + jb * GDN_PJ + cj < V)
                        s[cj] += kd * ul[t * rc + jb * GDN_PJ + cj];
            }
        }
    }
    if (carry && live && chunks > 0)
        PRAGMA_UNROLL
        for (int cj = 0; cj < GDN_PJ; ++cj) {
            const i64 j = jc0 + jb * GDN_PJ + cj;
            if (j < V)
                store_any(st, i * V + j, st_real, s[cj]);
        }
#endif
}

#ifdef RLX_MMA
#if GDN_NT != 16 || GDN_Q % 16 != 0 || GDN_OT % 16 != 0 || GDN_LANES / 32 != (GDN_Q / 16) * (GDN_OT / 16)
#error "the MMA variant of gated_delta_net_chunk_out tiles 16x16, one output tile per warp"
#endif
/* Where gated_delta_net_chunk_out's outputs go: step t's column jc (jc < cols) at at + t * stride + jc. */
typedef struct {
    GLOBAL store_t* dst;
    i64 at, stride, cols;
    real scale;
} gdn_out_tile;

/* gated_delta_net_chunk_out's LOCAL tiles of the MMA variant, declared in the kernel (OpenCL wants them
 * there): qs [GDN_Q][16] and hs [16][GDN_OT], slices of the scaled q and of S0; pl [GDN_Q][GDN_Q], P's
 * operands below the diagonal; ul [GDN_Q][GDN_OT], U; pd [GDN_Q][16] f32, P's diagonal tiles; yl
 * [GDN_Q][GDN_OT] f32, the output tile. */
typedef struct {
    LOCAL_PTR mma_t* qs;
    LOCAL_PTR mma_t* hs;
    LOCAL_PTR mma_t* pl;
    LOCAL_PTR mma_t* ul;
    LOCAL_PTR float* pd;
    LOCAL_PTR float* yl;
} gdn_out_local;

/* out[t] = scale ((exp(G[t]) q[t]) S0 + sum_{s<=t} P[t][s] u[s]) over the tile's GDN_OT columns on the
 * tensor cores (kernels_cuda/prelude.cuh): warp w owns the output tile (w / (GDN_OT/16), w % (GDN_OT/16));
 * the q.S0 product runs over K in slices of 16 (qs: the chunk's scaled q rows, the group's staging of
 * the portable path); P's tiles below the diagonal and U are operands, P's diagonal tiles stay f32 for a
 * per-lane sum bounded by t, so that, as on the portable path, nothing at a step s > t (not even a NaN)
 * reaches out[t]. P, U and the state round to the operand type (as fla rounds them to the input type). */
INLINE_FN void gdn_out_product_barrier(gdn_out_tile out, gdn_out_local at, GLOBAL const store_t* q,
                                       GLOBAL const real* nrm, int qk_norm, GLOBAL const real* gam, i64 gw,
                                       int per_channel, i64 t0, i64 H, i64 kh, i64 K, i64 V, GLOBAL const real* states,
                                       GLOBAL const real* pm, GLOBAL const real* um, int steps, int lane)
{
    LOCAL_PTR mma_t* const qs = at.qs;
    LOCAL_PTR mma_t* const hs = at.hs;
    LOCAL_PTR mma_t* const pl = at.pl;
    LOCAL_PTR mma_t* const ul = at.ul;
    LOCAL_PTR float* const pd = at.pd;
    LOCAL_PTR float* const yl = at.yl;
    const int w = MMA_WARP(lane), ti = w / (GDN_OT / 16), tj = w - ti * (GDN_OT / 16);
    mma_acc y;
    mma_zero(&y);
    for (i64 i0 = 0; i0 < (steps > 0 ? K : 0); i0 += 16) {
        BARRIER(); /* the previous slice's readers are done */
        for (int e = lane; e < GDN_Q * 16; e += GDN_LANES) {
            const int t = e / 16, ii = e - t * 16;
            const i64 i = i0 + ii, key = (t0 + t) * H + kh;
            qs[e] = TO_MMA(t < steps && i < K ? LOAD(q, key * K + i) * (GDN_V2 && qk_norm ? nrm[2 * key] : (real)1)
                                                    * rlx_exp(gam[t * gw + (per_channel ? i : 0)]) : (real)0);
        }
        for (int e = lane; e < 16 * GDN_OT; e += GDN_LANES) {
            const int ii = e / GDN_OT, jc = e - ii * GDN_OT;
            hs[e] = TO_MMA(i0 + ii < K && jc < out.cols ? states[(i0 + ii) * V + jc] : (real)0);
        }
        BARRIER();
        mma_tile(&y, MMA_ROW, qs + ti * 16 * 16, 16, MMA_ROW, hs + tj * 16, GDN_OT);
    }
    for (int e = lane; e < GDN_Q * GDN_Q; e += GDN_LANES) { /* P: the tiles below the diagonal, the diagonal's */
        const int t = e / GDN_Q, s = e - t * GDN_Q;
        const real v = s <= t && t < steps ? pm[e] : (real)0;
        if (s / 16 == t / 16)
            pd[t * 16 + s % 16] = v;
        else if (s / 16 < t / 16)
            pl[e] = TO_MMA(v);
    }
    for (int e = lane; e < GDN_Q * GDN_OT; e += GDN_LANES) {
        const int t = e / GDN_OT, jc = e - t * GDN_OT;
        ul[e] = TO_MMA(t < steps && jc < out.cols ? um[t * V + jc] : (real)0);
    }
    BARRIER();
    for (int sj = 0; sj < ti; ++sj)
        mma_tile(&y, MMA_ROW, pl + ti * 16 * GDN_Q + sj * 16, GDN_Q, MMA_ROW, ul + sj * 16 * GDN_OT + tj * 16, GDN_OT);
    mma_store(yl + ti * 16 * GDN_OT + tj * 16, &y, GDN_OT);
    BARRIER();
    for (int e = lane; e < GDN_Q * GDN_OT; e += GDN_LANES) {
        const int t = e / GDN_OT, jc = e - t * GDN_OT;
        if (t < steps && jc < out.cols) {
            real x = yl[e];
            for (int s = t / 16 * 16; s <= t; ++s)
                x += pd[t * 16 + s % 16] * FROM_MMA(ul[s * GDN_OT + jc]);
            STORE(out.dst, out.at + t * out.stride + jc, out.scale * x);
        }
    }
}
#endif

KERNEL gated_delta_net_chunk_out(i64 R, i64 S, i64 H, i64 HV, i64 K, i64 V, i64 NC, int per_channel, int qk_norm,
                                 int varlen, GLOBAL uchar* cb, i64 co, real scale,
                                 GLOBAL uchar* qb, i64 qo, GLOBAL uchar* db, i64 dof, GLOBAL uchar* nb, i64 no,
                                 GLOBAL uchar* gmb, i64 gmo, GLOBAL uchar* pb, i64 po, GLOBAL uchar* ub, i64 uo,
                                 GLOBAL uchar* hb, i64 ho)
{
    const i64 tiles = (V + GDN_OT - 1) / GDN_OT, j0 = (GROUP(0) - GROUP(0) / tiles * tiles) * GDN_OT;
    const int lane = (int)LID(0);
    GLOBAL const int* cu = GDN_V2 && varlen ? AT(int, cb, co) : 0;
    /* no steps: empty loops to every barrier, as in gated_delta_net_chunk_prep */
    const gdn_chunk_slot chunk = gdn_chunk_slot_of(GROUP(0) / tiles, R, S, H, HV, NC, cu);
    const i64 bhc = chunk.bhc, vh = chunk.vh, kh = chunk.kh, t0 = chunk.t0;
    const i64 gw = per_channel ? K : 1; /* log-decays per step: one per key channel, or one */
    const int steps = chunk.steps;
    GLOBAL real* gam = AT(real, gmb, gmo) + bhc * GDN_Q * gw;
    GLOBAL const store_t* q = AT(store_t, qb, qo);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    GLOBAL const real* pm = AT(real, pb, po) + bhc * GDN_Q * GDN_Q;
    GLOBAL const real* um = AT(real, ub, uo) + bhc * GDN_Q * V;
    GLOBAL const real* states = AT(real, hb, ho) + bhc * K * V;
    GLOBAL const real* nrm = AT(real, nb, no);
#ifdef RLX_MMA
    MMA_LOCAL mma_t qs[GDN_Q * 16], hs[16 * GDN_OT], pl[GDN_Q * GDN_Q], ul[GDN_Q * GDN_OT];
    MMA_LOCAL float pd[GDN_Q * 16], yl[GDN_Q * GDN_OT];
    const gdn_out_local at = {qs, hs, pl, ul, pd, yl};
    const gdn_out_tile out = {dst, (t0 * HV + vh) * V + j0, HV * V, V - j0, scale};
    gdn_out_product_barrier(out, at, q, nrm, qk_norm, gam, gw, per_channel, t0, H, kh, K, V, states + j0, pm, um + j0,
                            steps, lane);
#else
    LOCAL real qt[GDN_Q * GDN_NTP], hl[GDN_NT * GDN_OTP], pl[GDN_Q * GDN_QP], ul[GDN_Q * GDN_OTP];
    const int ty = lane / GDN_OT, jj = lane - ty * GDN_OT; /* this lane: column j0+jj, steps ty + r*GDN_TS */
    real y[GDN_OY];
    PRAGMA_UNROLL
    for (int r = 0; r < GDN_OY; ++r)
        y[r] = (real)0;
    /* (exp(G[t]) q[t]) S0 */
    for (i64 i0 = 0; i0 < (steps > 0 ? K : 0); i0 += GDN_NT) {
        BARRIER(); /* the previous tile's readers are done */
        for (int e = lane; e < GDN_Q * GDN_NT; e += GDN_LANES) {
            const int t = e / GDN_NT, ii = e - t * GDN_NT;
            const i64 i = i0 + ii, key = (t0 + t) * H + kh;
            qt[t * GDN_NTP + ii] = t < steps && i < K
                ? LOAD(q, key * K + i) * (GDN_V2 && qk_norm ? nrm[2 * key] : (real)1)
                      * rlx_exp(gam[t * gw + (per_channel ? i : 0)]) : (real)0;
        }
        for (int e = lane; e < GDN_NT * GDN_OT; e += GDN_LANES) {
            const int ii = e / GDN_OT, jc = e - ii * GDN_OT;
            hl[ii * GDN_OTP + jc] = i0 + ii < K && j0 + jc < V ? states[(i0 + ii) * V + j0 + jc] : (real)0;
        }
        BARRIER();
        for (int ii = 0; ii < GDN_NT; ++ii) {
            const real hv = hl[ii * GDN_OTP + jj];
            PRAGMA_UNROLL
            for (int r = 0; r < GDN_OY; ++r)
                y[r] += qt[(ty + r * GDN_TS) * GDN_NTP + ii] * hv;
        }
    }
    /* + sum_{s<=t} P[t][s] u[s]: P's lower triangle and the chunk's U columns through LOCAL */
    for (int e = lane; e < GDN_Q * GDN_Q; e += GDN_LANES) {
        const int t = e / GDN_Q, s = e - t * GDN_Q;
        if (s <= t && t < steps)
            pl[t * GDN_QP + s] = pm[e];
    }
    for (int e = lane; e < GDN_Q * GDN_OT; e += GDN_LANES) {
        const int t = e / GDN_OT, jc = e - t * GDN_OT;
        if (t < steps && j0 + jc < V)
            ul[t * GDN_OTP + jc] = um[t * V + j0 + jc];
    }
    BARRIER();
    PRAGMA_UNROLL
    for (int r = 0; r < GDN_OY; ++r) {
        const int t = ty + r * GDN_TS;
        if (t < steps && j0 + jj < V) {
            real x = y[r];
            for (int s = 0; s <= t; ++s)
                x += pl[t * GDN_QP + s] * ul[s * GDN_OTP + jj];
            STORE(dst, ((t0 + t) * HV + vh) * V + j0 + jj, scale * x);
        }
    }
#endif
}
#endif

/* The saved forward (ABI.md §9.1, docs/abi.md 6a.1), every target: a forward given a reserve runs these three
 * before its own launches (gdn_reserve_walk reads the initial state, which the forward replaces with
 * carry_state). Chunks of GDN_RC tokens per batch row b (no packed sequences), the last one padded with
 * tokens of zero inputs; per value head vh (key head vh / (HV / H)), q and k times their 1/|.| with qk_norm
 * (nrm, from gdn_qk_norm); every array in the compute type `real` (the reserve's type C: a device's state is
 * kept in the thunk's dtype or its compute type, so C is f64 exactly when real is), C-ordered:
 *   states [B][NR][HV][K][V]   the state leaving each chunk, the last the final state;
 *   qk, kk [B][NR][HV][32][32] the chunk's decayed products q_r . k_s (s <= r), k_r . k_s (s < r), before scale;
 *   inverse [B][NR][HV][32][32] (I + diag(beta) kk)^-1, unit lower triangular;
 *   u [B][NR][HV][32][V]       what each token adds to the state (0 past the sequence).
 * NR = ceil(S / GDN_RC). The host writes the same numbers (host_fallback/gdn_chunked.py), by GEMMs. */

#ifdef RLX_TARGET_GPU /* the cpu target's walk records the states and u itself (GDN_RESERVE) */
/* Column j of the state of (batch row b, value head vh) walked token by token in place in the reserve: each
 * chunk's column starts as a copy of the previous one's (the initial state, or zeros, for the first) and steps
 * through the chunk's tokens, writing each token's u. One work-item per (b, vh, j), j fastest; no private
 * array (the column lives in the reserve, in cache). */
KERNEL gdn_reserve_walk(i64 B, i64 S, i64 H, i64 HV, i64 K, i64 V, int carry, int per_channel, int state_real,
                        int slotted, int qk_norm, GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko,
                        GLOBAL uchar* vb, i64 vo, GLOBAL uchar* gb, i64 go, GLOBAL uchar* beb, i64 beo,
                        GLOBAL uchar* sb, i64 so, GLOBAL uchar* slb, i64 slo, GLOBAL uchar* nb, i64 no,
                        GLOBAL uchar* hb, i64 ho, GLOBAL uchar* ub, i64 uo)
{
    const i64 item = GID(0);
    if (item >= B * HV * V)
        return;
    /* remainders as x - q*d, not %: LLVM turns a div/rem pair into a `freeze`, which Oclgrind rejects */
    const i64 bh = item / V, j = item - bh * V, b = bh / HV, vh = bh - b * HV, kh = vh / (HV / H);
    const i64 chunks = (S + GDN_RC - 1) / GDN_RC;
    const gdn_tensors io = gdn_tensors_of(qb, qo, kb, ko, vb, vo, gb, go, beb, beo);
    GLOBAL const real* nrm = AT(real, nb, no);
    GLOBAL const int* slots = GDN_V2 && slotted ? AT(int, slb, slo) : 0;
    const int st_real = GDN_V2 && state_real;
    const i64 entry = (gdn_state_row(b, slots) * HV + vh) * K * V + j;
    GLOBAL const uchar* st = st_real ? (GLOBAL const uchar*)(AT(real, sb, so) + entry)
                                     : (GLOBAL const uchar*)(AT(store_t, sb, so) + entry);
    for (i64 c = 0; c < chunks; ++c) {
        GLOBAL real* s = AT(real, hb, ho) + ((b * chunks + c) * HV + vh) * K * V + j;
        GLOBAL real* u = AT(real, ub, uo) + ((b * chunks + c) * HV + vh) * GDN_RC * V + j;
        for (i64 i = 0; i < K; ++i)
            s[i * V] = c ? s[i * V - HV * K * V] : carry ? load_any(st, i * V, st_real) : (real)0;
        for (int r = 0; r < GDN_RC; ++r) {
            const i64 t = c * GDN_RC + r, tok = b * S + t, head = tok * HV + vh, key = (tok * H + kh) * K;
            if (t >= S) {
                u[r * V] = (real)0;
                continue;
            }
            const real rk = GDN_V2 && qk_norm ? nrm[2 * (tok * H + kh) + 1] : (real)1;
            const real decay = per_channel ? (real)1 : exp(LOAD(io.g, head));
            real a = (real)0;
            for (i64 i = 0; i < K; ++i)
                a += (per_channel ? exp(LOAD(io.g, head * K + i)) : decay) * s[i * V] * LOAD(io.k, key + i);
            const real x = (LOAD(io.v, head * V + j) - rk * a) * LOAD(io.beta, head);
            for (i64 i = 0; i < K; ++i)
                s[i * V] = (per_channel ? exp(LOAD(io.g, head * K + i)) : decay) * s[i * V] + rk * LOAD(io.k, key + i) * x;
            u[r * V] = x;
        }
    }
}
#endif

/* The log-decay of token t of row b, head vh (key channel i with per_channel) as the reserve's products take
 * it: 0 past the sequence, and raised to the log of the compute type's smallest subnormal minus 1 (a -inf, a
 * state reset, would meet another in a difference of cumulative sums: NaN; exp of either is 0). */
INLINE_FN real gdn_reserve_log_decay(GLOBAL const store_t* gate, i64 b, i64 S, i64 t, i64 HV, i64 vh, i64 K, i64 i,
                                     int per_channel)
{
    if (t >= S)
        return (real)0;
    const i64 head = (b * S + t) * HV + vh;
    const real g = LOAD(gate, per_channel ? head * K + i : head), low = sizeof(real) == 4 ? (real)-104.2789 : (real)-745.1332;
    return g < low ? low : g;
}

#define GDN_RCN 16 /* key channels of the reserve's products staged at a time */
#define GDN_RCNP (GDN_RCN + 1)
#define GDN_RC_MID (GDN_RC / 2 - 1) /* the chunk's middle token, the per-channel decays' reference */
#define GDN_RC_SPREAD 30 /* the largest |cum_t - cum_mid| a channel's products factor through (as the host) */

/* Row r of chunk c of (batch row b, value head vh): qk[r][s] = sum_i q_r[i] k_s[i] exp(cum_r[i] - cum_s[i])
 * (s <= r) and kk[r][s] the same of k_r (s < r), zeros elsewhere and for tokens past the sequence; q and k times
 * their 1/|.| with qk_norm. One work-group of GDN_RC work-items per (b, c, vh), r its local id; GDN_RCN key
 * channels staged in LOCAL at a time, each row summing its entries over them into the reserve (in cache).
 * Per-channel gates: the decay factors through the cumulative log-decay at the chunk's middle token m,
 * exp(cum_r - cum_s) = exp(cum_r - cum_m) exp(cum_m - cum_s), so that each token weighs its q, k (a row) and k
 * (a column) with one exp each and the products are one GEMM, as the host forms them (host_fallback/gdn_grams.py);
 * a channel where some |cum_t - cum_m| of the chunk passes GDN_RC_SPREAD (a gate of -inf, strongly negative or
 * positive ones, NaN), where a factor could overflow or lose the product to underflow, is summed pair by pair
 * instead, its decay formed walking s down from r (the branch is uniform across the group). One gate per head:
 * the GEMM of q, k unweighed, each entry decayed after. */
KERNEL gdn_reserve_grams(i64 B, i64 S, i64 H, i64 HV, i64 K, int per_channel, int qk_norm, GLOBAL uchar* qb, i64 qo,
                         GLOBAL uchar* kb, i64 ko, GLOBAL uchar* gb, i64 go, GLOBAL uchar* nb, i64 no,
                         GLOBAL uchar* pb, i64 po, GLOBAL uchar* mb, i64 mo)
{
    /* per staged channel ii and token t: q and k (normed), k weighed as a column, the log-decay */
    LOCAL real qs[GDN_RC * GDN_RCNP], ks[GDN_RC * GDN_RCNP], kc[GDN_RC * GDN_RCNP], ls[GDN_RC * GDN_RCNP];
    LOCAL int fits[GDN_RC]; /* per token, a bit per staged channel: its |cum_t - cum_m| within GDN_RC_SPREAD */
    const i64 chunks = (S + GDN_RC - 1) / GDN_RC, item = GID(0), slot = item / GDN_RC; /* whole groups */
    const int r = (int)(item - slot * GDN_RC);
    const i64 bc = slot / HV, vh = slot - bc * HV, b = bc / chunks, c = bc - b * chunks, kh = vh / (HV / H);
    const i64 t0 = c * GDN_RC, tr = b * S + t0 + r;
    const int live = t0 + r < S;
    GLOBAL const store_t* q = AT(store_t, qb, qo) + (tr * H + kh) * K;
    GLOBAL const store_t* k = AT(store_t, kb, ko) + (tr * H + kh) * K;
    GLOBAL const store_t* gate = AT(store_t, gb, go);
    GLOBAL const real* nrm = AT(real, nb, no);
    GLOBAL real* qk = AT(real, pb, po) + item * GDN_RC;
    GLOBAL real* kk = AT(real, mb, mo) + item * GDN_RC;
    const real rq = GDN_V2 && qk_norm && live ? nrm[2 * (tr * H + kh)] : (real)1;
    const real rk = GDN_V2 && qk_norm && live ? nrm[2 * (tr * H + kh) + 1] : (real)1;
    for (int s = 0; s < GDN_RC; ++s)
        qk[s] = kk[s] = (real)0;
    for (i64 i0 = 0; i0 < K; i0 += GDN_RCN) {
        BARRIER(); /* the previous slice's readers are done */
        for (int ii = 0; ii < GDN_RCN; ++ii) {
            const int in = live && i0 + ii < K;
            qs[r * GDN_RCNP + ii] = in ? LOAD(q, i0 + ii) * rq : (real)0;
            ks[r * GDN_RCNP + ii] = in ? LOAD(k, i0 + ii) * rk : (real)0;
            ls[r * GDN_RCNP + ii] = per_channel && i0 + ii < K
                                        ? gdn_reserve_log_decay(gate, b, S, t0 + r, HV, vh, K, i0 + ii, 1) : (real)0;
        }
        BARRIER();
        /* this token's weights: exp(cum_r - cum_m) of its row operands (private), exp(cum_m - cum_r) of its column */
        real qa[GDN_RCN], ka[GDN_RCN];
        int mask = 0;
        PRAGMA_UNROLL
        for (int ii = 0; ii < GDN_RCN; ++ii) {
            real e = (real)0;
            for (int u = r + 1; per_channel && u <= GDN_RC_MID; ++u)
                e -= ls[u * GDN_RCNP + ii];
            for (int u = GDN_RC_MID + 1; per_channel && u <= r; ++u)
                e += ls[u * GDN_RCNP + ii];
            const real w = per_channel ? exp(e) : (real)1;
            qa[ii] = qs[r * GDN_RCNP + ii] * w;
            ka[ii] = ks[r * GDN_RCNP + ii] * w;
            kc[r * GDN_RCNP + ii] = ks[r * GDN_RCNP + ii] * (per_channel ? exp(-e) : (real)1);
            mask |= (fabs(e) <= (real)GDN_RC_SPREAD) << ii; /* NaN: not */
        }
        fits[r] = mask;
        BARRIER();
        int ok = (1 << GDN_RCN) - 1; /* the channels whose products are the GEMM's */
        for (int t = 0; t < GDN_RC; ++t)
            ok &= fits[t];
        PRAGMA_UNROLL
        for (int ii = 0; ii < GDN_RCN; ++ii)
            if (!(ok >> ii & 1)) { /* neither its column (maybe infinite) nor its row enters the GEMM */
                kc[r * GDN_RCNP + ii] = (real)0;
                qa[ii] = ka[ii] = (real)0;
            }
        BARRIER();
        for (int s = 0; live && s <= r; ++s) {
            real xq = (real)0, xk = (real)0;
            PRAGMA_UNROLL
            for (int ii = 0; ii < GDN_RCN; ++ii) {
                const real x = kc[s * GDN_RCNP + ii];
                xq += qa[ii] * x;
                xk += ka[ii] * x;
            }
            qk[s] += xq;
            kk[s] += s < r ? xk : (real)0;
        }
        for (int ii = 0; live && ok != (1 << GDN_RCN) - 1 && ii < GDN_RCN; ++ii)
            if (!(ok >> ii & 1)) {
                const real qi = qs[r * GDN_RCNP + ii], ki = ks[r * GDN_RCNP + ii];
                real diff = (real)0;
                for (int s = r; s >= 0; --s) {
                    const real x = ks[s * GDN_RCNP + ii] * exp(diff);
                    qk[s] += qi * x;
                    kk[s] += s < r ? ki * x : (real)0;
                    diff += ls[s * GDN_RCNP + ii];
                }
            }
    }
    if (per_channel || !live)
        return;
    real diff = (real)0;
    for (int s = r; s >= 0; --s) {
        const real e = exp(diff);
        qk[s] *= e;
        kk[s] *= e;
        diff += gdn_reserve_log_decay(gate, b, S, t0 + s, HV, vh, K, 0, 0);
    }
}

/* Column s of the unit lower triangular inverse T = (I + diag(beta) kk)^-1 of chunk c of (b, vh), by forward
 * substitution down the column: T[r][s] = -beta_r sum_{s <= m < r} kk[r][m] T[m][s] for r > s (beta 0 past
 * the sequence), the column read back from the reserve as it is written. One work-item per (b, c, vh, s). */
KERNEL gdn_reserve_inverse(i64 B, i64 S, i64 HV, GLOBAL uchar* beb, i64 beo, GLOBAL uchar* mb, i64 mo,
                           GLOBAL uchar* tb, i64 to)
{
    const i64 chunks = (S + GDN_RC - 1) / GDN_RC, item = GID(0);
    if (item >= B * chunks * HV * GDN_RC)
        return;
    const i64 slot = item / GDN_RC, s = item - slot * GDN_RC, bc = slot / HV, vh = slot - bc * HV;
    const i64 b = bc / chunks, t0 = (bc - b * chunks) * GDN_RC;
    GLOBAL const real* kk = AT(real, mb, mo) + slot * GDN_RC * GDN_RC;
    GLOBAL real* inv = AT(real, tb, to) + slot * GDN_RC * GDN_RC + s;
    GLOBAL const store_t* beta = AT(store_t, beb, beo);
    for (i64 r = 0; r < GDN_RC; ++r) {
        real x = r == s ? (real)1 : (real)0;
        if (r > s && t0 + r < S) {
            real acc = (real)0;
            for (i64 m = s; m < r; ++m)
                acc += kk[r * GDN_RC + m] * inv[m * GDN_RC];
            x = -LOAD(beta, (b * S + t0 + r) * HV + vh) * acc;
        }
        inv[r * GDN_RC] = x;
    }
}

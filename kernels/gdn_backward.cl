/* Backward of gated_delta_net (ABI.md §9), one text for both targets. kernels/ssm_fields.cl precedes
 * it: its rows (SSM_VARLEN), state slots (SSM_SLOTS), carried state (SSM_CARRY) and f32 state beside a
 * 16-bit thunk (SSM_STATE_F32) are this family's too; GDNB_GATE_K switches on gate_per_channel and
 * GDNB_NORM qk_l2norm.
 *
 * Column j of the state of one value head evolves on its own: with s = S[:, j] (K values),
 *   s1 = e * s (e = exp(g), or exp(g[i]) per key channel),  u = (v[j] - k.s1) * beta,
 *   s2 = s1 + k * u,  out[j] = scale * q.s2,
 * with q, k the step's (L2-normalised, with GDNB_NORM) vectors of the value head's key head. The
 * backward walks each column in reverse with its states recomputed from checkpoints every SSMB_Q
 * steps (the workspace of kernels/ssm_backward.cl's state rows, in the launch's scratch, nothing in
 * private arrays). Work-items: one per (row, key head, block of the key head's value heads); an item
 * walks its value heads' columns one after the other, so d_beta and d_g of a value head and the
 * item's partial of d_q and d_k (over its value heads and columns) are sums in one fixed order;
 * gdn_backward_qk sums the blocks' partials, in order, and takes the normalisation's derivative. With a
 * saved forward (ABI.md §9.1, kernels/gdn.cl's gdn_reserve_walk: the states leaving every chunk of 32 steps,
 * SSMB_Q's) the checkpoints are copied from it instead of walked. */

#ifndef GDNB_GATE_K
#define GDNB_GATE_K 0
#endif
#ifndef GDNB_NORM
#define GDNB_NORM 0
#endif

/* 1 / sqrt(sum v^2 + 1e-6) of the K values at p (ABI.md §8's qk_l2norm), or 1 without GDNB_NORM. */
INLINE_FN real gdnb_inv_norm(GLOBAL const store_t* p, i64 K)
{
    if (!GDNB_NORM)
        return (real)1;
    real sq = (real)0;
    for (i64 i = 0; i < K; ++i)
        sq += LOAD(p, i) * LOAD(p, i);
    return (real)1 / sqrt(sq + (real)1e-6);
}

/* One token of one column as the forward sees it: q and k rows of the key head with their norms'
 * factors, the gate row (one value or K), beta, v[j] and where the gradients go. */
typedef struct {
    GLOBAL const store_t* q;
    GLOBAL const store_t* k;
    GLOBAL const store_t* g;
    real qf, kf, beta, v, e; /* e: exp(g) of a scalar gate */
} gdnb_token;

INLINE_FN real gdnb_decay(gdnb_token tk, i64 i)
{
    return GDNB_GATE_K ? rlx_exp(LOAD(tk.g, i)) : tk.e;
}

/* k.s1 with s1 = e * s0 (the decayed state). */
INLINE_FN real gdnb_k_dot_decayed(gdnb_token tk, GLOBAL const real* s0, i64 K)
{
    real acc = (real)0;
    for (i64 i = 0; i < K; ++i)
        acc += LOAD(tk.k, i) * tk.kf * gdnb_decay(tk, i) * s0[i];
    return acc;
}

/* s2 = e * s0 + k * u, u = (v - k.(e * s0)) * beta (s2 may be s0). */
INLINE_FN void gdnb_step(gdnb_token tk, GLOBAL const real* s0, GLOBAL real* s2, i64 K)
{
    const real u = (tk.v - gdnb_k_dot_decayed(tk, s0, K)) * tk.beta;
    for (i64 i = 0; i < K; ++i)
        s2[i] = gdnb_decay(tk, i) * s0[i] + LOAD(tk.k, i) * tk.kf * u;
}

/* Where a row's tensors are: token tok's key head row at tok*qs + qo (q, k and their gradient
 * partials), its value head's v / d_v / dst at tok*vs + vo, beta at tok*bs + bo, the gate row at
 * (tok*bs + bo) * gk. */
typedef struct {
    i64 qs, qo, vs, vo, bs, bo, gk;
} gdnb_index;

INLINE_FN gdnb_token gdnb_token_at(gdnb_index ix, i64 tok, i64 j, i64 K, GLOBAL const store_t* q,
                                   GLOBAL const store_t* k, GLOBAL const store_t* v, GLOBAL const store_t* g,
                                   GLOBAL const store_t* beta)
{
    gdnb_token tk;
    tk.q = q + tok * ix.qs + ix.qo;
    tk.k = k + tok * ix.qs + ix.qo;
    tk.g = g + (tok * ix.bs + ix.bo) * ix.gk;
    tk.qf = gdnb_inv_norm(tk.q, K);
    tk.kf = gdnb_inv_norm(tk.k, K);
    tk.beta = LOAD(beta, tok * ix.bs + ix.bo);
    tk.v = LOAD(v, tok * ix.vs + ix.vo + j);
    tk.e = GDNB_GATE_K ? (real)0 : rlx_exp(LOAD(tk.g, 0));
    return tk;
}

/* The reverse walk of column j over tokens [t0, t1): writes d_v of the column, adds its share to the
 * partials of d_q and d_k (dq, dk: with respect to the normalised q, k) and to the sums of d_beta and
 * d_g (dbeta, dg: [T*HV] and [T*HV*gk]); with SSM_CARRY starts from h0 (the column's entry, stride V)
 * and reads and writes the state's gradient at dstate. `filled`: ckpt holds the checkpoints of the chunks after
 * the first already (copied from a saved forward), so the forward pass stores the first alone. */
INLINE_FN void gdnb_column(gdnb_index ix, i64 j, i64 t0, i64 t1, i64 K, i64 V, real scale, int filled,
                           GLOBAL const store_t* q,
                           GLOBAL const store_t* k, GLOBAL const store_t* v, GLOBAL const store_t* g,
                           GLOBAL const store_t* beta, GLOBAL const store_t* gout, GLOBAL store_t* dv,
                           GLOBAL const state_t* h0, GLOBAL state_t* dstate, GLOBAL real* ckpt, GLOBAL real* work,
                           GLOBAL real* gs, GLOBAL real* dq, GLOBAL real* dk, GLOBAL real* dbeta, GLOBAL real* dg)
{
    const i64 chunks = (t1 - t0 + SSMB_Q - 1) / SSMB_Q;
    for (i64 i = 0; i < K; ++i)
        gs[i] = SSM_CARRY ? SLOAD(h0, i * V) : (real)0;
    for (i64 c = 0; c < chunks; ++c) {
        const i64 c0 = t0 + c * SSMB_Q, c1 = c0 + SSMB_Q < t1 ? c0 + SSMB_Q : t1;
        if (filled && c)
            break;
        for (i64 i = 0; i < K; ++i)
            ckpt[c * K + i] = gs[i];
        for (i64 tok = c0; tok < c1 && !filled; ++tok)
            gdnb_step(gdnb_token_at(ix, tok, j, K, q, k, v, g, beta), gs, gs, K);
    }
    for (i64 i = 0; i < K; ++i)
        gs[i] = SSM_CARRY ? SLOAD(dstate, i * V) : (real)0;
    for (i64 c = chunks - 1; c >= 0; --c) {
        const i64 c0 = t0 + c * SSMB_Q, c1 = c0 + SSMB_Q < t1 ? c0 + SSMB_Q : t1;
        for (i64 tok = c0; tok < c1; ++tok)
            gdnb_step(gdnb_token_at(ix, tok, j, K, q, k, v, g, beta),
                      tok == c0 ? ckpt + c * K : work + (tok - c0 - 1) * K, work + (tok - c0) * K, K);
        for (i64 tok = c1 - 1; tok >= c0; --tok) {
            const gdnb_token tk = gdnb_token_at(ix, tok, j, K, q, k, v, g, beta);
            GLOBAL const real* s2 = work + (tok - c0) * K;
            GLOBAL const real* s0 = tok == c0 ? ckpt + c * K : s2 - K;
            const i64 qi = tok * ix.qs + ix.qo, bi = tok * ix.bs + ix.bo;
            const real go = LOAD(gout, tok * ix.vs + ix.vo + j) * scale, ks1 = gdnb_k_dot_decayed(tk, s0, K);
            const real u = (tk.v - ks1) * tk.beta;
            real du = (real)0;
            for (i64 i = 0; i < K; ++i) { /* out = scale * q.s2 */
                gs[i] += go * LOAD(tk.q, i) * tk.qf;
                dq[qi + i] += go * s2[i];
                du += LOAD(tk.k, i) * tk.kf * gs[i];
            }
            STORE(dv, tok * ix.vs + ix.vo + j, du * tk.beta);
            dbeta[bi] += du * (tk.v - ks1);
            real gsum = (real)0;
            for (i64 i = 0; i < K; ++i) { /* s2 = s1 + k*u, u = (v - k.s1) * beta, s1 = e * s0 */
                const real e = gdnb_decay(tk, i), s1 = e * s0[i], kn = LOAD(tk.k, i) * tk.kf;
                dk[qi + i] += gs[i] * u - du * tk.beta * s1;
                const real g1 = gs[i] - du * tk.beta * kn;
                if (GDNB_GATE_K)
                    dg[bi * K + i] += g1 * s1;
                else
                    gsum += g1 * s1;
                gs[i] = g1 * e;
            }
            if (!GDNB_GATE_K)
                dg[bi] += gsum;
        }
    }
    if (SSM_CARRY)
        for (i64 i = 0; i < K; ++i)
            SSTORE(dstate, i * V, gs[i]);
}

/* item = (row r, key head kh, block blk of `per` of its value heads; HV/H of them): the column walks
 * of its value heads, then their d_beta and d_g; with `saved` the reserve's states at rsb (batch rows: the
 * reserve excludes packed sequences). Scratch (reals, at the offsets given): the items'
 * workspaces; the d_q and d_k partials [blocks][T][H][K]; the d_beta and d_g sums [T][HV] and
 * [T][HV][K or 1]. */
KERNEL gated_delta_net_backward(i64 R, i64 S, i64 T, i64 H, i64 HV, i64 K, i64 V, i64 blocks, i64 per, real scale,
                                GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo,
                                GLOBAL uchar* gb, i64 go, GLOBAL uchar* betab, i64 betao, GLOBAL uchar* stb, i64 sto,
                                GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo, GLOBAL uchar* gob, i64 goo,
                                GLOBAL uchar* dvb, i64 dvo, GLOBAL uchar* dgb, i64 dgo, GLOBAL uchar* dbetab,
                                i64 dbetao, GLOBAL uchar* dstb, i64 dsto, GLOBAL uchar* scb, i64 wso, i64 dqo, i64 dko,
                                i64 dbso, i64 dgso, int saved, GLOBAL uchar* rsb, i64 rso)
{
    const i64 item = GID(0);
    if (item >= R * H * blocks)
        return;
    /* the item's indices by multiplication (a division-remainder pair becomes a `freeze` Oclgrind cannot check) */
    const i64 r = item / (H * blocks), rest = item - r * H * blocks, kh = rest / blocks, blk = rest - kh * blocks;
    GLOBAL const int* cu = AT(int, cub, cuo);
    const i64 t0 = ssm_first(r, S, cu), t1 = ssm_end(r, S, cu), slot = ssm_slot(r, AT(int, slb, slo));
    const i64 ratio = HV / H, j1 = (blk + 1) * per < ratio ? (blk + 1) * per : ratio, gk = GDNB_GATE_K ? K : 1;
    const i64 chunks = (S + SSMB_Q - 1) / SSMB_Q;
    GLOBAL real* ckpt = AT(real, scb, wso) + item * (chunks + SSMB_Q + 1) * K;
    GLOBAL real* work = ckpt + chunks * K;
    GLOBAL real* gs = work + SSMB_Q * K;
    GLOBAL real* dq = AT(real, scb, dqo) + blk * T * H * K;
    GLOBAL real* dk = AT(real, scb, dko) + blk * T * H * K;
    GLOBAL real* dbeta = AT(real, scb, dbso);
    GLOBAL real* dg = AT(real, scb, dgso);
    for (i64 tok = t0; tok < t1; ++tok)
        for (i64 i = 0; i < K; ++i)
            dq[(tok * H + kh) * K + i] = dk[(tok * H + kh) * K + i] = (real)0;
    for (i64 jv = blk * per; jv < j1; ++jv) {
        const i64 hv = kh * ratio + jv;
        gdnb_index ix;
        ix.qs = H * K; ix.qo = kh * K; ix.vs = HV * V; ix.vo = hv * V; ix.bs = HV; ix.bo = hv; ix.gk = gk;
        for (i64 tok = t0; tok < t1; ++tok) {
            dbeta[tok * HV + hv] = (real)0;
            for (i64 i = 0; i < gk; ++i)
                dg[(tok * HV + hv) * gk + i] = (real)0;
        }
        for (i64 j = 0; j < V; ++j) {
            const i64 entry = (slot * HV + hv) * K * V + j;
            if (saved) /* the reserve's state leaving chunk c - 1 of the row: chunk c's checkpoint */
                for (i64 c = 1; c < chunks; ++c)
                    for (i64 i = 0; i < K; ++i)
                        ckpt[c * K + i] = AT(real, rsb, rso)[((r * chunks + c - 1) * HV + hv) * K * V + i * V + j];
            gdnb_column(ix, j, t0, t1, K, V, scale, saved, AT(store_t, qb, qo), AT(store_t, kb, ko), AT(store_t, vb, vo),
                        AT(store_t, gb, go), AT(store_t, betab, betao), AT(store_t, gob, goo), AT(store_t, dvb, dvo),
                        AT(state_t, stb, sto) + entry, AT(state_t, dstb, dsto) + entry, ckpt, work, gs, dq, dk,
                        dbeta, dg);
        }
        for (i64 tok = t0; tok < t1; ++tok) {
            STORE(AT(store_t, dbetab, dbetao), tok * HV + hv, dbeta[tok * HV + hv]);
            for (i64 i = 0; i < gk; ++i)
                STORE(AT(store_t, dgb, dgo), (tok * HV + hv) * gk + i, dg[(tok * HV + hv) * gk + i]);
        }
    }
}

/* d_q and d_k of one (token, key head) e < E: the blocks' partials summed in order, then (GDNB_NORM)
 * back through x / sqrt(sum x^2 + 1e-6): d_x = (d_xn - xn * (xn . d_xn)) / norm. */
KERNEL gdn_backward_qk(i64 E, i64 K, i64 blocks, GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko,
                       GLOBAL uchar* dqb, i64 dqo, GLOBAL uchar* dkb, i64 dko, GLOBAL uchar* scb, i64 dqso, i64 dkso)
{
    const i64 e = GID(0);
    if (e >= E)
        return;
    for (int which = 0; which < 2; ++which) {
        GLOBAL const store_t* x = AT(store_t, which ? kb : qb, which ? ko : qo) + e * K;
        GLOBAL const real* part = AT(real, scb, which ? dkso : dqso) + e * K;
        GLOBAL store_t* out = AT(store_t, which ? dkb : dqb, which ? dko : dqo) + e * K;
        const real f = gdnb_inv_norm(x, K);
        real dot = (real)0;
        for (i64 i = 0; i < K; ++i) {
            real sum = (real)0;
            for (i64 b = 0; b < blocks; ++b)
                sum += part[b * E * K + i];
            dot += LOAD(x, i) * f * sum;
        }
        for (i64 i = 0; i < K; ++i) {
            real sum = (real)0;
            for (i64 b = 0; b < blocks; ++b)
                sum += part[b * E * K + i];
            STORE(out, i, GDNB_NORM ? (sum - LOAD(x, i) * f * dot) * f : sum);
        }
    }
}

#ifdef RLX_TARGET_CPU /* the cpu target's backward from a saved forward, to the end of this file */
/* The key channels gdn_backward_saved runs at once: its rows (K padded with zeros to KP, a multiple) are walked
 * GDNB_W at a time, each sum over them kept as GDNB_W partial sums added in order at the end, so that the
 * compiler vectorizes them without reordering a sum. */
#define GDNB_W 8

/* A step's normalised key row kn (k / |k| with GDNB_NORM) and decays dd (exp(g) per key channel, or the head's
 * one), zeros from K to KP. */
INLINE_FN void gdnb_token_rows(GLOBAL const store_t* k, GLOBAL const store_t* g, i64 head, i64 K, i64 KP, real* kn,
                               real* dd)
{
    const real rk = gdnb_inv_norm(k, K), e = GDNB_GATE_K ? (real)1 : rlx_exp(LOAD(g, head));
    for (i64 i = 0; i < KP; ++i) {
        kn[i] = i < K ? LOAD(k, i) * rk : (real)0;
        dd[i] = i >= K ? (real)0 : GDNB_GATE_K ? rlx_exp(LOAD(g, head * K + i)) : e;
    }
}

/* The sum of the GDNB_W partial sums p, in order. */
INLINE_FN real gdnb_total(const real* p)
{
    real out = (real)0;
    PRAGMA_UNROLL
    for (int l = 0; l < GDNB_W; ++l)
        out += p[l];
    return out;
}

/* The backward from a saved forward at the cpu target (kernels/gdn.cl's reserve layout, chunks of SSMB_Q = 32
 * steps: the state leaving every chunk and each token's u), GDN_CJ state columns per work-item: item = (batch
 * row b, value head vh, block jb of GDN_CJ columns). Per chunk, the last first: its states rebuilt from the one
 * entering it and u (s = d s + k u: no dot product) into the item's workspace (SSMB_Q + 1 states, column-major:
 * [GDN_CJ][KP], the one entering the chunk, then the one after each step), then its steps reversed with the
 * gradient state gs ([GDN_CJ][KP]) in private memory. Column by column, every loop runs over the key channels
 * (contiguous, GDNB_W at a time), so the sums over them (d_u, k.s1) are one per column and a step's d_q, d_k,
 * d_g (sums over the columns) accumulate element-wise in private rows. Each item writes partials of its own:
 * d_q, d_k [HV/H * NB][T][H][K] (with respect to the normalised q, k; gdn_backward_qk sums them), d_beta
 * [NB][T][HV], d_g [NB][T][HV][K or 1] (gdn_backward_sums); d_v and, with SSM_CARRY, the initial state's
 * gradient of its columns directly. */
KERNEL gdn_backward_saved(i64 B, i64 S, i64 H, i64 HV, i64 K, i64 KP, i64 V, i64 NB, real scale, GLOBAL uchar* qb,
                          i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo, GLOBAL uchar* gb, i64 go,
                          GLOBAL uchar* betab, i64 betao, GLOBAL uchar* stb, i64 sto, GLOBAL uchar* slb, i64 slo,
                          GLOBAL uchar* gob, i64 goo, GLOBAL uchar* dvb, i64 dvo, GLOBAL uchar* dstb, i64 dsto,
                          GLOBAL uchar* rsb, i64 rso, GLOBAL uchar* rub, i64 ruo, GLOBAL uchar* scb, i64 wso,
                          i64 dqo, i64 dko, i64 dbso, i64 dgso)
{
    const i64 item = GID(0);
    if (item >= B * HV * NB)
        return;
    const i64 bh = item / NB, jb = item - bh * NB, b = bh / HV, vh = bh - b * HV;
    const i64 ratio = HV / H, kh = vh / ratio, j0 = jb * GDN_CJ, T = B * S;
    const i64 chunks = (S + SSMB_Q - 1) / SSMB_Q, blk = (vh - kh * ratio) * NB + jb, width = KP * GDN_CJ;
    const i64 nc = V - j0 < GDN_CJ ? V - j0 : GDN_CJ;
    GLOBAL const store_t* q = AT(store_t, qb, qo);
    GLOBAL const store_t* k = AT(store_t, kb, ko);
    GLOBAL const store_t* g = AT(store_t, gb, go);
    const i64 entry = (ssm_slot(b, AT(int, slb, slo)) * HV + vh) * K * V + j0;
    GLOBAL const state_t* h0 = AT(state_t, stb, sto) + entry;
    GLOBAL state_t* dstate = AT(state_t, dstb, dsto) + entry;
    GLOBAL real* ws = AT(real, scb, wso) + item * (SSMB_Q + 1) * width;
    real gs[GDN_CJ * STATE_MAX], qn[STATE_MAX], kn[STATE_MAX], dd[STATE_MAX], dq[STATE_MAX], dk[STATE_MAX],
        dg[STATE_MAX];
    for (i64 c = 0; c < nc; ++c)
        for (i64 i = 0; i < KP; ++i)
            gs[c * KP + i] = SSM_CARRY && i < K ? SLOAD(dstate, i * V + c) : (real)0;
    for (i64 ch = chunks - 1; ch >= 0; --ch) {
        const i64 n = S - ch * SSMB_Q < SSMB_Q ? S - ch * SSMB_Q : SSMB_Q, first = b * S + ch * SSMB_Q;
        GLOBAL const real* entering = AT(real, rsb, rso) + ((b * chunks + ch - 1) * HV + vh) * K * V + j0;
        for (i64 c = 0; c < nc; ++c)
            for (i64 i = 0; i < KP; ++i)
                ws[c * KP + i] = i >= K ? (real)0 : ch ? entering[i * V + c] : SSM_CARRY ? SLOAD(h0, i * V + c) : (real)0;
        for (i64 r = 0; r < n; ++r) {
            const i64 tok = first + r;
            GLOBAL const real* u = AT(real, rub, ruo) + (((b * chunks + ch) * HV + vh) * SSMB_Q + r) * V + j0;
            gdnb_token_rows(k + (tok * H + kh) * K, g, tok * HV + vh, K, KP, kn, dd);
            for (i64 c = 0; c < nc; ++c) {
                GLOBAL const real* s0 = ws + r * width + c * KP;
                GLOBAL real* s2 = ws + (r + 1) * width + c * KP;
                const real uc = u[c];
                for (i64 i0 = 0; i0 < KP; i0 += GDNB_W)
                    PRAGMA_UNROLL
                    for (int l = 0; l < GDNB_W; ++l)
                        s2[i0 + l] = dd[i0 + l] * s0[i0 + l] + kn[i0 + l] * uc;
            }
        }
        for (i64 r = n - 1; r >= 0; --r) {
            const i64 tok = first + r, head = tok * HV + vh;
            const real bt = LOAD(AT(store_t, betab, betao), head), rq = gdnb_inv_norm(q + (tok * H + kh) * K, K);
            gdnb_token_rows(k + (tok * H + kh) * K, g, head, K, KP, kn, dd);
            for (i64 i = 0; i < KP; ++i) {
                qn[i] = i < K ? LOAD(q, (tok * H + kh) * K + i) * rq : (real)0;
                dq[i] = dk[i] = dg[i] = (real)0;
            }
            real bsum = (real)0;
            for (i64 c = 0; c < nc; ++c) {
                GLOBAL const real* s0 = ws + r * width + c * KP;
                GLOBAL const real* s2 = s0 + width;
                real* gc = gs + c * KP;
                const real gy = LOAD(AT(store_t, gob, goo), head * V + j0 + c) * scale;
                const real vc = LOAD(AT(store_t, vb, vo), head * V + j0 + c);
                real du[GDNB_W], ks1[GDNB_W];
                PRAGMA_UNROLL
                for (int l = 0; l < GDNB_W; ++l)
                    du[l] = ks1[l] = (real)0;
                for (i64 i0 = 0; i0 < KP; i0 += GDNB_W) /* out = scale q.s2: gs += d_out q, d_q; d_u = k.gs; k.s1 */
                    PRAGMA_UNROLL
                    for (int l = 0; l < GDNB_W; ++l) {
                        const i64 i = i0 + l;
                        const real x = gc[i] + gy * qn[i];
                        gc[i] = x;
                        dq[i] += gy * s2[i];
                        du[l] += kn[i] * x;
                        ks1[l] += kn[i] * dd[i] * s0[i];
                    }
                const real dut = gdnb_total(du), kst = gdnb_total(ks1);
                STORE(AT(store_t, dvb, dvo), head * V + j0 + c, dut * bt);
                bsum += dut * (vc - kst);
                const real uc = (vc - kst) * bt, dub = dut * bt;
                for (i64 i0 = 0; i0 < KP; i0 += GDNB_W) /* s2 = s1 + k u, u = (v - k.s1) beta, s1 = d s0 */
                    PRAGMA_UNROLL
                    for (int l = 0; l < GDNB_W; ++l) {
                        const i64 i = i0 + l;
                        const real s1 = dd[i] * s0[i], g1 = gc[i] - dub * kn[i];
                        dk[i] += gc[i] * uc - dub * s1;
                        dg[i] += g1 * s1;
                        gc[i] = g1 * dd[i];
                    }
            }
            AT(real, scb, dbso)[jb * T * HV + head] = bsum;
            real gsum = (real)0;
            for (i64 i = 0; i < K; ++i) {
                AT(real, scb, dqo)[(blk * T + tok) * H * K + kh * K + i] = dq[i];
                AT(real, scb, dko)[(blk * T + tok) * H * K + kh * K + i] = dk[i];
                if (GDNB_GATE_K)
                    AT(real, scb, dgso)[(jb * T * HV + head) * K + i] = dg[i];
                gsum += dg[i];
            }
            if (!GDNB_GATE_K)
                AT(real, scb, dgso)[jb * T * HV + head] = gsum;
        }
    }
    if (SSM_CARRY)
        for (i64 c = 0; c < nc; ++c)
            for (i64 i = 0; i < K; ++i)
                SSTORE(dstate, i * V + c, gs[c * KP + i]);
}

/* out[m] = the sum of the NB partials part[nb][m] in order, for m < M (d_beta, d_g of gdn_backward_saved). */
KERNEL gdn_backward_sums(i64 M, i64 NB, GLOBAL uchar* pb, i64 po, GLOBAL uchar* ob, i64 oo)
{
    const i64 m = GID(0);
    if (m >= M)
        return;
    GLOBAL const real* part = AT(real, pb, po) + m;
    real sum = (real)0;
    for (i64 nb = 0; nb < NB; ++nb)
        sum += part[nb * M];
    STORE(AT(store_t, ob, oo), m, sum);
}
#endif

/* The chunked (WY) backward of gated_delta_net with per-head gates, from a saved forward (ABI.md §9.1), one text
 * for both targets; part of the gdn_backward program (before kernels/gdn_backward.cl, after kernels/ssm_fields.cl,
 * whose state slots, carried state and f32 state beside a 16-bit thunk it shares; GDNB_NORM switches qk_l2norm on).
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
 * a reverse pass over the chunks, column by column of the state (gdn_chunk_back_pass); then, every chunk at once,
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
 * sequence in the last chunk are zero inputs (the reserve's padding). Host twin: host_fallback/gdn_backward_chunked.py. */

#ifndef GDNB_NORM
#define GDNB_NORM 0
#endif
#define GDNC_L 32 /* the saved forward's chunk (kernels/gdn.cl's GDN_RC, abi.gdn.RESERVE_CHUNK) */
#define GDNC_LP (GDNC_L + 1) /* LOCAL rows padded by one, so that a column walk spreads over banks */

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

/* A chunk's per-token scalars in LOCAL memory: the cumulative log-decay, beta and the factors 1/|q|, 1/|k|
 * (1 without GDNB_NORM), token r written by lane r % lanes; a barrier follows. */
INLINE_FN void gdnc_rows_barrier(gdnc_chunk ch, i64 HV, i64 H, i64 vh, GLOBAL const store_t* g,
                                 GLOBAL const store_t* beta, GLOBAL const real* nrm, LOCAL_PTR real* cum,
                                 LOCAL_PTR real* bet, LOCAL_PTR real* nq, LOCAL_PTR real* nk, i64 lane, i64 lanes)
{
    BARRIER(); /* the previous chunk's rows are read no more */
    for (i64 r = lane; r < GDNC_L; r += lanes) {
        real sum = (real)0;
        for (i64 t = 0; t <= r; ++t)
            sum += gdnc_load(g, ch, t, HV, vh);
        cum[r] = sum;
        bet[r] = gdnc_load(beta, ch, r, HV, vh);
        const i64 e = (ch.first + r) * H + ch.kh;
        nq[r] = GDNB_NORM && r < ch.n ? nrm[2 * e] : (real)1;
        nk[r] = GDNB_NORM && r < ch.n ? nrm[2 * e + 1] : (real)1;
    }
    BARRIER();
}

/* Column j of one chunk in the reverse pass: y (the chunk's [L][V] rows of this column, stride V) gets dU then Y
 * in place, dv the column's dV; `ds` is dS_L's column (stride V), `out` (stride V) gets dS0's column. */
INLINE_FN void gdnc_pass_chunk(gdnc_chunk ch, i64 j, i64 HV, i64 H, i64 K, i64 V, real scale,
                               GLOBAL const store_t* q, GLOBAL const store_t* k, GLOBAL const store_t* gout,
                               GLOBAL store_t* dv, GLOBAL const real* qk, GLOBAL const real* inv,
                               GLOBAL const real* ds, GLOBAL real* y, GLOBAL real* out, LOCAL_PTR const real* cum,
                               LOCAL_PTR const real* bet, LOCAL_PTR const real* nq, LOCAL_PTR const real* nk)
{
    const i64 vh = ch.slot - ch.slot / HV * HV, vat = vh * V + j, kat = ch.kh * K;
    const real last = cum[GDNC_L - 1];
    for (i64 s = 0; s < GDNC_L; ++s) { /* dU = scale qk^T dO + diag(end) K dS_L */
        real acc = (real)0, kd = (real)0;
        for (i64 r = s; r < ch.n; ++r)
            acc += qk[r * GDNC_L + s] * LOAD(gout, (ch.first + r) * HV * V + vat);
        for (i64 i = 0; i < K && s < ch.n; ++i)
            kd += LOAD(k, (ch.first + s) * H * K + kat + i) * ds[i * V];
        y[s * V] = scale * acc + rlx_exp(last - cum[s]) * nk[s] * kd;
    }
    for (i64 s = 0; s < GDNC_L; ++s) { /* Y = inverse^T dU, in place: Y_s reads dU_r for r >= s alone */
        real acc = (real)0;
        for (i64 r = s; r < GDNC_L; ++r)
            acc += inv[r * GDNC_L + s] * y[r * V];
        y[s * V] = acc;
        if (s < ch.n)
            STORE(dv, (ch.first + s) * HV * V + vat, bet[s] * acc);
    }
    const real through = rlx_exp(last);
    for (i64 i = 0; i < K; ++i) { /* dS0 = D dS_L + sum_r gamma_r (scale q_r dO_r - k_r beta_r Y_r) */
        real acc = (real)0;
        for (i64 r = 0; r < ch.n; ++r) {
            const i64 at = (ch.first + r) * H * K + kat + i;
            acc += rlx_exp(cum[r]) * (scale * LOAD(q, at) * nq[r] * LOAD(gout, (ch.first + r) * HV * V + vat)
                                      - LOAD(k, at) * nk[r] * bet[r] * y[r * V]);
        }
        out[i * V] = through * ds[i * V] + acc;
    }
}

/* The reverse pass: a work-group per (batch row b, value head vh), a work-item per state column j (local size V).
 * Scratch: the state gradients at dsb, [B][HV][C + 1][K][V]: slot c + 1 dS_L of chunk c (the last one d_state's,
 * with SSM_CARRY, or 0), slot 0 the initial state's (written to d_state with SSM_CARRY); Y at yb, [B][C][HV][L][V]
 * (the reserve's slot order); d_v written. */
KERNEL gdn_chunk_back_pass(i64 S, i64 H, i64 HV, i64 K, i64 V, real scale, GLOBAL uchar* qb, i64 qo,
                           GLOBAL uchar* kb, i64 ko, GLOBAL uchar* gb, i64 go, GLOBAL uchar* betab, i64 betao,
                           GLOBAL uchar* slb, i64 slo, GLOBAL uchar* gob, i64 goo, GLOBAL uchar* dvb, i64 dvo,
                           GLOBAL uchar* dstb, i64 dsto, GLOBAL uchar* nb, i64 no, GLOBAL uchar* rqb, i64 rqo,
                           GLOBAL uchar* rib, i64 rio, GLOBAL uchar* dsb, i64 dso, GLOBAL uchar* yb, i64 yo)
{
    LOCAL real cum[GDNC_L], bet[GDNC_L], nq[GDNC_L], nk[GDNC_L];
    const i64 bh = GROUP(0), j = LID(0), b = bh / HV, vh = bh - b * HV, chunks = (S + GDNC_L - 1) / GDNC_L;
    const i64 kv = K * V;
    GLOBAL state_t* dstate = AT(state_t, dstb, dsto) + (ssm_slot(b, AT(int, slb, slo)) * HV + vh) * kv + j;
    GLOBAL real* dsl = AT(real, dsb, dso) + bh * (chunks + 1) * kv + j;
    for (i64 i = 0; i < K; ++i)
        dsl[chunks * kv + i * V] = SSM_CARRY ? SLOAD(dstate, i * V) : (real)0;
    for (i64 c = chunks - 1; c >= 0; --c) {
        const gdnc_chunk ch = gdnc_chunk_of(b, c, vh, S, H, HV);
        gdnc_rows_barrier(ch, HV, H, vh, AT(store_t, gb, go), AT(store_t, betab, betao), AT(real, nb, no), cum, bet,
                          nq, nk, j, V);
        gdnc_pass_chunk(ch, j, HV, H, K, V, scale, AT(store_t, qb, qo), AT(store_t, kb, ko), AT(store_t, gob, goo),
                        AT(store_t, dvb, dvo), AT(real, rqb, rqo) + ch.slot * GDNC_L * GDNC_L,
                        AT(real, rib, rio) + ch.slot * GDNC_L * GDNC_L, dsl + (c + 1) * kv,
                        AT(real, yb, yo) + ch.slot * GDNC_L * V + j, dsl + c * kv, cum, bet, nq, nk);
    }
    if (SSM_CARRY)
        for (i64 i = 0; i < K; ++i)
            SSTORE(dstate, i * V, dsl[i * V]);
}

/* The state entering a chunk, element at: the reserve's state leaving the one before (s0), or for the first chunk
 * the initial state (h0, with SSM_CARRY) or 0. */
INLINE_FN real gdnc_entering(int first, GLOBAL const real* s0, GLOBAL const state_t* h0, i64 at)
{
    return !first ? s0[at] : SSM_CARRY ? SLOAD(h0, at) : (real)0;
}

/* Row r of the chunk's L x L gradient products (over the V columns): dqk = scale dO_r . U_s (s <= r) and
 * dA = Y_r . U_s (s < r) into LOCAL pq = dqk .* R, pk = dkk .* R, e = dqk .* qk + dkk .* kk (0 above the
 * diagonal); returns Y_r . V_r - sum_s dA[r][s] kk[r][s], beta's gradient but for its gate term. */
INLINE_FN real gdnc_row_products(gdnc_chunk ch, i64 r, i64 vat, i64 HV, i64 V, real scale, GLOBAL const store_t* v,
                                 GLOBAL const store_t* gout, GLOBAL const real* u, GLOBAL const real* y,
                                 GLOBAL const real* qk, GLOBAL const real* kk, LOCAL_PTR const real* cum,
                                 LOCAL_PTR const real* bet, LOCAL_PTR real* pq, LOCAL_PTR real* pk, LOCAL_PTR real* e)
{
    real dbeta = (real)0;
    for (i64 j = 0; j < V; ++j)
        dbeta += y[r * V + j] * gdnc_load(v, ch, r, HV * V, vat + j);
    for (i64 s = 0; s < GDNC_L; ++s) {
        real dqk = (real)0, da = (real)0;
        for (i64 j = 0; j < V && s <= r; ++j) {
            const real us = u[s * V + j];
            dqk += gdnc_load(gout, ch, r, HV * V, vat + j) * us;
            da += y[r * V + j] * us;
        }
        dqk = s <= r ? scale * dqk : (real)0;
        da = s < r ? da : (real)0;
        const real ratio = s <= r ? rlx_exp(cum[r] - cum[s]) : (real)0, dkk = -bet[r] * da;
        dbeta -= da * kk[r * GDNC_L + s];
        pq[r * GDNC_LP + s] = dqk * ratio;
        pk[r * GDNC_LP + s] = dkk * ratio;
        e[r * GDNC_LP + s] = dqk * qk[r * GDNC_L + s] + dkk * kk[r * GDNC_L + s];
    }
    return dbeta;
}

/* Where gdnc_row_grads reads a chunk: q, k, the state entering it (s0 / h0, gdnc_entering), U and Y rows
 * ([L][V]), dS_L ([K][V]), d_out and the LOCAL rows and products. */
typedef struct {
    GLOBAL const store_t* q;
    GLOBAL const store_t* k;
    GLOBAL const store_t* gout;
    GLOBAL const real* s0;
    GLOBAL const state_t* h0;
    GLOBAL const real* u;
    GLOBAL const real* y;
    GLOBAL const real* dsl;
} gdnc_grad_inputs;

/* Row r's d_q, d_k (partials, with respect to the normalised q, k: dq, dk [K] at the token's key-head row, for a
 * token of the sequence) key channel by channel, after gdnc_row_products' barrier; returns the row's gradient of
 * its cumulative log-decay but for the chunk's last-row terms, whose share of row r it adds to *tail. */
INLINE_FN real gdnc_row_grads(gdnc_chunk ch, int first, i64 r, i64 vat, i64 H, i64 HV, i64 K, i64 V, real scale,
                              gdnc_grad_inputs in, GLOBAL real* dq, GLOBAL real* dk, real* dbeta, real* tail,
                              LOCAL_PTR const real* cum, LOCAL_PTR const real* bet, LOCAL_PTR const real* nq,
                              LOCAL_PTR const real* nk, LOCAL_PTR const real* pq, LOCAL_PTR const real* pk)
{
    const real gam = rlx_exp(cum[r]), end = rlx_exp(cum[GDNC_L - 1] - cum[r]), through = rlx_exp(cum[GDNC_L - 1]);
    const i64 kat = ch.kh * K;
    real dcum = (real)0, enter = (real)0;
    for (i64 i = 0; i < K; ++i) {
        real ys = (real)0, os = (real)0, ud = (real)0;
        for (i64 j = 0; j < V; ++j) {
            const real s0 = gdnc_entering(first, in.s0, in.h0, i * V + j);
            ys += in.y[r * V + j] * s0;
            os += gdnc_load(in.gout, ch, r, HV * V, vat + j) * s0;
            ud += in.u[r * V + j] * in.dsl[i * V + j];
            enter += i % GDNC_L == r ? s0 * in.dsl[i * V + j] : (real)0;
        }
        const real qn = gdnc_load(in.q, ch, r, H * K, kat + i) * nq[r], kn = gdnc_load(in.k, ch, r, H * K, kat + i) * nk[r];
        const real dqg = scale * gam * os, dgk = bet[r] * gam * ys, dkd = end * ud;
        real dqi = dqg, dki = dkd - dgk;
        for (i64 s = 0; s < GDNC_L; ++s) {
            const real qs = gdnc_load(in.q, ch, s, H * K, kat + i) * nq[s];
            const real ks = gdnc_load(in.k, ch, s, H * K, kat + i) * nk[s];
            dqi += pq[r * GDNC_LP + s] * ks;
            dki += pq[s * GDNC_LP + r] * qs + (pk[r * GDNC_LP + s] + pk[s * GDNC_LP + r]) * ks;
        }
        *dbeta -= gam * kn * ys;
        dcum += qn * dqg - kn * (dgk + dkd);
        *tail += kn * dkd;
        if (r < ch.n) {
            dq[i] = dqi;
            dk[i] = dki;
        }
    }
    *tail += through * enter;
    return dcum;
}

/* Every chunk's gradients of q, k, beta and g at once: a work-group per reserve slot (batch row, chunk, value head),
 * a work-item per token r of the chunk (local size L). Reads the reserve (states, qk, kk, u at rsb, rqb, rkb, rub)
 * and gdn_chunk_back_pass's scratch (dsb, yb); writes the d_q, d_k partials [HV/H][T][H][K] at dqb, dkb (scratch),
 * d_beta and d_g. */
KERNEL gdn_chunk_back_grads(i64 S, i64 T, i64 H, i64 HV, i64 K, i64 V, real scale, GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb,
                            i64 ko, GLOBAL uchar* vb, i64 vo, GLOBAL uchar* gb, i64 go, GLOBAL uchar* betab,
                            i64 betao, GLOBAL uchar* stb, i64 sto, GLOBAL uchar* slb, i64 slo, GLOBAL uchar* gob,
                            i64 goo, GLOBAL uchar* dgb, i64 dgo, GLOBAL uchar* dbetab, i64 dbetao, GLOBAL uchar* nb,
                            i64 no, GLOBAL uchar* rsb, i64 rso, GLOBAL uchar* rqb, i64 rqo, GLOBAL uchar* rkb,
                            i64 rko, GLOBAL uchar* rub, i64 ruo, GLOBAL uchar* dsb, i64 dso, GLOBAL uchar* yb, i64 yo,
                            GLOBAL uchar* dqb, i64 dqo, GLOBAL uchar* dkb, i64 dko)
{
    LOCAL real cum[GDNC_L], bet[GDNC_L], nq[GDNC_L], nk[GDNC_L], dcs[GDNC_L], tails[GDNC_L];
    LOCAL real pq[GDNC_L * GDNC_LP], pk[GDNC_L * GDNC_LP], e[GDNC_L * GDNC_LP];
    const i64 slot = GROUP(0), r = LID(0), chunks = (S + GDNC_L - 1) / GDNC_L, kv = K * V;
    const i64 bc = slot / HV, vh = slot - bc * HV, b = bc / chunks, c = bc - b * chunks, vat = vh * V;
    const gdnc_chunk ch = gdnc_chunk_of(b, c, vh, S, H, HV);
    gdnc_rows_barrier(ch, HV, H, vh, AT(store_t, gb, go), AT(store_t, betab, betao), AT(real, nb, no), cum, bet, nq,
                      nk, r, GDNC_L);
    gdnc_grad_inputs in;
    in.q = AT(store_t, qb, qo);
    in.k = AT(store_t, kb, ko);
    in.gout = AT(store_t, gob, goo);
    in.s0 = AT(real, rsb, rso) + (slot - HV) * kv; /* the state leaving the chunk before (c > 0) */
    in.h0 = AT(state_t, stb, sto) + (ssm_slot(b, AT(int, slb, slo)) * HV + vh) * kv;
    in.u = AT(real, rub, ruo) + slot * GDNC_L * V;
    in.y = AT(real, yb, yo) + slot * GDNC_L * V;
    in.dsl = AT(real, dsb, dso) + ((b * HV + vh) * (chunks + 1) + c + 1) * kv;
    real dbeta = gdnc_row_products(ch, r, vat, HV, V, scale, AT(store_t, vb, vo), in.gout, in.u, in.y,
                                   AT(real, rqb, rqo) + slot * GDNC_L * GDNC_L,
                                   AT(real, rkb, rko) + slot * GDNC_L * GDNC_L, cum, bet, pq, pk, e);
    BARRIER();
    const i64 tok = ch.first + r, ratio = HV / H, part = ((vh - ch.kh * ratio) * T + tok) * H * K + ch.kh * K;
    real tail = (real)0;
    const real dcum = gdnc_row_grads(ch, c == 0, r, vat, H, HV, K, V, scale, in, AT(real, dqb, dqo) + part,
                                     AT(real, dkb, dko) + part, &dbeta, &tail, cum, bet, nq, nk, pq, pk);
    real rows = (real)0, cols = (real)0;
    for (i64 s = 0; s < GDNC_L; ++s) {
        rows += e[r * GDNC_LP + s];
        cols += e[s * GDNC_LP + r];
    }
    dcs[r] = dcum + rows - cols;
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
}

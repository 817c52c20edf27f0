/* mamba3_backward (ABI.md §9, §11): the gradients of Mamba-3 SISO, one text for both targets. kernels/mamba3.cl
 * (the forward's helpers: m3_io, m3_coeffs_at, m3_pair_at, m3_sincos, m3_tanh) precedes it.
 *
 * Five launches (launches/mamba3.py), every sum in one fixed order, no atomics:
 * 1. mamba3_backward_turn, an item per (row, head, pair i): the angle walked over the row's tokens as the forward
 *    walks it; each token's turned, biased q and k (qr, kr [T][H][N]) and its angle (th [T][H][A]) into scratch.
 * 2. mamba3_backward_walk, an item per (row, head, block of state rows p): each of its rows in turn is walked
 *    forward from its initial state storing a checkpoint every SSMB_Q steps, then in reverse chunk by chunk (the
 *    chunk's states recomputed into the item's workspace), §11's steps 4-6 undone per token: d_v and d_z stored;
 *    the row's shares of the gradients of q~ and k~ (N each) and of alpha, beta, gamma (3) added, row after row,
 *    to the block's partials (part [blocks][T][H][3+2N], a run of m3b_part_size(N) per token); the initial
 *    state's gradients (d_state, d_v_state) stored, the initial key's share into dk0 [R][blocks][H][N], d_d's into
 *    ddp [R][blocks][H].
 * 3. mamba3_backward_tokens, an item per (token, head): the partials summed over the blocks; d_adt, d_trap stored,
 *    dt's share from beta and gamma kept (dts [T][H]); the rotation undone: the gradients of the biased q and k
 *    written over qr, kr, each angle's own gradient over th.
 * 4. mamba3_backward_angles, an item per (row, head): the angle's gradient summed from the last token back
 *    (d_angles, dt's share from the angle, then d_dt stored), d_angle_state and d_k_state (the blocks' dk0 summed).
 * 5. mamba3_backward_reduce: d_q, d_k over the heads of a group, d_q_bias, d_k_bias over the tokens, d_d over
 *    rows and blocks.
 * Scratch is in the compute type; each d_ output is rounded once, on store. */

/* The per-token gradients the walk reads and writes ([T][H][P], as v): of the output (read), of v and z. */
typedef struct {
    GLOBAL const store_t* go;
    GLOBAL store_t* dv;
    GLOBAL store_t* dz;
} m3b_grads;

/* The scratch parts the walk and the per-token launch share: the turned q and k (the walk reads them, the per-token
 * launch writes their gradients over them) and the blocks' partials (the walk adds to them, the other sums them). */
typedef struct {
    GLOBAL real* qr;
    GLOBAL real* kr;
    GLOBAL real* part;
} m3b_scratch;

INLINE_FN m3b_grads m3b_grads_of(GLOBAL uchar* gob, i64 goo, GLOBAL uchar* dvb, i64 dvo, GLOBAL uchar* dzb, i64 dzo)
{
    m3b_grads gr;
    gr.go = AT(store_t, gob, goo);
    gr.dv = AT(store_t, dvb, dvo);
    gr.dz = AT(store_t, dzb, dzo);
    return gr;
}

INLINE_FN m3b_scratch m3b_scratch_of(GLOBAL uchar* qrb, i64 qro, GLOBAL uchar* krb, i64 kro, GLOBAL uchar* partb,
                                     i64 parto)
{
    m3b_scratch sc;
    sc.qr = AT(real, qrb, qro);
    sc.kr = AT(real, krb, kro);
    sc.part = AT(real, partb, parto);
    return sc;
}

/* A block's partials of one (token, head): the shares of the gradients of alpha, beta and gamma, then of q~ (N
 * values) and of k~ (N). */
INLINE_FN i64 m3b_part_size(i64 N) { return 2 * N + 3; }

/* The previous token's turned key as token tok of `row` reads it (k-bar): the row's initial key for its first token
 * (none without carry: 0), else token tok-1's. */
INLINE_FN GLOBAL const real* m3b_kbar(m3_io io, m3b_scratch sc, m3_row row, i64 tok)
{
    if (tok > row.first)
        return sc.kr + ((tok - 1) * io.H + row.h) * io.N;
    return io.carry ? io.k_state + (row.entry * io.H + row.h) * io.N : 0;
}

/* The previous token's value of state row p (v-bar) at token tok. */
INLINE_FN real m3b_vbar(m3_io io, m3_row row, i64 tok, i64 p)
{
    if (tok > row.first)
        return LOAD(io.v, ((tok - 1) * io.H + row.h) * io.P + p);
    return io.carry ? io.v_state[(row.entry * io.H + row.h) * io.P + p] : (real)0;
}

/* The rows p .. p+np-1 (np <= M3B_PB) of a block walked together, so that each token's q~, k~ and k-bar are read
 * once for them all and the block's partials updated once per token for them all. Their state vectors lie row
 * after row, N apart, in the workspace; a row c >= np is all zeros throughout (its inputs read as 0). */

/* The rows' states after token tok (out) from the ones before it (in; out may be in): §11's step 4. */
INLINE_FN void m3b_step(m3_io io, m3b_scratch sc, m3_row row, i64 tok, i64 p, int np, GLOBAL const real* in,
                        GLOBAL real* out)
{
    const m3_coeffs cf = m3_coeffs_at(io, tok, row.h);
    GLOBAL const real* kbar = m3b_kbar(io, sc, row, tok);
    GLOBAL const real* kr = sc.kr + (tok * io.H + row.h) * io.N;
    real bv[M3B_PB], gv[M3B_PB];
    PRAGMA_UNROLL
    for (int c = 0; c < M3B_PB; ++c) {
        bv[c] = c < np && kbar ? cf.beta * m3b_vbar(io, row, tok, p + c) : (real)0;
        gv[c] = c < np ? cf.gamma * LOAD(io.v, (tok * io.H + row.h) * io.P + p + c) : (real)0;
    }
    for (i64 n = 0; n < io.N; ++n) {
        const real kb = kbar ? kbar[n] : (real)0, kn = kr[n];
        PRAGMA_UNROLL
        for (int c = 0; c < M3B_PB; ++c)
            out[c * io.N + n] = c < np ? cf.alpha * in[c * io.N + n] + bv[c] * kb + gv[c] * kn : (real)0;
    }
}

/* The gradient of y (before d and the gate) of state row p at token tok, whose state after it is s; d_z stored, and
 * the skip's share of d_v in *dv_skip and of d_d added to *dd. */
INLINE_FN real m3b_gy(m3_io io, m3b_grads gr, m3_row row, i64 tok, i64 p, GLOBAL const real* s, GLOBAL const real* qr,
                      real* dv_skip, real* dd)
{
    const i64 at = (tok * io.H + row.h) * io.P + p;
    const real xv = LOAD(io.v, at), dh = io.has_d ? load_any(io.d, row.h, io.param_real) : (real)0;
    real gy = LOAD(gr.go, at);
    if (io.has_z) { /* out = (y + d*v) * silu(z) */
        real y = (real)0;
        for (i64 n = 0; n < io.N; ++n)
            y += s[n] * qr[n];
        const real zv = LOAD(io.z, at), sz = (real)1 / ((real)1 + rlx_exp(-zv));
        STORE(gr.dz, at, gy * (y + dh * xv) * sz * ((real)1 + zv * ((real)1 - sz)));
        gy *= zv * sz;
    }
    *dv_skip = gy * dh;
    *dd += gy * xv;
    return gy;
}

/* The carried gradients of the rows in their reverse walk: of S (g) and the key's share the next token's beta term
 * hands back (dkb), M3B_PB x N values each in the workspace, and of v-bar, the previous token's value (dvb). */
typedef struct {
    GLOBAL real* g;
    GLOBAL real* dkb;
    real dvb[M3B_PB];
} m3b_carried;

/* Token tok of the rows undone (§11 steps 6, 5, 4 reversed): s and s_prev their states after and before it. The
 * rows' shares of the gradients of q~ and k~ (dq, dk: N values) and of alpha, beta, gamma (sp: 3) are added to the
 * block's partials; d_v stored. */
INLINE_FN void m3b_token_back(m3_io io, m3b_grads gr, m3b_scratch sc, m3_row row, i64 tok, i64 p, int np,
                              GLOBAL const real* s, GLOBAL const real* s_prev, GLOBAL real* dq, GLOBAL real* dk,
                              GLOBAL real* sp, m3b_carried* c, real* dd)
{
    const i64 N = io.N;
    const m3_coeffs cf = m3_coeffs_at(io, tok, row.h);
    GLOBAL const real* kbar = m3b_kbar(io, sc, row, tok);
    GLOBAL const real* kr = sc.kr + (tok * io.H + row.h) * N;
    GLOBAL const real* qr = sc.qr + (tok * io.H + row.h) * N;
    real xv[M3B_PB], vbar[M3B_PB], gy[M3B_PB], dv_skip[M3B_PB], dsv[M3B_PB], dsk[M3B_PB], dal[M3B_PB];
    PRAGMA_UNROLL
    for (int r = 0; r < M3B_PB; ++r) {
        xv[r] = vbar[r] = gy[r] = dv_skip[r] = dsv[r] = dsk[r] = dal[r] = (real)0;
        if (r < np) {
            xv[r] = LOAD(io.v, (tok * io.H + row.h) * io.P + p + r);
            vbar[r] = m3b_vbar(io, row, tok, p + r);
            gy[r] = m3b_gy(io, gr, row, tok, p + r, s + r * N, qr, &dv_skip[r], dd);
        }
    }
    for (i64 n = 0; n < N; ++n) {
        const real kb = kbar ? kbar[n] : (real)0, kn = kr[n], qn = qr[n];
        real dqn = (real)0, dkn = (real)0;
        PRAGMA_UNROLL
        for (int r = 0; r < M3B_PB; ++r) {
            const int live = r < np; /* a row past np adds nothing, whatever Inf or NaN the others meet */
            const real ds = live ? c->g[r * N + n] + gy[r] * qn : (real)0;
            dqn += live ? gy[r] * s[r * N + n] : (real)0;
            dkn += live ? cf.gamma * xv[r] * ds + c->dkb[r * N + n] : (real)0;
            dsv[r] += ds * kn;
            dsk[r] += ds * kb;
            dal[r] += ds * s_prev[r * N + n];
            c->dkb[r * N + n] = cf.beta * vbar[r] * ds;
            c->g[r * N + n] = cf.alpha * ds;
        }
        dq[n] += dqn;
        dk[n] += dkn;
    }
    PRAGMA_UNROLL
    for (int r = 0; r < M3B_PB; ++r) {
        if (r < np) {
            STORE(gr.dv, (tok * io.H + row.h) * io.P + p + r, dv_skip[r] + c->dvb[r] + cf.gamma * dsv[r]);
            sp[0] += dal[r];
            sp[1] += vbar[r] * dsk[r];
            sp[2] += xv[r] * dsv[r];
            c->dvb[r] = cf.beta * dsk[r];
        }
    }
}

/* One work-item's workspace (reals) for rows of up to S tokens: the checkpoints (the rows' states entering each
 * chunk of SSMB_Q tokens), the rows' states after each token of one chunk, then the carried g and dkb. */
INLINE_FN GLOBAL real* m3b_workspace(GLOBAL real* ws, i64 item, i64 S, i64 N)
{
    return ws + item * ((S + SSMB_Q - 1) / SSMB_Q + SSMB_Q + 2) * M3B_PB * N;
}

/* State rows p .. p+np-1 of `row` walked forward (checkpoints) then back, their shares added to the block's
 * partials `part` ([T][H][m3b_part_size(N)]); with carry their initial states' gradients stored over the final
 * ones' (dstate, dv_state: d_state, d_v_state); the initial key's share added to dk0 (N values). */
INLINE_FN void m3b_rows_back(m3_io io, m3b_grads gr, m3b_scratch sc, m3_row row, i64 p, int np, i64 S,
                             GLOBAL real* part, GLOBAL real* ws, GLOBAL real* dk0, GLOBAL real* dstate,
                             GLOBAL real* dv_state, real* dd)
{
    const i64 N = io.N, W = M3B_PB * N, chunks = (row.end - row.first + SSMB_Q - 1) / SSMB_Q;
    const i64 at = ((row.entry * io.H + row.h) * io.P + p) * N, head = (row.entry * io.H + row.h) * io.P + p;
    GLOBAL real* ckpt = ws;
    GLOBAL real* work = ckpt + ((S + SSMB_Q - 1) / SSMB_Q) * W;
    m3b_carried c;
    c.g = work + SSMB_Q * W;
    c.dkb = c.g + W;
    for (i64 j = 0; j < W; ++j)
        c.g[j] = io.carry && j < np * N ? io.state[at + j] : (real)0;
    for (i64 k = 0; k < chunks; ++k) {
        const i64 c0 = row.first + k * SSMB_Q, c1 = c0 + SSMB_Q < row.end ? c0 + SSMB_Q : row.end;
        for (i64 j = 0; j < W; ++j)
            ckpt[k * W + j] = c.g[j];
        for (i64 tok = c0; tok < c1; ++tok)
            m3b_step(io, sc, row, tok, p, np, c.g, c.g);
    }
    for (i64 j = 0; j < W; ++j) {
        c.g[j] = io.carry && j < np * N ? dstate[at + j] : (real)0;
        c.dkb[j] = (real)0;
    }
    PRAGMA_UNROLL
    for (int r = 0; r < M3B_PB; ++r)
        c.dvb[r] = io.carry && r < np ? dv_state[head + r] : (real)0;
    for (i64 k = chunks - 1; k >= 0; --k) {
        const i64 c0 = row.first + k * SSMB_Q, c1 = c0 + SSMB_Q < row.end ? c0 + SSMB_Q : row.end;
        for (i64 tok = c0; tok < c1; ++tok)
            m3b_step(io, sc, row, tok, p, np, tok == c0 ? ckpt + k * W : work + (tok - c0 - 1) * W,
                     work + (tok - c0) * W);
        for (i64 tok = c1 - 1; tok >= c0; --tok) {
            GLOBAL real* pt = part + (tok * io.H + row.h) * m3b_part_size(N);
            m3b_token_back(io, gr, sc, row, tok, p, np, work + (tok - c0) * W,
                           tok == c0 ? ckpt + k * W : work + (tok - c0 - 1) * W, pt + 3, pt + 3 + N, pt, &c, dd);
        }
    }
    for (i64 n = 0; n < N; ++n) {
        real sum = dk0[n];
        for (int r = 0; r < np; ++r)
            sum += c.dkb[r * N + n];
        dk0[n] = sum;
    }
    if (!io.carry)
        return;
    for (i64 j = 0; j < np * N; ++j)
        dstate[at + j] = c.g[j];
    for (int r = 0; r < np; ++r)
        dv_state[head + r] = c.dvb[r];
}

/* The kernels below take only the argument groups they read (the forward's m3_io_base first, then the m3_with_* of
 * kernels/mamba3.cl, in that order), then their own: launches/mamba3.py names both. */

/* Turned, biased q and k of every token (and each token's angles) of pair i of (row, head) GID(0) / (N/2). */
KERNEL mamba3_backward_turn(i64 R, i64 S, i64 H, i64 P, i64 N, i64 A, i64 G, int carry, int dt_real, int param_real,
    GLOBAL uchar* dtb, i64 dto, int has_q_bias, int has_k_bias, GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko,
    GLOBAL uchar* qbb, i64 qbo, GLOBAL uchar* kbb, i64 kbo, int varlen, GLOBAL uchar* cub, i64 cuo, int slotted,
    GLOBAL uchar* slb, i64 slo, GLOBAL uchar* anb, i64 ano, GLOBAL uchar* asb, i64 aso, GLOBAL uchar* qrb, i64 qro,
    GLOBAL uchar* krb, i64 kro, GLOBAL uchar* thb, i64 tho)
{
    const i64 pairs = N / 2, rh = GID(0) / pairs, i = GID(0) - rh * pairs, r = rh / H, h = rh - r * H;
    if (rh >= R * H)
        return;
    m3_io io = m3_io_base(H, P, N, A, G, carry, dt_real, param_real, dtb, dto);
    io = m3_with_qk(io, has_q_bias, has_k_bias, qb, qo, kb, ko, qbb, qbo, kbb, kbo);
    io = m3_with_rows(io, varlen, cub, cuo, slotted, slb, slo);
    io.angles = AT(uchar, anb, ano);
    io.angle_state = AT(real, asb, aso);
    GLOBAL real* qr = AT(real, qrb, qro);
    GLOBAL real* kr = AT(real, krb, kro);
    GLOBAL real* th = AT(real, thb, tho);
    const m3_row row = m3_row_of(io, r, h, S);
    real theta = carry && i < A ? m3_wrap(io.angle_state[(row.entry * H + h) * A + i]) : (real)0;
    for (i64 tok = row.first; tok < row.end; ++tok) {
        const i64 at = (tok * H + h) * N + 2 * i;
        if (i < A) {
            theta = m3_advance(io, theta, tok, h, i, load_any(io.dt, tok * H + h, dt_real));
            th[(tok * H + h) * A + i] = theta;
        }
        const m3_pair pr = m3_pair_at(io, row, tok, i, m3_sincos(i < A ? theta : (real)0));
        qr[at] = pr.q0;
        qr[at + 1] = pr.q1;
        kr[at] = pr.k0;
        kr[at + 1] = pr.k1;
    }
}

/* The reverse walk of item GID(0) = (row, head, block of `per` state rows), block fastest: the block's partials
 * zeroed for the row's tokens (block 0's key partial of the last token starting from d_k_state), its rows walked. */
KERNEL mamba3_backward_walk(i64 R, i64 S, i64 H, i64 P, i64 N, i64 A, i64 G, int carry, int dt_real, int param_real,
    GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* adtb, i64 adto, GLOBAL uchar* trb, i64 tro, int has_d, int has_z,
    GLOBAL uchar* vb, i64 vo, GLOBAL uchar* zb, i64 zo, GLOBAL uchar* skb, i64 sko, GLOBAL uchar* stb, i64 sto,
    GLOBAL uchar* ksb, i64 kso, GLOBAL uchar* vsb, i64 vso, int varlen, GLOBAL uchar* cub, i64 cuo, int slotted,
    GLOBAL uchar* slb, i64 slo, i64 T, i64 blocks, i64 per, GLOBAL uchar* gob, i64 goo, GLOBAL uchar* dvb, i64 dvo,
    GLOBAL uchar* dzb, i64 dzo, GLOBAL uchar* dstb, i64 dsto, GLOBAL uchar* dksb, i64 dkso, GLOBAL uchar* dvsb,
    i64 dvso, GLOBAL uchar* qrb, i64 qro, GLOBAL uchar* krb, i64 kro, GLOBAL uchar* partb, i64 parto,
    GLOBAL uchar* wsb, i64 wso, GLOBAL uchar* dk0b, i64 dk0o, GLOBAL uchar* ddpb, i64 ddpo)
{
    const i64 item = GID(0);
    if (item >= R * H * blocks)
        return;
    const i64 r = item / (H * blocks), rest = item - r * H * blocks, h = rest / blocks, blk = rest - h * blocks;
    m3_io io = m3_io_base(H, P, N, A, G, carry, dt_real, param_real, dtb, dto);
    io = m3_with_coeffs(io, adtb, adto, trb, tro);
    io = m3_with_values(io, has_d, has_z, vb, vo, zb, zo, skb, sko);
    io = m3_with_state(io, stb, sto, ksb, kso, vsb, vso);
    io = m3_with_rows(io, varlen, cub, cuo, slotted, slb, slo);
    const m3b_scratch sc = m3b_scratch_of(qrb, qro, krb, kro, partb, parto);
    GLOBAL const real* dk_state = AT(real, dksb, dkso);
    GLOBAL real* part = sc.part + blk * T * H * m3b_part_size(N);
    const m3_row row = m3_row_of(io, r, h, S);
    for (i64 tok = row.first; tok < row.end; ++tok) {
        GLOBAL real* pt = part + (tok * H + h) * m3b_part_size(N);
        const int last = blk == 0 && carry && tok == row.end - 1;
        pt[0] = pt[1] = pt[2] = (real)0;
        for (i64 n = 0; n < N; ++n) {
            pt[3 + n] = (real)0;
            pt[3 + N + n] = last ? dk_state[(row.entry * H + h) * N + n] : (real)0;
        }
    }
    GLOBAL real* dk0 = AT(real, dk0b, dk0o) + ((r * blocks + blk) * H + h) * N;
    for (i64 n = 0; n < N; ++n)
        dk0[n] = (real)0;
    real dd = (real)0;
    const i64 p0 = blk * per, p1 = p0 + per < P ? p0 + per : P;
    for (i64 p = p0; p < p1 && row.end > row.first; p += M3B_PB)
        m3b_rows_back(io, m3b_grads_of(gob, goo, dvb, dvo, dzb, dzo), sc, row, p,
                      p1 - p < M3B_PB ? (int)(p1 - p) : M3B_PB, S, part, m3b_workspace(AT(real, wsb, wso), item, S, N),
                      dk0, AT(real, dstb, dsto), AT(real, dvsb, dvso), &dd);
    AT(real, ddpb, ddpo)[(r * blocks + blk) * H + h] = dd;
}

/* Token tok, head h (item GID(0) = tok*H + h): the blocks' partials summed; d_adt and d_trap stored, dt's share of
 * beta and gamma kept (dts); the turns undone, the biased q's and k's gradients written over qr and kr, each
 * angle's own gradient over th. `direct`: the partials' first three are d_adt, beta''s and gamma's gradients
 * (kernels/mamba3_chunk_backward.cl's), not the shares of alpha, beta, gamma. */
KERNEL mamba3_backward_tokens(i64 R, i64 S, i64 H, i64 P, i64 N, i64 A, i64 G, int carry, int dt_real, int param_real,
    GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* adtb, i64 adto, GLOBAL uchar* trb, i64 tro, i64 T, i64 blocks,
    GLOBAL uchar* dadtb, i64 dadto, GLOBAL uchar* dtrb, i64 dtro, GLOBAL uchar* qrb, i64 qro, GLOBAL uchar* krb,
    i64 kro, GLOBAL uchar* partb, i64 parto, GLOBAL uchar* thb, i64 tho, GLOBAL uchar* dtsb, i64 dtso, int direct)
{
    const i64 e = GID(0), tok = e / H, h = e - tok * H;
    if (tok >= T)
        return;
    const m3_io io = m3_with_coeffs(m3_io_base(H, P, N, A, G, carry, dt_real, param_real, dtb, dto), adtb, adto,
                                    trb, tro);
    const m3b_scratch sc = m3b_scratch_of(qrb, qro, krb, kro, partb, parto);
    GLOBAL real* th = AT(real, thb, tho);
    const i64 W = m3b_part_size(N);
    real dal = (real)0, dbe = (real)0, dga = (real)0;
    for (i64 b = 0; b < blocks; ++b) {
        GLOBAL const real* sp = sc.part + (b * T * H + e) * W;
        dal += sp[0];
        dbe += sp[1];
        dga += sp[2];
    }
    const m3_coeffs cf = m3_coeffs_at(io, tok, h);
    const real lambda = (real)1 / ((real)1 + rlx_exp(-load_any(io.trap, e, dt_real)));
    const real dbp = direct ? dbe : dbe * cf.alpha; /* beta = beta' * alpha, beta' = (1 - lambda) * dt */
    store_any(AT(uchar, dadtb, dadto), e, dt_real, direct ? dal : (dal + dbe * ((real)1 - lambda) * cf.dt) * cf.alpha);
    store_any(AT(uchar, dtrb, dtro), e, dt_real, (dga - dbp) * cf.dt * lambda * ((real)1 - lambda));
    AT(real, dtsb, dtso)[e] = dbp * ((real)1 - lambda) + dga * lambda;
    for (i64 i = 0; i < N / 2; ++i) {
        const i64 at = e * N + 2 * i;
        real dq0 = (real)0, dq1 = (real)0, dk0 = (real)0, dk1 = (real)0;
        for (i64 b = 0; b < blocks; ++b) {
            GLOBAL const real* pt = sc.part + (b * T * H + e) * W + 3 + 2 * i;
            dq0 += pt[0];
            dq1 += pt[1];
            dk0 += pt[N];
            dk1 += pt[N + 1];
        }
        if (i < A) {
            const m3_turn t = m3_sincos(th[e * A + i]);
            th[e * A + i] = sc.qr[at] * dq1 - sc.qr[at + 1] * dq0 + sc.kr[at] * dk1 - sc.kr[at + 1] * dk0;
            const real q0 = t.c * dq0 + t.s * dq1, k0 = t.c * dk0 + t.s * dk1;
            dq1 = t.c * dq1 - t.s * dq0;
            dk1 = t.c * dk1 - t.s * dk0;
            dq0 = q0;
            dk0 = k0;
        }
        sc.qr[at] = dq0;
        sc.qr[at + 1] = dq1;
        sc.kr[at] = dk0;
        sc.kr[at + 1] = dk1;
    }
}

/* Row and head GID(0) = r*H + h: each angle's gradient summed from the last token back (d_angles, and dt's share
 * added to dts, then d_dt stored); with carry d_angle_state and d_k_state (the blocks' shares summed). */
KERNEL mamba3_backward_angles(i64 R, i64 S, i64 H, i64 P, i64 N, i64 A, i64 G, int carry, int dt_real, int param_real,
    GLOBAL uchar* dtb, i64 dto, int varlen, GLOBAL uchar* cub, i64 cuo, int slotted, GLOBAL uchar* slb, i64 slo,
    GLOBAL uchar* anb, i64 ano, i64 blocks, GLOBAL uchar* ddtb, i64 ddto, GLOBAL uchar* danb, i64 dano,
    GLOBAL uchar* dasb, i64 daso, GLOBAL uchar* dksb, i64 dkso, GLOBAL uchar* thb, i64 tho, GLOBAL uchar* dk0b,
    i64 dk0o, GLOBAL uchar* dtsb, i64 dtso)
{
    const i64 rh = GID(0), r = rh / H, h = rh - r * H;
    if (rh >= R * H)
        return;
    m3_io io = m3_with_rows(m3_io_base(H, P, N, A, G, carry, dt_real, param_real, dtb, dto), varlen, cub, cuo, slotted,
                            slb, slo);
    io.angles = AT(uchar, anb, ano);
    GLOBAL real* dangle_state = AT(real, dasb, daso);
    GLOBAL const real* th = AT(real, thb, tho);
    GLOBAL real* dts = AT(real, dtsb, dtso);
    const m3_row row = m3_row_of(io, r, h, S);
    const i64 head = row.entry * H + h;
    for (i64 i = 0; i < A; ++i) {
        real dth = carry ? dangle_state[head * A + i] : (real)0;
        for (i64 tok = row.end - 1; tok >= row.first; --tok) {
            const i64 e = tok * H + h;
            dth += th[e * A + i];
            const real tn = m3_tanh(load_any(io.angles, e * A + i, dt_real)), dt = load_any(io.dt, e, dt_real);
            store_any(AT(uchar, danb, dano), e * A + i, dt_real, dth * M3_PI * ((real)1 - tn * tn) * dt);
            dts[e] += dth * M3_PI * tn;
        }
        if (carry && row.end > row.first)
            dangle_state[head * A + i] = dth;
    }
    for (i64 tok = row.first; tok < row.end; ++tok)
        store_any(AT(uchar, ddtb, ddto), tok * H + h, dt_real, dts[tok * H + h]);
    if (!carry || row.end == row.first)
        return;
    for (i64 n = 0; n < N; ++n) {
        real sum = (real)0;
        for (i64 b = 0; b < blocks; ++b)
            sum += AT(real, dk0b, dk0o)[((r * blocks + b) * H + h) * N + n];
        AT(real, dksb, dkso)[head * N + n] = sum;
    }
}

/* out[i] = sum over k < K of part[o*outer + k*kstride + w], i = o*inner + w < M, in that order: d_q and d_k over the
 * heads of a group, d_q_bias and d_k_bias over the tokens, d_d over rows and blocks. Stored in the compute type
 * when is_real (a parameter in f32 beside a 16-bit thunk), else in the dtype. */
KERNEL mamba3_backward_reduce(i64 M, i64 K, i64 inner, i64 outer, i64 kstride, int is_real, GLOBAL uchar* pb, i64 po,
                              GLOBAL uchar* ob, i64 oo)
{
    const i64 i = GID(0);
    if (i >= M)
        return;
    const i64 o = i / inner, w = i - o * inner;
    GLOBAL const real* part = AT(real, pb, po) + o * outer + w;
    real sum = (real)0;
    for (i64 k = 0; k < K; ++k)
        sum += part[k * kstride];
    store_any(AT(uchar, ob, oo), i, is_real, sum);
}

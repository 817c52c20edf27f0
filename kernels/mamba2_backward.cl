/* The chunked backward of mamba2 (ABI.md §9 over §4's mamba2 and its §8 fields) at the gpu target: the SSD
 * form of the forward (kernels/ssm.cl's mamba2_chunk_*) in reverse, chunks of M2_Q steps, for batch rows
 * (packed sequences keep kernels/ssm_backward.cl's step walk), whose ssm_backward_reduce sums the partials
 * written here. kernels/ssm_fields.cl and kernels/ssm.cl (whose chunk helpers it calls) precede this text.
 *
 * Per (row, head) the forward is S_t = exp(l_t) S_{t-1} + u_t (x) b_t, y_t = S_t c_t, with l = dt*a and
 * u = dt*x, then out = (y + d*x) * silu(z); gy = d_dst * silu(z) is the gradient of y. In a chunk, with
 * L_i = sum_{s<=i} l_s from its start, S_in the state entering it and D the gradient of the one leaving it:
 *   A[i][j] = exp(L_i - L_j) (c_i . b_j),   B[i][j] = exp(L_i - L_j) (gy_i . u_j)   for j <= i, else 0,
 *   du_j = sum_{i>=j} A[i][j] gy_i + exp(L_last - L_j) D b_j,
 *   db_j = sum_{i>=j} B[i][j] c_i + exp(L_last - L_j) D^T u_j,
 *   dc_i = sum_{j<=i} B[i][j] b_j + exp(L_i) S_in^T gy_i,
 *   dL_i = gy_i . y_i - u_i . du_i (plus <D, S_leaving> at the chunk's last step), dl_j = sum_{i>=j} dL_i,
 * and the gradient of the state entering chunk k is exp(L_last) D + sum_i exp(L_i) gy_i (x) c_i.
 * Launches (launches/mamba2_backward.py): the forward's own mamba2_chunk_state (each chunk's state from zero
 * and its decay; not with SSM_RESERVE), then
 *   mamba2_backward_dstate  gy into scratch, and each chunk's sum_i exp(L_i) gy_i (x) c_i (mamba2_chunk_state's
 *                           product, its MMA variant with RLX_MMA); with SSM_RESERVE each chunk's decay too;
 *   mamba2_backward_pass    per state element of a (row, head): the states entering each chunk (forward; with
 *                           SSM_RESERVE read from the saved forward, ABI.md §9.1, whose chunks are these: the
 *                           plan defines it only when M2_Q is the reserve's chunk length) and the gradients of
 *                           those leaving each (backward), d_state;
 *   mamba2_backward_chunk   per chunk the scores A, B (M2_Q x M2_Q, LOCAL, in turn) and every token's gradients;
 *                           with SSM_RESERVE A and y (the output before d and z) read from the saved forward; its
 *                           RLX_MMA variant takes the state products D b, S_in c, x D and gy S_in on the tensor
 *                           cores first (m2b_state_products_mma_barrier), into scratch where the FMA loops read them,
 *                           and the scores C.B^T (m2b_scores_mma_barrier).
 * Each product above is a loop of multiply-adds over a tile's inner dimension, summed in one fixed order (the
 * same bytes every run); loops over i <= j or i >= j are bounded, never masked by a zero, so a NaN reaches only
 * the gradients that depend on it. Scratch is in the compute type (f32 for 16-bit thunks). */
#if defined(RLX_TARGET_GPU) && !defined(RLX_NEED_FP64) /* f64: the step walk (LOCAL scores past 48 KiB) */
#if SSM_VARLEN
#error "mamba2's chunked backward takes batch rows; packed sequences (cu_seqlens) take the step walk"
#endif

/* grow[i] = exp(L_i) and fade[i] = exp(L_last - L_i) for the chunk's steps, from m2_stage_decay_barrier's Ls, lane i
 * for step i; every lane calls it (a barrier). */
INLINE_FN void m2b_decays_barrier(LOCAL_PTR real* grow, LOCAL_PTR real* fade, LOCAL_PTR const real* Ls, int lane,
                                  int steps)
{
    if (lane < steps) {
        grow[lane] = rlx_exp(Ls[lane]);
        fade[lane] = rlx_exp(Ls[steps - 1] - Ls[lane]);
    }
    BARRIER();
}

/* One work-group of M2_LANES lanes per (chunk slot, M2_PT rows of P), as mamba2_chunk_state's: gy of the chunk's
 * tokens and rows ([T][HD][P] in scratch), and the chunk's share of the gradient of the state entering it,
 * sum_i exp(L_i) gy_i (x) c_i ([P, N] per slot), through mamba2_chunk_state's product (its MMA variant with
 * RLX_MMA) with exp(L_i) gy_i for the weighted x and c for b. With SSM_RESERVE (no mamba2_chunk_state launched)
 * also the chunk's decay exp(L_last) into eb, as mamba2_chunk_state writes it. */
KERNEL mamba2_backward_dstate(i64 S, i64 HD, i64 P, i64 N, i64 G, i64 K,
                              GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* ab, i64 ao, GLOBAL uchar* cb, i64 co,
                              GLOBAL uchar* biasb, i64 biaso, GLOBAL uchar* zb, i64 zo, GLOBAL uchar* gb, i64 go,
                              GLOBAL uchar* gyb, i64 gyo, GLOBAL uchar* ddb, i64 ddo, GLOBAL uchar* eb, i64 eo,
                              real lo, real hi)
{
    LOCAL real dts[M2_Q], Ls[M2_Q];
    M2_LOCAL m2_op_t gw[M2_Q * M2_PT];
    const int lane = (int)LID(0);
    const m2_tile tile = m2_tile_of(GROUP(0), P, K, S, 0, 0); /* batch rows: no chunk table */
    const int steps = (int)tile.chunk.steps;
    const i64 t0 = tile.chunk.first, hh = tile.head, p0 = tile.p0, grp = hh / (HD / G);
    const real a = PLOAD(AT(param_t, ab, ao), hh), bias = ssm_param(AT(param_t, biasb, biaso), hh, SSM_BIAS);
    m2_stage_decay_barrier(dts, Ls, lane, steps, AT(store_t, dtb, dto), t0, HD, hh, a, bias, lo, hi);
    GLOBAL const store_t* g = AT(store_t, gb, go);
    for (int e = lane; e < M2_Q * M2_PT; e += M2_LANES) { /* zero past the chunk's steps, which MMA tiles cover */
        const int s = e / M2_PT, p = e - s * M2_PT;
        real w = (real)0;
        if (s < steps && p0 + p < P) {
            const i64 at = ((t0 + s) * HD + hh) * P + p0 + p;
            const real gy = SSM_Z ? LOAD(g, at) * ssm_silu(LOAD(AT(store_t, zb, zo), at)) : LOAD(g, at);
            AT(real, gyb, gyo)[at] = gy;
            w = rlx_exp(Ls[s]) * gy;
        }
        gw[e] = M2_OP(w);
    }
    if (SSM_RESERVE && p0 == 0 && lane == 0 && steps > 0)
        AT(real, eb, eo)[tile.slot] = rlx_exp(Ls[steps - 1]);
    BARRIER();
    GLOBAL real* own = AT(real, ddb, ddo) + tile.slot * P * N;
    GLOBAL const store_t* c = AT(store_t, cb, co);
#ifdef RLX_MMA
    MMA_LOCAL mma_t cs[M2_Q * M2_NW];
    MMA_LOCAL float out[M2_PT * M2_NW];
    m2_state_mma_barrier(own, gw, cs, out, c, t0, steps, G, grp, N, P, p0, lane);
#else
    m2_state_product(own, gw, c, t0, steps, G, grp, N, P, p0, lane);
#endif
}

/* One work-item per state element of one (row, head): in chunk order, each chunk's own state (from
 * mamba2_chunk_state, in sb) becomes the state entering it, and the row's final state goes to fb (with
 * SSM_RESERVE the states leaving each chunk are the saved forward's, at rsb, chunks of RQ = M2_Q); then in
 * reverse each chunk's own share (in ddb) becomes the gradient of the state leaving it, from d_state's entry
 * (SSM_CARRY; else zero), which is rewritten as the initial state's gradient. */
KERNEL mamba2_backward_pass(i64 R, i64 S, i64 HD, i64 P, i64 N, i64 K,
                            GLOBAL uchar* stb, i64 sto, GLOBAL uchar* slb, i64 slo, GLOBAL uchar* dstb, i64 dsto,
                            GLOBAL uchar* sb, i64 so, GLOBAL uchar* eb, i64 eo, GLOBAL uchar* ddb, i64 ddo,
                            GLOBAL uchar* fb, i64 fo, GLOBAL uchar* rsb, i64 rso, i64 RQ)
{
    const i64 e = GID(0), pn = P * N;
    if (e >= R * HD * pn)
        return;
    const i64 rh = e / pn, el = e - rh * pn, r = rh / HD, hh = rh - r * HD;
    const i64 chunks = (S + M2_Q - 1) / M2_Q, k0 = hh * K + r * chunks;
    GLOBAL real* st = AT(real, sb, so) + k0 * pn + el;
    GLOBAL real* dd = AT(real, ddb, ddo) + k0 * pn + el;
    GLOBAL const real* dec = AT(real, eb, eo) + k0;
    const i64 entry = (ssm_slot(r, AT(int, slb, slo)) * HD + hh) * pn + el;
    const ssm_saved sv = ssm_saved_of(rsb, rso, r, S, RQ, HD, hh, pn); /* read only with SSM_RESERVE */
    real s = SSM_CARRY ? SLOAD(AT(state_t, stb, sto), entry) : (real)0;
    for (i64 k = 0; k < chunks; ++k) {
        const real leaving = SSM_RESERVE ? sv.at[k * sv.stride + el] : dec[k] * s + st[k * pn];
        st[k * pn] = s;
        s = leaving;
    }
    AT(real, fb, fo)[rh * pn + el] = s;
    real d = SSM_CARRY ? SLOAD(AT(state_t, dstb, dsto), entry) : (real)0;
    for (i64 k = chunks - 1; k >= 0; --k) {
        const real own = dd[k * pn];
        dd[k * pn] = d;
        d = dec[k] * d + own;
    }
    if (SSM_CARRY)
        SSTORE(AT(state_t, dstb, dsto), entry, d);
}

/* Where one chunk's tensors are, each at its first step: x, gy, d_dst, z, d_x, d_z and the saved y (a step's P
 * values `xs` apart), b, c (`bs` apart), the states entering (sin) and leaving (send) and the leaving one's gradient
 * (dout), each [P, N], the saved scores A (w, [M2_Q][M2_Q]), and the RLX_MMA variant's state products D.b (ends)
 * and S_in.c (starts) of each step and row (`xs` apart, in scratch); y and w are read only with SSM_RESERVE, ends
 * and starts only with RLX_MMA. */
typedef struct {
    GLOBAL const store_t* x;
    GLOBAL const real* gy;
    GLOBAL const store_t* g;
    GLOBAL const store_t* z;
    GLOBAL store_t* dx;
    GLOBAL store_t* dz;
    GLOBAL const store_t* b;
    GLOBAL const store_t* c;
    GLOBAL const real* sin;
    GLOBAL const real* send;
    GLOBAL const real* dout;
    GLOBAL const real* y;
    GLOBAL const real* w;
    GLOBAL real* ends;
    GLOBAL real* starts;
    i64 xs, bs, P, N;
    real dv;
} m2b_tensors;

/* One of the chunk's scores into LOCAL, sm[i][j] (zero for j > i and past the chunk's steps), M2_Q lanes over the
 * entries: with `grads` B[i][j] = exp(L_i - L_j) dt_j (gy_i . x_j) over P, else A[i][j] = exp(L_i - L_j) (c_i . b_j)
 * over N (with SSM_RESERVE the saved forward's). The two take turns in one array (a second one would pass OpenCL's
 * 32 KiB of local memory): the first barrier waits for the readers of the previous one. */
INLINE_FN void m2b_scores_barrier(LOCAL_PTR real* sm, int grads, m2b_tensors at, int steps, LOCAL_PTR const real* dts,
                                  LOCAL_PTR const real* Ls, int lane)
{
    BARRIER();
    for (int e = lane; e < M2_Q * M2_Q; e += M2_Q) {
        const int i = e / M2_Q, j = e - i * M2_Q;
        real v = (real)0;
        if (j <= i && i < steps && SSM_RESERVE && !grads) {
            v = at.w[e];
        } else if (j <= i && i < steps) {
            if (grads) {
                for (i64 p = 0; p < at.P; ++p)
                    v += at.gy[i * at.xs + p] * LOAD(at.x, j * at.xs + p);
                v *= dts[j];
            } else {
                for (i64 n = 0; n < at.N; ++n)
                    v += LOAD(at.c, i * at.bs + n) * LOAD(at.b, j * at.bs + n);
            }
            v *= rlx_exp(Ls[i] - Ls[j]);
        }
        sm[e] = v;
    }
    BARRIER();
}

#define M2B_J 8 /* steps whose sums over p lane 0 .. 3*M2B_J-1 take together (LOCAL: 3 * M2B_J * M2_Q reals) */

/* The chunk's P side, M2_Q lanes over its rows (lane p, p + M2_Q, ...), step after step: for step j and row p
 * du = sum_{i>=j} A[i][j] gy_i + exp(L_last - L_j) D b_j and y = sum_{i<=j} A[j][i] dt_i x_i + exp(L_j) S_in c_j
 * (am: A; with SSM_RESERVE the saved y), d_x and d_z; and each step's sums over p, dL = gy . y - u . du, du . x
 * and gy . x, into dls, das, dds: each lane's share into red, summed in lane order, M2B_J steps at a time (two
 * barriers). Every lane calls it. */
INLINE_FN void m2b_rows_barrier(m2b_tensors at, int steps, LOCAL_PTR const real* am, LOCAL_PTR const real* dts,
                                LOCAL_PTR const real* grow, LOCAL_PTR const real* fade, LOCAL_PTR real* red,
                                LOCAL_PTR real* dls, LOCAL_PTR real* das, LOCAL_PTR real* dds, int lane)
{
    for (int j0 = 0; j0 < steps; j0 += M2B_J) {
        for (int jj = 0; jj < M2B_J; ++jj) {
            const int j = j0 + jj;
            real dl = (real)0, dux = (real)0, gx = (real)0;
            for (i64 p = lane; p < (j < steps ? at.P : 0); p += M2_Q) {
                real du = (real)0, y = (real)0, to_end = (real)0, from_start = (real)0;
                for (int i = j; i < steps; ++i)
                    du += am[i * M2_Q + j] * at.gy[i * at.xs + p];
                if (!SSM_RESERVE)
                    for (int i = 0; i <= j; ++i)
                        y += am[j * M2_Q + i] * dts[i] * LOAD(at.x, i * at.xs + p);
#ifdef RLX_MMA /* the tensor cores' (m2b_state_products_mma_barrier) */
                to_end = at.ends[j * at.xs + p];
                if (!SSM_RESERVE)
                    from_start = at.starts[j * at.xs + p];
#else
                for (i64 n = 0; n < at.N; ++n) {
                    to_end += at.dout[p * at.N + n] * LOAD(at.b, j * at.bs + n);
                    if (!SSM_RESERVE)
                        from_start += at.sin[p * at.N + n] * LOAD(at.c, j * at.bs + n);
                }
#endif
                du += fade[j] * to_end;
                y = SSM_RESERVE ? at.y[j * at.xs + p] : y + grow[j] * from_start;
                const i64 xi = j * at.xs + p;
                const real xv = LOAD(at.x, xi), gy = at.gy[xi];
                STORE(at.dx, xi, dts[j] * du + (SSM_D ? at.dv * gy : (real)0));
                if (SSM_Z) { /* out = (y + d*x) * silu(z) */
                    const real zv = LOAD(at.z, xi), sz = sigmoid_r(zv), pre = SSM_D ? y + at.dv * xv : y;
                    STORE(at.dz, xi, LOAD(at.g, xi) * pre * sz * ((real)1 + zv * ((real)1 - sz)));
                }
                dl += gy * y - dts[j] * xv * du;
                dux += du * xv;
                gx += gy * xv;
            }
            red[(jj * 3) * M2_Q + lane] = dl;
            red[(jj * 3 + 1) * M2_Q + lane] = dux;
            red[(jj * 3 + 2) * M2_Q + lane] = gx;
        }
        BARRIER();
        if (lane < 3 * M2B_J && j0 + lane / 3 < steps) {
            real sum = (real)0;
            for (int l = 0; l < M2_Q; ++l)
                sum += red[lane * M2_Q + l];
            const int j = j0 + lane / 3, k = lane - lane / 3 * 3;
            LOCAL_PTR real* out = k == 0 ? dls : k == 1 ? das : dds;
            out[j] = sum;
        }
        BARRIER();
    }
}

/* The chunk's N side, M2_Q lanes over the state columns (lane n, n + M2_Q, ...): this head's d_b and d_c of every
 * step at db and dc (a step's N values `stride` apart), from bm: B; with RLX_MMA their state products x.D and
 * gy.S_in are there already (m2b_state_products_mma_barrier). */
INLINE_FN void m2b_columns(m2b_tensors at, int steps, LOCAL_PTR const real* bm, LOCAL_PTR const real* dts,
                           LOCAL_PTR const real* grow, LOCAL_PTR const real* fade, GLOBAL real* db, GLOBAL real* dc,
                           i64 stride, int lane)
{
    for (int j = 0; j < steps; ++j)
        for (i64 n = lane; n < at.N; n += M2_Q) {
            real gb = (real)0, gc = (real)0, leaving = (real)0, entering = (real)0;
            for (int i = j; i < steps; ++i)
                gb += bm[i * M2_Q + j] * LOAD(at.c, i * at.bs + n);
            for (int i = 0; i <= j; ++i)
                gc += bm[j * M2_Q + i] * LOAD(at.b, i * at.bs + n);
#ifdef RLX_MMA /* the tensor cores' (m2b_state_products_mma_barrier), where they go */
            leaving = db[j * stride + n];
            entering = dc[j * stride + n];
#else
            for (i64 p = 0; p < at.P; ++p) {
                leaving += LOAD(at.x, j * at.xs + p) * at.dout[p * at.N + n];
                entering += at.gy[j * at.xs + p] * at.sin[p * at.N + n];
            }
#endif
            db[j * stride + n] = gb + fade[j] * dts[j] * leaving;
            dc[j * stride + n] = gc + grow[j] * entering;
        }
}

/* dls[steps-1] += <D, S_leaving>, the leaving state's share of the chunk's last dL: the lanes' shares through red,
 * summed in lane order (two barriers; every lane calls it). */
INLINE_FN void m2b_end_dot_barrier(m2b_tensors at, int steps, LOCAL_PTR real* red, LOCAL_PTR real* dls, int lane)
{
    real sum = (real)0;
    for (i64 e = lane; e < (steps > 0 ? at.P * at.N : 0); e += M2_Q)
        sum += at.dout[e] * at.send[e];
    red[lane] = sum;
    BARRIER();
    if (lane == 0 && steps > 0) {
        real all = (real)0;
        for (int l = 0; l < M2_Q; ++l)
            all += red[l];
        dls[steps - 1] += all;
    }
    BARRIER();
}

#ifdef RLX_MMA
#if M2_Q != 64
#error "the MMA variant of mamba2_backward_chunk tiles with its two warps: a 16-step row tile of 32 steps each"
#endif
/* Split operands, v = hi + lo (hi = v rounded to the operand type, lo = the rest, rounded as it enters the product),
 * the products hi.hi + hi.lo + lo.hi: rounded once, the states D and S_in cost the log-decay's gradient (dL = gy.y -
 * u.du, whose terms cancel, summed over the chunk into d_a and the dt bias's gradient) past the conformance bounds
 * (emulated on PoCL, B1 S100 H2 P20 N40 with every field: f16 d_a NMSE 1.1e-6 against the bound 5e-7, bf16 d_dt_bias
 * 7.3e-5 against 5e-5, TF32 d_a 1.3e-4 against bf16's 5e-5); split, the FMA path's error. A 16-bit thunk's own x, b
 * and c are exact (lo = 0: no lo.hi product); f32's are not at TF32, whose hi rounds as the tensor cores round
 * (mma_hi, kernels/mma_split.cl). */
/* The state products' operands (m2b_tensors' x, gy, b, c, the state entering, the leaving one's gradient, with their
 * strides) and outputs: D.b and S_in.c per (step, row) at ends and starts (`xs` apart), x.D and gy.S_in per (step,
 * state column) at db and dc (`bs` apart: d_b's and d_c's partials, each step's G * N apart as b's). */
typedef struct {
    GLOBAL const store_t* x;
    GLOBAL const real* gy;
    GLOBAL const store_t* b;
    GLOBAL const store_t* c;
    GLOBAL const real* sin;
    GLOBAL const real* dout;
    GLOBAL real* ends;
    GLOBAL real* starts;
    GLOBAL real* db;
    GLOBAL real* dc;
    i64 xs, bs, P, N;
} m2b_state_at;
/* The chunk's four state products on the tensor cores, each into its place: D.b (ends) and S_in.c (starts; not with
 * SSM_RESERVE, whose y is saved) per step and row of P ([steps][N] x [N][P]), x.D and gy.S_in per step and state
 * column into d_b's and d_c's partials at db and dc (a step's `bs` apart; [steps][P] x [P][N]), which m2b_columns
 * completes. By 32 steps r0.. and slices of 16 output columns: warp w accumulates the 16-step row tile w over the sum
 * in slices of 16 staged as operands (rows [32][16], then their lo part where split: gy's, at TF32 every one's;
 * cols [16 of the sum][16], then their lo part; zero past the chunk's steps, the sum and the columns; one
 * accumulator a warp: two took TF32 past 128 registers), stores it f32 in prod ([32][16]), whose entries within the
 * steps and the columns go out. Every lane calls it (barriers, the first before any staging). */
INLINE_FN void m2b_state_products_mma_barrier(m2b_state_at at, int steps, LOCAL_PTR mma_t* rows,
                                              LOCAL_PTR mma_t* cols, LOCAL_PTR float* prod, int lane)
{
    const int w = MMA_WARP(lane);
    PRAGMA_NO_UNROLL
    for (int k = 0; k < 4; ++k) {
        const int pside = k < 2, lo_rows = RLX_MMA == 2 || k == 3; /* P columns (ends, starts) or N (db, dc) */
        const i64 width = k == 1 && SSM_RESERVE ? 0 : pside ? at.P : at.N, sum = pside ? at.N : at.P;
        const i64 os = pside ? at.xs : at.bs;
        GLOBAL const real* st = k == 0 || k == 2 ? at.dout : at.sin; /* [P][N] */
        GLOBAL real* out = k == 0 ? at.ends : k == 1 ? at.starts : k == 2 ? at.db : at.dc;
        for (int r0 = 0; r0 < (width > 0 ? steps : 0); r0 += 32)
            for (i64 c0 = 0; c0 < width; c0 += 16) {
                mma_acc acc;
                mma_zero(&acc);
                for (i64 k0 = 0; k0 < sum; k0 += 16) {
                    BARRIER(); /* the previous slice's operands and products are read no more */
                    PRAGMA_NO_UNROLL
                    for (int e = lane; e < 32 * 16; e += M2_Q) {
                        const int s = r0 + e / 16;
                        const i64 i = k0 + e % 16;
                        real v = (real)0;
                        if (s < steps && i < sum)
                            v = k == 0 ? LOAD(at.b, s * at.bs + i) : k == 1 ? LOAD(at.c, s * at.bs + i)
                                       : k == 2 ? LOAD(at.x, s * at.xs + i) : at.gy[s * at.xs + i];
                        const float hi = mma_hi(v);
                        rows[e] = TO_MMA(hi);
                        if (lo_rows)
                            rows[32 * 16 + e] = TO_MMA(v - hi);
                    }
                    PRAGMA_NO_UNROLL
                    for (int e = lane; e < 256; e += M2_Q) {
                        const int j = e / 16, kk = e - j * 16; /* an output column, a step of the sum */
                        const i64 i = k0 + kk, c = c0 + j;
                        const real v = i < sum && c < width ? (pside ? st[c * at.N + i] : st[i * at.N + c]) : (real)0;
                        const float hi = mma_hi(v);
                        cols[kk * 16 + j] = TO_MMA(hi);
                        cols[256 + kk * 16 + j] = TO_MMA(v - hi);
                    }
                    BARRIER();
                    PRAGMA_NO_UNROLL /* hi.hi, hi.lo, lo.hi: unrolled, their operand fragments took sm_90 past 128 registers */
                    for (int h = 0; h < (lo_rows ? 3 : 2); ++h)
                        mma_tile(&acc, MMA_ROW, rows + (h == 2 ? 32 * 16 : 0) + w * 256, 16, MMA_ROW,
                                 cols + (h == 1 ? 256 : 0), 16);
                }
                mma_store(prod + w * 256, &acc, 16);
                BARRIER();
                PRAGMA_NO_UNROLL
                for (int e = lane; e < 32 * 16; e += M2_Q) {
                    const int s = r0 + e / 16, j = e % 16;
                    if (s < steps && c0 + j < width)
                        out[s * os + c0 + j] = prod[e];
                }
            }
    }
}
#endif

#ifdef RLX_MMA
/* The scores A[i][j] = exp(L_i - L_j) (c_i . b_j) into sm on the tensor cores, as m2b_scores_barrier leaves them: the
 * 16 x 16 tiles (ti, tj) on and below the diagonal within the chunk's steps (mma_lower_tile's order), one a warp at a
 * time, each over N in slices of 16 staged per warp (its tile's 16 rows of c in rows, of b in cols; a 16-bit thunk's
 * own, exact; at TF32 each then its lo part, the products hi.hi + lo.hi + hi.lo), stored f32 in the warp's prod
 * tile, then written to sm decayed for j <= i < steps, zero elsewhere (an entry above the diagonal is dropped, never
 * multiplied: a NaN there reaches nothing). B = gy . x stays m2b_scores_barrier's: on the tensor cores too, it took
 * sm_90 past 128 registers. Every lane calls it (barriers). */
INLINE_FN void m2b_scores_mma_barrier(LOCAL_PTR real* sm, m2b_tensors at, int steps, LOCAL_PTR const real* Ls,
                                      LOCAL_PTR mma_t* rows, LOCAL_PTR mma_t* cols, LOCAL_PTR float* prod, int lane)
{
    const int w = MMA_WARP(lane), l = lane - w * 32, tiles = M2_Q / 16 * (M2_Q / 16 + 1) / 2;
    LOCAL_PTR mma_t* a = rows + w * 256; /* the warp's [16][16] of c, its lo part 512 on (rows, cols: [2][2][256]) */
    LOCAL_PTR mma_t* b = cols + w * 256;
    BARRIER(); /* the previous scores' readers are done */
    for (int e = lane; e < M2_Q * M2_Q; e += M2_Q) /* the tiles above the diagonal */
        if ((e % M2_Q) / 16 > e / M2_Q / 16)
            sm[e] = (real)0;
    PRAGMA_NO_UNROLL
    for (int t0 = 0; t0 < tiles; t0 += 2) {
        int tj = 0;
        const int t = t0 + w, ti = t < tiles ? mma_lower_tile(t, &tj) : 0, has = t < tiles && ti * 16 < steps;
        mma_acc acc;
        mma_zero(&acc);
        PRAGMA_NO_UNROLL
        for (i64 k0 = 0; k0 < at.N; k0 += 16) {
            BARRIER(); /* the previous slice's operands are read no more */
            PRAGMA_NO_UNROLL
            for (int e = l; has && e < 256; e += 32) {
                const int r = e / 16, i = ti * 16 + r, j = tj * 16 + r;
                const i64 k = k0 + e % 16;
                const real va = k < at.N && i < steps ? LOAD(at.c, i * at.bs + k) : (real)0;
                const real vb = k < at.N && j < steps ? LOAD(at.b, j * at.bs + k) : (real)0;
                const float ha = mma_hi(va), hb = mma_hi(vb);
                a[e] = TO_MMA(ha);
                b[e] = TO_MMA(hb);
                if (RLX_MMA == 2) {
                    a[512 + e] = TO_MMA(va - ha);
                    b[512 + e] = TO_MMA(vb - hb);
                }
            }
            BARRIER();
            PRAGMA_NO_UNROLL /* hi.hi, then at TF32 lo.hi and hi.lo */
            for (int h = 0; has && h < (RLX_MMA == 2 ? 3 : 1); ++h)
                mma_tile(&acc, MMA_ROW, a + (h == 1 ? 512 : 0), 16, MMA_COL, b + (h == 2 ? 512 : 0), 16);
        }
        if (has)
            mma_store(prod + w * 256, &acc, 16);
        BARRIER();
        PRAGMA_NO_UNROLL
        for (int e = l; t < tiles && e < 256; e += 32) {
            const int i = ti * 16 + e / 16, j = tj * 16 + e % 16;
            sm[i * M2_Q + j] = j <= i && i < steps ? prod[w * 256 + e] * rlx_exp(Ls[i] - Ls[j]) : (real)0;
        }
    }
    BARRIER();
}
#endif

/* One work-group of M2_Q lanes per chunk slot (over the rows of P, over the state columns, then a lane per step):
 * d_x, d_z, d_dt of the chunk's tokens; this head's share of d_b and d_c ([HD/G][T][G][N] in scratch, summed over
 * the group's heads by ssm_backward_reduce); the chunk's partials of d_a, d_d and the dt bias's gradient ([K][HD],
 * K: the chunk slots of a head). sb: the states entering each chunk; fb: each (row, head)'s final state; ddb: the
 * gradients of the states leaving each chunk; with SSM_RESERVE ryb: the saved forward's y (at ryo) and scores (at
 * rwo). */
KERNEL mamba2_backward_chunk(i64 S, i64 T, i64 HD, i64 P, i64 N, i64 G, i64 K,
                             GLOBAL uchar* xb, i64 xo, GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* ab, i64 ao,
                             GLOBAL uchar* bb, i64 bo, GLOBAL uchar* cb, i64 co, GLOBAL uchar* biasb, i64 biaso,
                             GLOBAL uchar* skb, i64 sko, GLOBAL uchar* zb, i64 zo, GLOBAL uchar* gb, i64 go,
                             GLOBAL uchar* dxb, i64 dxo, GLOBAL uchar* ddtb, i64 ddto, GLOBAL uchar* dzb, i64 dzo,
                             GLOBAL uchar* gyb, i64 gyo, GLOBAL uchar* sb, i64 so, GLOBAL uchar* fb, i64 fo,
                             GLOBAL uchar* ddb, i64 ddo, GLOBAL uchar* pbcb, i64 pbo, i64 pco,
                             GLOBAL uchar* psb, i64 pao, i64 pdo, i64 pbiaso, GLOBAL uchar* ryb, i64 ryo, i64 rwo,
                             GLOBAL uchar* mpb, i64 meo, i64 mso, real lo, real hi)
{
    LOCAL real dts[M2_Q], Ls[M2_Q], grow[M2_Q], fade[M2_Q], sm[M2_Q * M2_Q];
    LOCAL real dls[M2_Q], das[M2_Q], dds[M2_Q], dbs[M2_Q], red[3 * M2B_J * M2_Q];
    const int lane = (int)LID(0);
    const i64 slot = GROUP(0), hh = slot / K, hpg = HD / G, grp = hh / hpg, pn = P * N, chunks = (S + M2_Q - 1) / M2_Q;
    const m2_chunk ch = m2_chunk_at(slot - hh * K, K, S, 0, 0); /* batch rows: no chunk table */
    const int steps = (int)ch.steps, last = slot - hh * K - ch.row * chunks == chunks - 1;
    const i64 xat = (ch.first * HD + hh) * P, bat = (ch.first * G + grp) * N;
    const i64 part = (((hh - grp * hpg) * T + ch.first) * G + grp) * N; /* step j's at j * G * N */
    GLOBAL real* db = AT(real, pbcb, pbo) + part;
    GLOBAL real* dc = AT(real, pbcb, pco) + part;
#ifdef RLX_MMA /* the state products first, their pointers alone (the others' live past them took sm_90 past 128
                * registers) */
    MMA_LOCAL mma_t rows[2 * 32 * 16]; /* the state products' [32][16] and lo part; the scores' two warps' tiles */
    MMA_LOCAL mma_t cols[2 * 32 * 16]; /* the state products' [16][16] and lo part; the scores' two warps' tiles */
    MMA_LOCAL float prod[32 * 16];
    const m2b_state_at mine = {AT(store_t, xb, xo) + xat, AT(real, gyb, gyo) + xat, AT(store_t, bb, bo) + bat,
                               AT(store_t, cb, co) + bat, AT(real, sb, so) + slot * pn, AT(real, ddb, ddo) + slot * pn,
                               AT(real, mpb, meo) + xat, AT(real, mpb, mso) + xat, db, dc, HD * P, G * N, P, N};
    m2b_state_products_mma_barrier(mine, steps, rows, cols, prod, lane);
#endif
    const m2b_tensors at = {AT(store_t, xb, xo) + xat, AT(real, gyb, gyo) + xat, AT(store_t, gb, go) + xat,
                            AT(store_t, zb, zo) + xat, AT(store_t, dxb, dxo) + xat, AT(store_t, dzb, dzo) + xat,
                            AT(store_t, bb, bo) + bat, AT(store_t, cb, co) + bat, AT(real, sb, so) + slot * pn,
                            last ? AT(real, fb, fo) + (ch.row * HD + hh) * pn : AT(real, sb, so) + (slot + 1) * pn,
                            AT(real, ddb, ddo) + slot * pn, AT(real, ryb, ryo) + xat,
                            AT(real, ryb, rwo) + ((slot - hh * K) * HD + hh) * M2_Q * M2_Q, AT(real, mpb, meo) + xat,
                            AT(real, mpb, mso) + xat, HD * P, G * N, P, N, ssm_param(AT(param_t, skb, sko), hh, SSM_D)};
    const real a = PLOAD(AT(param_t, ab, ao), hh), bias = ssm_param(AT(param_t, biasb, biaso), hh, SSM_BIAS);
    m2_stage_decay_barrier(dts, Ls, lane, steps, AT(store_t, dtb, dto), ch.first, HD, hh, a, bias, lo, hi);
    m2b_decays_barrier(grow, fade, Ls, lane, steps);
#ifdef RLX_MMA
    if (SSM_RESERVE)
        m2b_scores_barrier(sm, 0, at, steps, dts, Ls, lane);
    else
        m2b_scores_mma_barrier(sm, at, steps, Ls, rows, cols, prod, lane);
#else
    m2b_scores_barrier(sm, 0, at, steps, dts, Ls, lane);
#endif
    m2b_rows_barrier(at, steps, sm, dts, grow, fade, red, dls, das, dds, lane);
    m2b_end_dot_barrier(at, steps, red, dls, lane);
    m2b_scores_barrier(sm, 1, at, steps, dts, Ls, lane);
    m2b_columns(at, steps, sm, dts, grow, fade, db, dc, G * N, lane);
    const int j = lane;
    if (j < steps) {
        real dl = (real)0; /* d of the step's log-decay: the dL of every step from it on */
        for (int i = steps - 1; i >= j; --i)
            dl += dls[i];
        const i64 di = (ch.first + j) * HD + hh;
        const real grad = ssm_delta_grad(LOAD(AT(store_t, dtb, dto), di), dl * a + das[j], bias, lo, hi);
        STORE(AT(store_t, ddtb, ddto), di, grad);
        das[j] = dl * dts[j];
        dbs[j] = grad;
    }
    BARRIER();
    if (lane == 0) {
        real sa = (real)0, sd = (real)0, sbias = (real)0;
        for (int i = 0; i < steps; ++i) {
            sa += das[i];
            sd += dds[i];
            sbias += dbs[i];
        }
        const i64 pat = (slot - hh * K) * HD + hh;
        AT(real, psb, pao)[pat] = sa;
        AT(real, psb, pdo)[pat] = sd;
        AT(real, psb, pbiaso)[pat] = sbias;
    }
}
#endif

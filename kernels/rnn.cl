/* Recurrent family (ABI.md §3): the input projection runs first as body.cl's gemm over all timesteps
 * (xw, compute type, bias folded in except GRU's b_hh); these kernels run the recurrence (the cpu
 * target's persistent kernel projects the input itself).
 * Per layer, the directions' blocks are consecutive: xw [dirs][B*S][G*H], w_hh [dirs][G*H][H],
 * b_hh [dirs][G*H], state [dirs][B][H].
 * A program holds one op: RNN_GATES, the gate count G (4 lstm, 3 gru, 1 rnn), is a compile-time variant
 * of the launch (launches/rnn.py), so every gate loop has a constant trip count and the cell has no
 * branch on the op. */

#if RNN_GATES != 4 && RNN_GATES != 3 && RNN_GATES != 1
#error "RNN_GATES (a launch define: the op's gate count) must be 4 (lstm), 3 (gru) or 1 (rnn)"
#endif
#define RNN_HAS_CELL (RNN_GATES == 4) /* lstm carries a cell state c beside h */

INLINE_FN real rnn_sigmoid(real x) { return (real)1 / ((real)1 + rlx_exp(-x)); }
/* tanh(x) = sign(x) (1 - 2 / (exp(2|x|) + 1)), odd-series near 0 where that form loses precision. */
INLINE_FN real rnn_tanh(real x)
{
    if (sizeof(real) != 4)
        return tanh(x);
    const real a = x < (real)0 ? -x : x;
    const real t = a < (real)0.0625 ? a * ((real)1 + a * a * ((real)-0.333333333 + a * a * (real)0.133333333))
                                    : (real)1 - (real)2 / (rlx_exp((real)2 * a) + (real)1);
    return x < (real)0 ? -t : t;
}

/* The cell's nonlinearities, one function per activation slot (ABI.md's names): f drives the gates
 * (lstm i, f, o; gru r, z; rnn's only one, tanh or relu by the launch's flag), g the candidate (lstm's
 * cell input, gru's n), h lstm's output o * h(c). */
INLINE_FN real rnn_act_f(real v, int relu)
{
#if RNN_GATES == 1
    return relu ? (v < (real)0 ? (real)0 : v) : rnn_tanh(v);
#else
    return rnn_sigmoid(v);
#endif
}
INLINE_FN real rnn_act_g(real v) { return rnn_tanh(v); }
INLINE_FN real rnn_act_h(real v) { return rnn_tanh(v); }

/* One unit's new h from its gate pre-activations in the op's gate order: xz = W_ih x + bias (input side),
 * hz = W_hh h (+ b_hh for gru; recurrent side). h is the unit's previous output (gru); *c its cell state
 * (lstm), read and updated. */
INLINE_FN real rnn_cell(const real* xz, const real* hz, real h, real* c, int relu)
{
#if RNN_GATES == 4
    const real i = rnn_act_f(xz[0] + hz[0], relu), f = rnn_act_f(xz[1] + hz[1], relu);
    const real g = rnn_act_g(xz[2] + hz[2]), o = rnn_act_f(xz[3] + hz[3], relu);
    *c = f * *c + i * g;
    return o * rnn_act_h(*c);
#elif RNN_GATES == 3
    const real r = rnn_act_f(xz[0] + hz[0], relu), z = rnn_act_f(xz[1] + hz[1], relu);
    const real n = rnn_act_g(xz[2] + r * hz[2]); /* the reset scales W_hn h + b_hn */
    return ((real)1 - z) * n + z * h;
#else
    return rnn_act_f(xz[0] + hz[0], relu);
#endif
}

/* xz[g] = xw[row][g*H + j]: the input side of unit j's gates, row = b*S + tt. */
INLINE_FN void rnn_input_gates(real* xz, GLOBAL const real* xw, i64 row, i64 j, i64 H)
{
    PRAGMA_UNROLL
    for (int g = 0; g < RNN_GATES; ++g)
        xz[g] = xw[row * RNN_GATES * H + (i64)g * H + j];
}

/* Unit j of batch row b at step tt from its gate pre-activations: the cell, then its c (cst) and h
 * (hout, both [B][H] at `at` = b*H + j) and the output element out_at stored (o_real: out is scratch in
 * the compute type, else arena storage). */
INLINE_FN void rnn_unit_out(const real* xz, const real* hz, int relu, i64 at, GLOBAL const real* hin,
                            GLOBAL real* hout, GLOBAL real* cst, GLOBAL uchar* out, i64 out_at, int o_real)
{
    real c = cst[at];
    const real h = rnn_cell(xz, hz, hin[at], &c, relu);
    cst[at] = c;
    hout[at] = h;
    store_any(out, out_at, o_real, h);
}

/* wT[dir][q][g][j] = W[dir][g*H+j][q] in the compute type (j padded to HP with zeros) for a weight of
 * G*H rows of K (W_hh: K = H; W_ih: K = the layer's input size), once per layer, so that the step
 * kernels read contiguous runs of units. Rows are G*HP + RNN_WPAD reals apart: the pad keeps a run's
 * successive rows off one cache set (a 4 KiB stride aliases in L1). */
KERNEL rnn_w_t(i64 H, i64 HP, i64 K, GLOBAL uchar* wb, i64 wo, GLOBAL uchar* tb, i64 to)
{
    const i64 col = GID(0), dir = GID(2);
    if (col >= RNN_GATES * HP)
        return;
    const i64 g = col / HP, j = col - g * HP;
    GLOBAL const uchar* w = AT(uchar, wb, wo);
    GLOBAL real* wt = AT(real, tb, to);
    for (i64 q = GID(1); q < K; q += GSIZE(1))  /* rows past grid y (capped at the gpu target) */
        wt[(dir * K + q) * (RNN_GATES * HP + RNN_WPAD) + col] =
            j < H ? LOAD(w, (dir * RNN_GATES * H + g * H + j) * K + q) : (real)0;
}

/* The per-step kernel: h_out = cell(xw_t + h_in . W_hh^T (+ b_hh)) for one timestep, over
 * whT [dirs][H][G*HP + RNN_WPAD] (each gate's row padded to HP, a multiple of RNN_JB, with zeros).
 * h ping-pongs between hin and hout. Both target shapes share the arguments. */

#ifdef RLX_TARGET_GPU
#if RNN_JB % RNN_GU != 0 || RNN_GK < RNN_RB
#error "rnn gpu tuning: RNN_JB must be a multiple of RNN_GU and RNN_GK at least RNN_RB"
#endif
/* gpu target: item (u, slice)'s share of unit j's recurrent sums for RNN_RB batch rows (rows[r]):
 * acc[r*G + g] = sum over q = slice, slice + RNN_GK, ... < H of hin[rows[r]][q] * wT[q][g*HP + j], so a
 * warp reads runs of RNN_GU consecutive whT reals (coalesced) and each weight serves RNN_RB rows. */
INLINE_FN void rnn_gpu_partial_sums(real* acc, const i64* rows, int slice, i64 j, i64 H, i64 HP,
                                    GLOBAL const real* wt, GLOBAL const real* hin)
{
    PRAGMA_UNROLL
    for (int k = 0; k < RNN_RB * RNN_GATES; ++k)
        acc[k] = (real)0;
    for (i64 q = slice; q < H; q += RNN_GK) {
        GLOBAL const real* wq = wt + q * (RNN_GATES * HP + RNN_WPAD) + j;
        real w[RNN_GATES];
        PRAGMA_UNROLL
        for (int g = 0; g < RNN_GATES; ++g)
            w[g] = wq[g * HP];
        PRAGMA_UNROLL
        for (int r = 0; r < RNN_RB; ++r) {
            const real hv = hin[rows[r] * H + q];
            PRAGMA_UNROLL
            for (int g = 0; g < RNN_GATES; ++g)
                acc[r * RNN_GATES + g] += hv * w[g];
        }
    }
}

#else
/* cpu target: the per-step kernel's register block by gate count, RNN_STEP_RB batch rows x RNN_STEP_JB
 * consecutive units per item (RNN_STEP_RB * G * RNN_STEP_JB sums: about 12 AVX2 vectors, like the gemm's
 * block). */
#if RNN_GATES == 4
#define RNN_STEP_RB RNN_RB_G4
#define RNN_STEP_JB RNN_JB_G4
#elif RNN_GATES == 3
#define RNN_STEP_RB RNN_RB_G3
#define RNN_STEP_JB RNN_JB_G3
#else
#define RNN_STEP_RB RNN_RB_G1
#define RNN_STEP_JB RNN_JB_G1
#endif
#if RNN_JB % RNN_STEP_JB != 0 || RNN_STEP_RB > RNN_RB_MAX
#error "rnn cpu tuning: RNN_JB must be a multiple of RNN_JB_G<gates> and RNN_RB_MAX at least RNN_RB_G<gates>"
#endif

/* cpu target: acc[(r*G + g)*RNN_JB + u] = (has_bias ? bias[g*H + j0+u] : 0) + sum_{q<K} v_r[q] wT[q][g*HP + j0+u]
 * for nr <= RNN_RB_MAX rows, every gate and nj <= RNN_JB units from j0, where v_r[q] = v[rows[r]*v_rs + v_at + q]
 * (scratch in the compute type, or arena storage: v_real). A rank-1 update per q: a contiguous run of a
 * staged transpose's row (rows G*HP + RNN_WPAD reals apart) shared by the nr rows, each row's value
 * broadcast. The loops run to the compile-time maxima with nr and nj as guards, constants at every
 * call: PoCL unrolls the loops before a call's constants reach them (bounded by nr and nj they stayed
 * loops: gru's prefill 1.45x, rnn's 1.9x slower), so literal trip counts unroll, the guards fold once
 * inlined, the sums stay in registers and the runs become vector loads and FMAs. */
INLINE_FN void rnn_rank1_sums(real* acc, int nr, int nj, i64 j0, i64 H, i64 HP, GLOBAL const uchar* bias,
                              int has_bias, GLOBAL const real* wT, i64 K, GLOBAL const uchar* v, const i64* rows,
                              i64 v_rs, i64 v_at, int v_real)
{
    PRAGMA_UNROLL
    for (int r = 0; r < RNN_RB_MAX; ++r)
        PRAGMA_UNROLL
        for (int g = 0; g < RNN_GATES; ++g)
            PRAGMA_UNROLL
            for (int u = 0; u < RNN_JB; ++u)
                if (r < nr && u < nj)
                    acc[(r * RNN_GATES + g) * RNN_JB + u] = (has_bias && j0 + u < H) ? LOAD(bias, g * H + j0 + u) : (real)0;
    GLOBAL const real* wq = wT + j0;
    for (i64 q = 0; q < K; ++q) {
        real w[RNN_GATES * RNN_JB], vq[RNN_RB_MAX];
        PRAGMA_UNROLL
        for (int g = 0; g < RNN_GATES; ++g)
            PRAGMA_UNROLL
            for (int u = 0; u < RNN_JB; ++u)
                if (u < nj)
                    w[g * RNN_JB + u] = wq[g * HP + u];
        wq += RNN_GATES * HP + RNN_WPAD;
        PRAGMA_UNROLL
        for (int r = 0; r < RNN_RB_MAX; ++r)
            if (r < nr)
                vq[r] = load_any(v, rows[r] * v_rs + v_at + q, v_real);
        PRAGMA_UNROLL
        for (int r = 0; r < RNN_RB_MAX; ++r)
            PRAGMA_UNROLL
            for (int g = 0; g < RNN_GATES; ++g)
                PRAGMA_UNROLL
                for (int u = 0; u < RNN_JB; ++u)
                    if (r < nr && u < nj)
                        acc[(r * RNN_GATES + g) * RNN_JB + u] += vq[r] * w[g * RNN_JB + u];
    }
}

/* cpu target: the cells of nr batch rows from b0 (those past B skipped) and nj units from j0 < H at step
 * tt, from their recurrent sums acc (rnn_rank1_sums' layout) and xw; c, h and the output (element
 * (b*S + tt)*o_rs + o_col + j of out) stored. A full run of units is straight-line code per unit, so
 * its nj cells vectorize across units; a run past H goes unit by unit. */
INLINE_FN void rnn_cells(const real* acc, int nr, int nj, i64 b0, i64 j0, i64 tt, int relu, i64 B, i64 S, i64 H,
                         GLOBAL const real* xw, GLOBAL const real* hin, GLOBAL real* hout, GLOBAL real* cst,
                         GLOBAL uchar* out, int o_real, i64 o_col, i64 o_rs)
{
    for (int r = 0; r < nr; ++r) {
        const i64 b = b0 + r;
        if (b >= B)
            break;
        if (j0 + nj <= H) {
            GLOBAL const real* xr = xw + (b * S + tt) * RNN_GATES * H + j0;
            GLOBAL real* cr = cst + b * H + j0;
            GLOBAL const real* hr = hin + b * H + j0;
            real hv[RNN_JB];
            for (int u = 0; u < nj; ++u) {
                real xz[RNN_GATES], hz[RNN_GATES];
                PRAGMA_UNROLL
                for (int g = 0; g < RNN_GATES; ++g) {
                    xz[g] = xr[g * H + u];
                    hz[g] = acc[(r * RNN_GATES + g) * RNN_JB + u];
                }
                real c = cr[u];
                hv[u] = rnn_cell(xz, hz, hr[u], &c, relu);
                cr[u] = c;
            }
            PRAGMA_UNROLL
            for (int u = 0; u < nj; ++u)
                hout[b * H + j0 + u] = hv[u];
            for (int u = 0; u < nj; ++u)
                store_any(out, (b * S + tt) * o_rs + o_col + j0 + u, o_real, hv[u]);
            continue;
        }
        for (int u = 0; u < nj && j0 + u < H; ++u) {
            const i64 j = j0 + u;
            real xz[RNN_GATES], hz[RNN_GATES];
            rnn_input_gates(xz, xw, b * S + tt, j, H);
            PRAGMA_UNROLL
            for (int g = 0; g < RNN_GATES; ++g)
                hz[g] = acc[(r * RNN_GATES + g) * RNN_JB + u];
            rnn_unit_out(xz, hz, relu, b * H + j, hin, hout, cst, out, (b * S + tt) * o_rs + o_col + j, o_real);
        }
    }
}
#endif

KERNEL rnn_step(int relu, i64 B, i64 S, i64 H, i64 t,
                GLOBAL uchar* xwb, i64 xwo, GLOBAL uchar* wtb, i64 wto, GLOBAL uchar* bhb, i64 bho, int has_bhh,
                GLOBAL uchar* hib, i64 hio, GLOBAL uchar* hob, i64 hoo, GLOBAL uchar* cb, i64 co,
                GLOBAL uchar* ob, i64 oo, int o_real, i64 o_rs)
{
#ifdef RLX_TARGET_GPU
    LOCAL real part[RNN_GK][RNN_RB][RNN_GATES][RNN_GU];
    const int u = (int)LID(0), slice = (int)LID(1);
    const i64 j = GROUP(0) * RNN_GU + u;  /* j < HP: whT's zero padding covers j >= H */
#else
    const i64 b0 = GID(1) * RNN_STEP_RB, j0 = GID(0) * RNN_STEP_JB;
    if (b0 >= B || j0 >= H)
        return;
#endif
    const i64 dir = GROUP(2), HP = (H + RNN_JB - 1) / RNN_JB * RNN_JB;
    GLOBAL const real* xw = AT(real, xwb, xwo + dir * B * S * RNN_GATES * H * (i64)sizeof(real));
    GLOBAL const real* wt = AT(real, wtb, wto + dir * (RNN_GATES * HP + RNN_WPAD) * H * (i64)sizeof(real));
    GLOBAL const uchar* bhh = AT(uchar, bhb, bho + dir * RNN_GATES * H * (i64)sizeof(store_t));
    GLOBAL const real* hin = AT(real, hib, hio + dir * B * H * (i64)sizeof(real));
    GLOBAL real* hout = AT(real, hob, hoo + dir * B * H * (i64)sizeof(real));
    GLOBAL real* cst = AT(real, cb, co + dir * B * H * (i64)sizeof(real));
    GLOBAL uchar* out = AT(uchar, ob, oo);
    const i64 tt = dir ? S - 1 - t : t;
#ifdef RLX_TARGET_GPU
    /* gpu target: a work-group of RNN_GU consecutive units (LID 0) x RNN_GK slices of the reduction
     * (LID 1) for RNN_RB batch rows; the slices' partial sums meet in LOCAL memory, where item (u, r)
     * finishes row r's cell. Row blocks past grid y are strided over by whole work-groups (barriers
     * stay uniform). */
    for (i64 rb = GROUP(1); rb < (B + RNN_RB - 1) / RNN_RB; rb += GSIZE(1) / RNN_GK) {
        const i64 b0 = rb * RNN_RB;
        i64 rows[RNN_RB];  /* rows past B repeat the last one; their sums are dropped */
        PRAGMA_UNROLL
        for (int r = 0; r < RNN_RB; ++r)
            rows[r] = b0 + r < B ? b0 + r : B - 1;
        real acc[RNN_RB * RNN_GATES];
        rnn_gpu_partial_sums(acc, rows, slice, j, H, HP, wt, hin);
        PRAGMA_UNROLL
        for (int r = 0; r < RNN_RB; ++r)
            PRAGMA_UNROLL
            for (int g = 0; g < RNN_GATES; ++g)
                part[slice][r][g][u] = acc[r * RNN_GATES + g];
        BARRIER();
        const i64 b = b0 + slice;
        if (slice < RNN_RB && b < B && j < H) {
            real xz[RNN_GATES], hz[RNN_GATES];
            PRAGMA_UNROLL
            for (int g = 0; g < RNN_GATES; ++g) {
                real sum = has_bhh ? LOAD(bhh, g * H + j) : (real)0;
                for (int k = 0; k < RNN_GK; ++k)
                    sum += part[k][slice][g][u];
                hz[g] = sum;
            }
            rnn_input_gates(xz, xw, b * S + tt, j, H);
            rnn_unit_out(xz, hz, relu, b * H + j, hin, hout, cst, out, (b * S + tt) * o_rs + dir * H + j, o_real);
        }
        BARRIER();  /* part is reused by the next row block */
    }
#else
    /* cpu target: item GID(0) takes RNN_STEP_JB units from j0 for RNN_STEP_RB batch rows from b0 */
    i64 rows[RNN_STEP_RB];  /* rows past B repeat the last one; their sums are dropped */
    for (int r = 0; r < RNN_STEP_RB; ++r)
        rows[r] = b0 + r < B ? b0 + r : B - 1;
    real acc[RNN_STEP_RB * RNN_GATES * RNN_JB];
    rnn_rank1_sums(acc, RNN_STEP_RB, RNN_STEP_JB, j0, H, HP, bhh, has_bhh, wt, H, (GLOBAL const uchar*)hin, rows, H,
                   0, 1);
    rnn_cells(acc, RNN_STEP_RB, RNN_STEP_JB, b0, j0, tt, relu, B, S, H, xw, hin, hout, cst, out, o_real, dir * H,
              o_rs);
#endif
}

/* Initial state of one layer: h0/c0 slices (storage) into scratch (compute type), or zeros. */
KERNEL rnn_state_in(int carry, i64 n, GLOBAL uchar* h0b, i64 h0o, GLOBAL uchar* c0b, i64 c0o,
                    GLOBAL uchar* hb, i64 ho, GLOBAL uchar* cb, i64 co)
{
    const i64 i = GID(0);
    if (i >= n)
        return;
    AT(real, hb, ho)[i] = carry ? LOAD(AT(uchar, h0b, h0o), i) : (real)0;
    AT(real, cb, co)[i] = (carry && RNN_HAS_CELL) ? LOAD(AT(uchar, c0b, c0o), i) : (real)0;
}

/* Final state of one layer back into h0/c0 in place. */
KERNEL rnn_state_out(i64 n, GLOBAL uchar* hb, i64 ho, GLOBAL uchar* cb, i64 co,
                     GLOBAL uchar* h0b, i64 h0o, GLOBAL uchar* c0b, i64 c0o)
{
    const i64 i = GID(0);
    if (i >= n)
        return;
    STORE(AT(uchar, h0b, h0o), i, AT(real, hb, ho)[i]);
    if (RNN_HAS_CELL)
        STORE(AT(uchar, c0b, c0o), i, AT(real, cb, co)[i]);
}

/* The whole sequence of one layer in one launch; state moves in from / out to h0, c0 when carrying. */
#ifdef RLX_TARGET_GPU
/* gpu target: one work-group of H items per (batch row, direction) keeps h in local memory; item j
 * computes unit j's hz[g] = b_hh[g*H + j] + sum_q W_hh[g*H + j][q] h[q] straight from W_hh. */
KERNEL rnn_persist(int relu, i64 B, i64 S, i64 H, int carry,
                   GLOBAL uchar* xwb, i64 xwo, GLOBAL uchar* whb, i64 who, GLOBAL uchar* bhb, i64 bho, int has_bhh,
                   GLOBAL uchar* h0b, i64 h0o, GLOBAL uchar* c0b, i64 c0o,
                   GLOBAL uchar* ob, i64 oo, int o_real, i64 o_rs)
{
    const i64 j = LID(0), b = GROUP(1), dir = GROUP(2);
    GLOBAL const real* xw = AT(real, xwb, xwo + dir * B * S * RNN_GATES * H * (i64)sizeof(real));
    GLOBAL const uchar* whh = AT(uchar, whb, who + dir * RNN_GATES * H * H * (i64)sizeof(store_t));
    GLOBAL const uchar* bhh = AT(uchar, bhb, bho + dir * RNN_GATES * H * (i64)sizeof(store_t));
    GLOBAL uchar* h0 = AT(uchar, h0b, h0o + (dir * B + b) * H * (i64)sizeof(store_t));
    GLOBAL uchar* c0 = AT(uchar, c0b, c0o + (dir * B + b) * H * (i64)sizeof(store_t));
    GLOBAL uchar* out = AT(uchar, ob, oo);
    LOCAL real hs[RNN_PERSIST_MAX];
    real h = carry ? LOAD(h0, j) : (real)0;
    real c = (carry && RNN_HAS_CELL) ? LOAD(c0, j) : (real)0;
    hs[j] = h;
    BARRIER();
    for (i64 t = 0; t < S; ++t) {
        const i64 tt = dir ? S - 1 - t : t;
        real xz[RNN_GATES], hz[RNN_GATES];
        rnn_input_gates(xz, xw, b * S + tt, j, H);
        for (int g = 0; g < RNN_GATES; ++g) {
            GLOBAL const uchar* wrow = whh + ((i64)g * H + j) * H * (i64)sizeof(store_t);
            real s = has_bhh ? LOAD(bhh, g * H + j) : (real)0;
            for (i64 q = 0; q < H; ++q)
                s += LOAD(wrow, q) * hs[q];
            hz[g] = s;
        }
        h = rnn_cell(xz, hz, h, &c, relu);
        BARRIER();
        hs[j] = h;
        store_any(out, (b * S + tt) * o_rs + dir * H + j, o_real, h);
        BARRIER();
    }
    if (carry) {
        STORE(h0, j, h);
        if (RNN_HAS_CELL)
            STORE(c0, j, c);
    }
}
#else
/* cpu target: one work-item (a work-group of one) per (batch row, direction) runs every step of that row,
 * the input projection included: per step and run of RNN_JB units, xw of the run (bias + x . W_ih^T over
 * wiT [dirs][I][G*HP + RNN_WPAD], staged like W_hh^T by rnn_w_t) then the recurrence, h ping-ponging
 * between the row's h in hb0 and hb1 and c in cst (scratch, compute type). So a layer is one launch and a
 * decode step needs no gemm. A single item needs no barrier, which keeps PoCL's code register-blocked
 * (measured: a work-group of items over the units with a barrier per step ran 1.3-2x slower), and the
 * rows, which share nothing, run on as many cores as there are. Arguments as rnn_step's, without the
 * step index, plus carry, h0, c0, the input x (arena storage or compute-type scratch: x_real; rows of
 * I), wiT and the input bias. */
KERNEL rnn_persist(int relu, i64 B, i64 S, i64 H, int carry,
                   GLOBAL uchar* xwb, i64 xwo, GLOBAL uchar* wtb, i64 wto, GLOBAL uchar* bhb, i64 bho, int has_bhh,
                   GLOBAL uchar* h0b, i64 h0o, GLOBAL uchar* c0b, i64 c0o,
                   GLOBAL uchar* hb0, i64 ho0, GLOBAL uchar* hb1, i64 ho1, GLOBAL uchar* cb, i64 co,
                   i64 I, GLOBAL uchar* xb, i64 xo, int x_real, GLOBAL uchar* wib, i64 wio,
                   GLOBAL uchar* bib, i64 bio,
                   GLOBAL uchar* ob, i64 oo, int o_real, i64 o_rs)
{
    const i64 b0 = GROUP(1), dir = GROUP(2), HP = (H + RNN_JB - 1) / RNN_JB * RNN_JB;
    const i64 rows[1] = {b0};
    GLOBAL real* xw = AT(real, xwb, xwo + dir * B * S * RNN_GATES * H * (i64)sizeof(real)); /* written, then read */
    GLOBAL const real* wt = AT(real, wtb, wto + dir * (RNN_GATES * HP + RNN_WPAD) * H * (i64)sizeof(real));
    GLOBAL const uchar* bhh = AT(uchar, bhb, bho + dir * RNN_GATES * H * (i64)sizeof(store_t));
    GLOBAL uchar* h0 = AT(uchar, h0b, h0o + dir * B * H * (i64)sizeof(store_t));
    GLOBAL uchar* c0 = AT(uchar, c0b, c0o + dir * B * H * (i64)sizeof(store_t));
    GLOBAL real* hs0 = AT(real, hb0, ho0 + dir * B * H * (i64)sizeof(real));
    GLOBAL real* hs1 = AT(real, hb1, ho1 + dir * B * H * (i64)sizeof(real));
    GLOBAL real* cst = AT(real, cb, co + dir * B * H * (i64)sizeof(real));
    GLOBAL uchar* out = AT(uchar, ob, oo);
    GLOBAL const uchar* x = AT(uchar, xb, xo);
    GLOBAL const real* wi = AT(real, wib, wio + dir * (RNN_GATES * HP + RNN_WPAD) * I * (i64)sizeof(real));
    GLOBAL const uchar* bias = AT(uchar, bib, bio + dir * RNN_GATES * H * (i64)sizeof(store_t));
    for (i64 i = b0 * H; i < (b0 + 1) * H; ++i) {
        hs0[i] = carry ? LOAD(h0, i) : (real)0;
        cst[i] = carry && RNN_HAS_CELL ? LOAD(c0, i) : (real)0;
    }
    for (i64 t = 0; t < S; ++t) {
        const i64 tt = dir ? S - 1 - t : t;
        GLOBAL const real* hin = t % 2 ? hs1 : hs0;
        GLOBAL real* hout = t % 2 ? hs0 : hs1;
        for (i64 j0 = 0; j0 < H; j0 += RNN_JB) {
            real acc[RNN_GATES * RNN_JB];
            rnn_rank1_sums(acc, 1, RNN_JB, j0, H, HP, bias, 1, wi, I, x, rows, S * I, tt * I, x_real);
            for (int g = 0; g < RNN_GATES; ++g)
                for (int u = 0; u < RNN_JB && j0 + u < H; ++u)
                    xw[(b0 * S + tt) * RNN_GATES * H + g * H + j0 + u] = acc[g * RNN_JB + u];
            rnn_rank1_sums(acc, 1, RNN_JB, j0, H, HP, bhh, has_bhh, wt, H, (GLOBAL const uchar*)hin, rows, H, 0, 1);
            rnn_cells(acc, 1, RNN_JB, b0, j0, tt, relu, B, S, H, xw, hin, hout, cst, out, o_real, dir * H, o_rs);
        }
    }
    if (carry)
        for (i64 i = b0 * H; i < (b0 + 1) * H; ++i) {
            STORE(h0, i, S % 2 ? hs1[i] : hs0[i]);
            if (RNN_HAS_CELL)
                STORE(c0, i, cst[i]);
        }
}
#endif

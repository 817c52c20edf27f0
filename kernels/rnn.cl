/* Recurrent family (ABI.md §3): the input projection runs first as body.cl's gemm over all timesteps
 * (xw, compute type, bias folded in except GRU's b_hh); these kernels run the recurrence (the cpu
 * target's persistent kernel projects the input itself).
 * Per layer, the directions' blocks are consecutive: xw [dirs][B*S][G*H], w_hh [dirs][G*H][H],
 * b_hh [dirs][G*H], state [dirs][B][H]. */

#define OP_LSTM 0
#define OP_GRU 1
#define OP_RNN 2
/* the op is fixed by the gate count (lstm 4, gru 3, rnn 1): a compile-time op folds cell's branches */
#define RNN_OP_OF(NG) ((NG) == 4 ? OP_LSTM : (NG) == 3 ? OP_GRU : OP_RNN)

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

/* One unit's new h from its gate pre-activations: xz = W_ih x + bias, hz = W_hh h (+ b_hh for GRU). */
INLINE_FN real cell(int op, int relu, const real* xz, const real* hz, real h, real* c)
{
    if (op == OP_LSTM) {
        const real i = rnn_sigmoid(xz[0] + hz[0]), f = rnn_sigmoid(xz[1] + hz[1]);
        const real g = rnn_tanh(xz[2] + hz[2]), o = rnn_sigmoid(xz[3] + hz[3]);
        *c = f * *c + i * g;
        return o * rnn_tanh(*c);
    }
    if (op == OP_GRU) {
        const real r = rnn_sigmoid(xz[0] + hz[0]), z = rnn_sigmoid(xz[1] + hz[1]);
        const real n = rnn_tanh(xz[2] + r * hz[2]);
        return ((real)1 - z) * n + z * h;
    }
    const real v = xz[0] + hz[0];
    return relu ? (v < (real)0 ? (real)0 : v) : rnn_tanh(v);
}

/* hz[g] = b_hh[g*H+j] + sum_k W_hh[g*H+j, k] * h[k]. A macro, not a function: h is LOCAL in the
 * persistent kernel and GLOBAL in the per-step one, and OpenCL 1.2 has no generic address space. */
#define HH_DOTS(hz, h)                                                           \
    for (int g = 0; g < G; ++g) {                                                \
        GLOBAL const uchar* wrow = whh + ((i64)g * H + j) * H * (i64)sizeof(store_t); \
        real s = has_bhh ? LOAD(bhh, g * H + j) : (real)0;                       \
        for (i64 q = 0; q < H; ++q)                                              \
            s += LOAD(wrow, q) * h[q];                                           \
        hz[g] = s;                                                               \
    }

/* xz[g] for unit j of batch row b at time tt. */
#define XW_GATES(xz)                                                             \
    for (int g = 0; g < G; ++g)                                                  \
        xz[g] = xw[(b * S + tt) * G * H + (i64)g * H + j];

/* wT[dir][q][g][j] = W[dir][g*H+j][q] in the compute type (j padded to HP with zeros) for a weight of
 * G*H rows of K (W_hh: K = H; W_ih: K = the layer's input size), once per layer, so that the step
 * kernels read contiguous runs of units. Rows are G*HP + RNN_WPAD reals apart: the pad keeps a run's
 * successive rows off one cache set (a 4 KiB stride aliases in L1). */
KERNEL rnn_w_t(i64 G, i64 H, i64 HP, i64 K, GLOBAL uchar* wb, i64 wo, GLOBAL uchar* tb, i64 to)
{
    const i64 col = GID(0), dir = GID(2);
    if (col >= G * HP)
        return;
    const i64 g = col / HP, j = col - g * HP;
    GLOBAL const uchar* w = AT(uchar, wb, wo);
    GLOBAL real* wt = AT(real, tb, to);
    for (i64 q = GID(1); q < K; q += GSIZE(1))  /* rows past grid y (capped at the gpu target) */
        wt[(dir * K + q) * (G * HP + RNN_WPAD) + col] = j < H ? LOAD(w, (dir * G * H + g * H + j) * K + q) : (real)0;
}

/* Both shapes of the per-step kernel end a unit the same way: unit j of batch row b at step tt from its
 * gate pre-activations xz (input side) and hz (recurrent side): the cell, then c, h and the output stored. */
#define RNN_UNIT_OUT(NG, b, j, xz, hz)                                                          \
    do {                                                                                        \
        real c_ = cst[(b) * H + (j)];                                                           \
        const real h_ = cell(RNN_OP_OF(NG), relu, xz, hz, hin[(b) * H + (j)], &c_);             \
        cst[(b) * H + (j)] = c_;                                                                \
        hout[(b) * H + (j)] = h_;                                                               \
        store_any(out, ((b) * S + tt) * o_rs + dir * H + (j), o_real, h_);                      \
    } while (0)

/* BODY(NG) with the gate count a compile-time constant: 4 (lstm), 3 (gru) or 1 (rnn), by the runtime G. */
#define RNN_BY_GATES(BODY)                                                                      \
    if (G == 4)                                                                                 \
        BODY(4)                                                                                 \
    else if (G == 3)                                                                            \
        BODY(3)                                                                                 \
    else                                                                                        \
        BODY(1)

/* The per-step kernel: h_out = cell(xw_t + h_in . W_hh^T (+ b_hh)) for one timestep, over
 * whT [dirs][H][G*HP + RNN_WPAD] (each gate's row padded to HP, a multiple of RNN_JB, with zeros).
 * h ping-pongs between hin and hout. Both target shapes share the arguments. */

#ifdef RLX_TARGET_GPU
#if RNN_JB % RNN_GU != 0 || RNN_GK < RNN_RB
#error "rnn gpu tuning: RNN_JB must be a multiple of RNN_GU and RNN_GK at least RNN_RB"
#endif
/* gpu target: a work-group of RNN_GU consecutive units (LID 0) x RNN_GK slices of the reduction
 * (LID 1) for RNN_RB batch rows. Item (u, s) sums q = s, s + RNN_GK, ... for its unit, every gate
 * and every row, so a warp reads runs of RNN_GU consecutive whT reals (coalesced) and each weight
 * serves RNN_RB rows; the slices' partial sums meet in LOCAL memory, where item (u, r) finishes
 * row r's cell. Row blocks past grid y are strided over by whole work-groups (barriers stay uniform). */
#define RNN_GPU_STEP(NG)                                                                     \
    for (i64 rb = GROUP(1); rb < (B + RNN_RB - 1) / RNN_RB; rb += GSIZE(1) / RNN_GK) {       \
        const i64 b0 = rb * RNN_RB;                                                          \
        i64 rows[RNN_RB];  /* rows past B repeat the last one; their sums are dropped */     \
        PRAGMA_UNROLL                                                                        \
        for (int r = 0; r < RNN_RB; ++r)                                                     \
            rows[r] = b0 + r < B ? b0 + r : B - 1;                                           \
        real acc[RNN_RB][NG];                                                                \
        PRAGMA_UNROLL                                                                        \
        for (int r = 0; r < RNN_RB; ++r)                                                     \
            PRAGMA_UNROLL                                                                    \
            for (int g = 0; g < NG; ++g)                                                     \
                acc[r][g] = (real)0;                                                         \
        for (i64 q = slice; q < H; q += RNN_GK) {                                            \
            GLOBAL const real* wq = wt + q * (NG * HP + RNN_WPAD) + j;                       \
            real w[NG];                                                                      \
            PRAGMA_UNROLL                                                                    \
            for (int g = 0; g < NG; ++g)                                                     \
                w[g] = wq[g * HP];                                                           \
            PRAGMA_UNROLL                                                                    \
            for (int r = 0; r < RNN_RB; ++r) {                                               \
                const real hv = hin[rows[r] * H + q];                                        \
                PRAGMA_UNROLL                                                                \
                for (int g = 0; g < NG; ++g)                                                 \
                    acc[r][g] += hv * w[g];                                                  \
            }                                                                                \
        }                                                                                    \
        PRAGMA_UNROLL                                                                        \
        for (int r = 0; r < RNN_RB; ++r)                                                     \
            PRAGMA_UNROLL                                                                    \
            for (int g = 0; g < NG; ++g)                                                     \
                part[slice][r][g][u] = acc[r][g];                                            \
        BARRIER();                                                                           \
        const i64 b = b0 + slice;                                                            \
        if (slice < RNN_RB && b < B && j < H) {                                              \
            real xz[4], hz[4];                                                               \
            PRAGMA_UNROLL                                                                    \
            for (int g = 0; g < NG; ++g) {                                                   \
                real sum = has_bhh ? LOAD(bhh, g * H + j) : (real)0;                         \
                for (int k = 0; k < RNN_GK; ++k)                                             \
                    sum += part[k][slice][g][u];                                             \
                hz[g] = sum;                                                                 \
                xz[g] = xw[(b * S + tt) * NG * H + (i64)g * H + j];                          \
            }                                                                                \
            RNN_UNIT_OUT(NG, b, j, xz, hz);                                                  \
        }                                                                                    \
        BARRIER();  /* part is reused by the next row block */                               \
    }

#else
/* cpu target: acc[r][g][u] = bias[g*H + j0+u] (when has_bias) + sum_q VEC(r, q) * wT[q][g*HP + j0+u]
 * over q < K, for NR rows, NG gates and NJ units from j0: a rank-1 update per q (a contiguous run of a
 * staged transpose's row, rows NG*HP + RNN_WPAD reals apart, shared by the NR rows; the row's value
 * broadcast). The loops are unrolled so the NR*NG*NJ sums stay in registers and the runs become vector
 * loads and FMAs. VEC(r, q) reads element q of row r's vector (h, or the input x). */
#define RNN_RANK1_SUMS(NG, NR, NJ, has_bias, bias_p, wT, K, VEC)                            \
    {                                                                                       \
        PRAGMA_UNROLL                                                                       \
        for (int r = 0; r < NR; ++r)                                                        \
            PRAGMA_UNROLL                                                                   \
            for (int g = 0; g < NG; ++g)                                                    \
                PRAGMA_UNROLL                                                               \
                for (int u = 0; u < NJ; ++u)                                                \
                    acc[r][g][u] = ((has_bias) && j0 + u < H) ? LOAD(bias_p, g * H + j0 + u) : (real)0; \
        GLOBAL const real* wq = (wT) + j0;                                                  \
        for (i64 q = 0; q < (K); ++q) {                                                     \
            real w[NG][NJ], vq[NR];                                                         \
            PRAGMA_UNROLL                                                                   \
            for (int g = 0; g < NG; ++g)                                                    \
                PRAGMA_UNROLL                                                               \
                for (int u = 0; u < NJ; ++u)                                                \
                    w[g][u] = wq[g * HP + u];                                               \
            wq += NG * HP + RNN_WPAD;                                                       \
            PRAGMA_UNROLL                                                                   \
            for (int r = 0; r < NR; ++r)                                                    \
                vq[r] = VEC(r, q);                                                          \
            PRAGMA_UNROLL                                                                   \
            for (int r = 0; r < NR; ++r)                                                    \
                PRAGMA_UNROLL                                                               \
                for (int g = 0; g < NG; ++g)                                                \
                    PRAGMA_UNROLL                                                           \
                    for (int u = 0; u < NJ; ++u)                                            \
                        acc[r][g][u] += vq[r] * w[g][u];                                    \
        }                                                                                   \
    }
#define RNN_H_AT(r, q) hin[rows[r] * H + (q)]
#define RNN_X_AT(r, q) load_any(x, (rows[r] * S + tt) * I + (q), x_real)

/* cpu target: one timestep for NJ (RNN_JB_G<NG>) consecutive units from j0 < H, NR (RNN_RB_G<NG>) batch
 * rows from b0 (rows[r], the rows past B repeating the last one), direction dir: hz = b_hh + h . W_hh^T
 * over whT (RNN_RANK1_SUMS; NR*NG*NJ sized to about 12 AVX2 vectors of sums, like the gemm's block),
 * then the cell. h ping-pongs between hin and hout. */
#define RNN_CPU_BLOCK(NG, NR, NJ)                                                           \
    {                                                                                       \
        real acc[NR][NG][NJ];                                                               \
        RNN_RANK1_SUMS(NG, NR, NJ, has_bhh, bhh, wt, H, RNN_H_AT)                            \
        for (int r = 0; r < NR; ++r) {                                                      \
            const i64 b = b0 + r;                                                           \
            if (b >= B)                                                                     \
                break;                                                                      \
            if (j0 + NJ <= H) {                                                             \
                /* a full run: straight-line per unit, the op fixed by the gate count, so the \
                 * NJ cells vectorize across units */                                       \
                GLOBAL const real* xr = xw + (b * S + tt) * NG * H + j0;                    \
                GLOBAL real* cr = cst + b * H + j0;                                         \
                GLOBAL const real* hr = hin + b * H + j0;                                   \
                real hv[NJ];                                                                \
                for (int u = 0; u < NJ; ++u) {                                              \
                    real xz[4], hz[4];                                                      \
                    PRAGMA_UNROLL                                                           \
                    for (int g = 0; g < NG; ++g) {                                          \
                        xz[g] = xr[g * H + u];                                              \
                        hz[g] = acc[r][g][u];                                               \
                    }                                                                       \
                    real c = cr[u];                                                         \
                    hv[u] = cell(RNN_OP_OF(NG), relu, xz, hz, hr[u], &c);                   \
                    cr[u] = c;                                                              \
                }                                                                           \
                PRAGMA_UNROLL                                                               \
                for (int u = 0; u < NJ; ++u)                                                \
                    hout[b * H + j0 + u] = hv[u];                                           \
                for (int u = 0; u < NJ; ++u)                                                \
                    store_any(out, (b * S + tt) * o_rs + dir * H + j0 + u, o_real, hv[u]);  \
                continue;                                                                   \
            }                                                                               \
            for (int u = 0; u < NJ; ++u) {                                                  \
                const i64 j = j0 + u;                                                       \
                if (j >= H)                                                                 \
                    break;                                                                  \
                real xz[4], hz[4];                                                          \
                for (int g = 0; g < NG; ++g) {                                              \
                    xz[g] = xw[(b * S + tt) * NG * H + (i64)g * H + j];                     \
                    hz[g] = acc[r][g][u];                                                   \
                }                                                                           \
                RNN_UNIT_OUT(NG, b, j, xz, hz);                                             \
            }                                                                               \
        }                                                                                   \
    }

/* the per-step kernel: item GID(0) takes the units from j0 = GID(0) * NJ */
#define RNN_STEP_BODY(NG, NR, NJ)                                                           \
    {                                                                                       \
        const i64 j0 = GID(0) * NJ;                                                         \
        if (j0 >= H)                                                                        \
            return;                                                                         \
        RNN_CPU_BLOCK(NG, NR, NJ)                                                           \
    }

#endif

KERNEL rnn_step(int op, int relu, int G, i64 B, i64 S, i64 H, i64 t,
                GLOBAL uchar* xwb, i64 xwo, GLOBAL uchar* wtb, i64 wto, GLOBAL uchar* bhb, i64 bho, int has_bhh,
                GLOBAL uchar* hib, i64 hio, GLOBAL uchar* hob, i64 hoo, GLOBAL uchar* cb, i64 co,
                GLOBAL uchar* ob, i64 oo, int o_real, i64 o_rs)
{
#ifdef RLX_TARGET_GPU
    LOCAL real part[RNN_GK][RNN_RB][4][RNN_GU];
    const int u = (int)LID(0), slice = (int)LID(1);
    const i64 j = GROUP(0) * RNN_GU + u;  /* j < HP: whT's zero padding covers j >= H */
#else
    const int rb = G == 4 ? RNN_RB_G4 : G == 3 ? RNN_RB_G3 : RNN_RB_G1;
    const i64 b0 = GID(1) * rb;
    if (b0 >= B)
        return;
#endif
    const i64 dir = GROUP(2), HP = (H + RNN_JB - 1) / RNN_JB * RNN_JB;
    GLOBAL const real* xw = AT(real, xwb, xwo + dir * B * S * G * H * (i64)sizeof(real));
    GLOBAL const real* wt = AT(real, wtb, wto + dir * (G * HP + RNN_WPAD) * H * (i64)sizeof(real));
    GLOBAL const uchar* bhh = AT(uchar, bhb, bho + dir * G * H * (i64)sizeof(store_t));
    GLOBAL const real* hin = AT(real, hib, hio + dir * B * H * (i64)sizeof(real));
    GLOBAL real* hout = AT(real, hob, hoo + dir * B * H * (i64)sizeof(real));
    GLOBAL real* cst = AT(real, cb, co + dir * B * H * (i64)sizeof(real));
    GLOBAL uchar* out = AT(uchar, ob, oo);
    const i64 tt = dir ? S - 1 - t : t;
#ifdef RLX_TARGET_GPU
    RNN_BY_GATES(RNN_GPU_STEP)
#else
    i64 rows[RNN_RB_MAX];  /* rows past B repeat the last one; their sums are dropped */
    for (int r = 0; r < RNN_RB_MAX; ++r)
        rows[r] = b0 + r < B ? b0 + r : B - 1;
    if (G == 4)
        RNN_STEP_BODY(4, RNN_RB_G4, RNN_JB_G4)
    else if (G == 3)
        RNN_STEP_BODY(3, RNN_RB_G3, RNN_JB_G3)
    else
        RNN_STEP_BODY(1, RNN_RB_G1, RNN_JB_G1)
#endif
}

/* Initial state of one layer: h0/c0 slices (storage) into scratch (compute type), or zeros. */
KERNEL rnn_state_in(int carry, int has_c, i64 n, GLOBAL uchar* h0b, i64 h0o, GLOBAL uchar* c0b, i64 c0o,
                    GLOBAL uchar* hb, i64 ho, GLOBAL uchar* cb, i64 co)
{
    const i64 i = GID(0);
    if (i >= n)
        return;
    AT(real, hb, ho)[i] = carry ? LOAD(AT(uchar, h0b, h0o), i) : (real)0;
    AT(real, cb, co)[i] = (carry && has_c) ? LOAD(AT(uchar, c0b, c0o), i) : (real)0;
}

/* Final state of one layer back into h0/c0 in place. */
KERNEL rnn_state_out(int has_c, i64 n, GLOBAL uchar* hb, i64 ho, GLOBAL uchar* cb, i64 co,
                     GLOBAL uchar* h0b, i64 h0o, GLOBAL uchar* c0b, i64 c0o)
{
    const i64 i = GID(0);
    if (i >= n)
        return;
    STORE(AT(uchar, h0b, h0o), i, AT(real, hb, ho)[i]);
    if (has_c)
        STORE(AT(uchar, c0b, c0o), i, AT(real, cb, co)[i]);
}

/* The whole sequence of one layer in one launch; state moves in from / out to h0, c0 when carrying. */
#ifdef RLX_TARGET_GPU
/* gpu target: one work-group of H items per (batch row, direction) keeps h in local memory. */
KERNEL rnn_persist(int op, int relu, int G, i64 B, i64 S, i64 H, int carry,
                   GLOBAL uchar* xwb, i64 xwo, GLOBAL uchar* whb, i64 who, GLOBAL uchar* bhb, i64 bho, int has_bhh,
                   GLOBAL uchar* h0b, i64 h0o, GLOBAL uchar* c0b, i64 c0o,
                   GLOBAL uchar* ob, i64 oo, int o_real, i64 o_rs)
{
    const i64 j = LID(0), b = GROUP(1), dir = GROUP(2);
    GLOBAL const real* xw = AT(real, xwb, xwo + dir * B * S * G * H * (i64)sizeof(real));
    GLOBAL const uchar* whh = AT(uchar, whb, who + dir * G * H * H * (i64)sizeof(store_t));
    GLOBAL const uchar* bhh = AT(uchar, bhb, bho + dir * G * H * (i64)sizeof(store_t));
    GLOBAL uchar* h0 = AT(uchar, h0b, h0o + (dir * B + b) * H * (i64)sizeof(store_t));
    GLOBAL uchar* c0 = AT(uchar, c0b, c0o + (dir * B + b) * H * (i64)sizeof(store_t));
    GLOBAL uchar* out = AT(uchar, ob, oo);
    LOCAL real hs[RNN_PERSIST_MAX];
    real h = carry ? LOAD(h0, j) : (real)0;
    real c = (carry && op == OP_LSTM) ? LOAD(c0, j) : (real)0;
    hs[j] = h;
    BARRIER();
    for (i64 t = 0; t < S; ++t) {
        const i64 tt = dir ? S - 1 - t : t;
        real xz[4], hz[4];
        XW_GATES(xz);
        HH_DOTS(hz, hs);
        h = cell(op, relu, xz, hz, h, &c);
        BARRIER();
        hs[j] = h;
        store_any(out, (b * S + tt) * o_rs + dir * H + j, o_real, h);
        BARRIER();
    }
    if (carry) {
        STORE(h0, j, h);
        if (op == OP_LSTM)
            STORE(c0, j, c);
    }
}
#else
/* xw of NR rows from b0, NG gates and NJ units from j0 at time tt, when the kernel projects the input
 * itself: bias + x . W_ih^T over wiT [dirs][I][NG*HP + RNN_WPAD] (rnn_w_t, RNN_RANK1_SUMS); x is
 * arena storage or scratch in the compute type (x_real), rows of I. */
#define RNN_CPU_XBLOCK(NG, NR, NJ)                                                          \
    {                                                                                       \
        real acc[NR][NG][NJ];                                                               \
        RNN_RANK1_SUMS(NG, NR, NJ, 1, bias, wi, I, RNN_X_AT)                                 \
        for (int r = 0; r < NR && b0 + r < B; ++r)                                          \
            for (int g = 0; g < NG; ++g)                                                    \
                for (int u = 0; u < NJ && j0 + u < H; ++u)                                  \
                    xw[((b0 + r) * S + tt) * NG * H + g * H + j0 + u] = acc[r][g][u];       \
    }

/* cpu target: one work-item (a work-group of one) per (batch row, direction) runs every step of that row,
 * the input projection included: per step and run of RNN_JB units, RNN_CPU_XBLOCK (xw of the run) then
 * RNN_CPU_BLOCK (the recurrence), h ping-ponging between the row's h in hb0 and hb1 and c in cst
 * (scratch, compute type). So a layer is one launch and a decode step needs no gemm. A single item needs
 * no barrier, which keeps PoCL's code register-blocked (measured: a work-group of items over the units
 * with a barrier per step ran 1.3-2x slower), and the rows, which share nothing, run on as many cores as
 * there are. Arguments as rnn_step's, without the step index, plus carry, h0, c0, the input x (arena
 * storage or compute-type scratch: x_real; rows of I), W_ih^T staged like W_hh^T (rnn_w_t) and the
 * input bias. */
#define RNN_PERSIST_RUNS(NG)                                                                \
    for (i64 j0 = 0; j0 < H; j0 += RNN_JB) {                                                \
        RNN_CPU_XBLOCK(NG, 1, RNN_JB)                                                       \
        RNN_CPU_BLOCK(NG, 1, RNN_JB)                                                        \
    }

KERNEL rnn_persist(int op, int relu, int G, i64 B, i64 S, i64 H, int carry,
                   GLOBAL uchar* xwb, i64 xwo, GLOBAL uchar* wtb, i64 wto, GLOBAL uchar* bhb, i64 bho, int has_bhh,
                   GLOBAL uchar* h0b, i64 h0o, GLOBAL uchar* c0b, i64 c0o,
                   GLOBAL uchar* hb0, i64 ho0, GLOBAL uchar* hb1, i64 ho1, GLOBAL uchar* cb, i64 co,
                   i64 I, GLOBAL uchar* xb, i64 xo, int x_real, GLOBAL uchar* wib, i64 wio,
                   GLOBAL uchar* bib, i64 bio,
                   GLOBAL uchar* ob, i64 oo, int o_real, i64 o_rs)
{
    const i64 b0 = GROUP(1), dir = GROUP(2), HP = (H + RNN_JB - 1) / RNN_JB * RNN_JB;
    const i64 rows[1] = {b0};
    GLOBAL real* xw = AT(real, xwb, xwo + dir * B * S * G * H * (i64)sizeof(real)); /* written, then read */
    GLOBAL const real* wt = AT(real, wtb, wto + dir * (G * HP + RNN_WPAD) * H * (i64)sizeof(real));
    GLOBAL const uchar* bhh = AT(uchar, bhb, bho + dir * G * H * (i64)sizeof(store_t));
    GLOBAL uchar* h0 = AT(uchar, h0b, h0o + dir * B * H * (i64)sizeof(store_t));
    GLOBAL uchar* c0 = AT(uchar, c0b, c0o + dir * B * H * (i64)sizeof(store_t));
    GLOBAL real* hs0 = AT(real, hb0, ho0 + dir * B * H * (i64)sizeof(real));
    GLOBAL real* hs1 = AT(real, hb1, ho1 + dir * B * H * (i64)sizeof(real));
    GLOBAL real* cst = AT(real, cb, co + dir * B * H * (i64)sizeof(real));
    GLOBAL uchar* out = AT(uchar, ob, oo);
    GLOBAL const uchar* x = AT(uchar, xb, xo);
    GLOBAL const real* wi = AT(real, wib, wio + dir * (G * HP + RNN_WPAD) * I * (i64)sizeof(real));
    GLOBAL const uchar* bias = AT(uchar, bib, bio + dir * G * H * (i64)sizeof(store_t));
    for (i64 i = b0 * H; i < (b0 + 1) * H; ++i) {
        hs0[i] = carry ? LOAD(h0, i) : (real)0;
        cst[i] = carry && G == 4 ? LOAD(c0, i) : (real)0;
    }
    for (i64 t = 0; t < S; ++t) {
        const i64 tt = dir ? S - 1 - t : t;
        GLOBAL const real* hin = t % 2 ? hs1 : hs0;
        GLOBAL real* hout = t % 2 ? hs0 : hs1;
        RNN_BY_GATES(RNN_PERSIST_RUNS)
    }
    if (carry)
        for (i64 i = b0 * H; i < (b0 + 1) * H; ++i) {
            STORE(h0, i, S % 2 ? hs1[i] : hs0[i]);
            if (G == 4)
                STORE(c0, i, cst[i]);
        }
}
#endif

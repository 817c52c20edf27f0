/* The recurrent family's cell (ABI.md §3, and §8's fields), shared by kernels/rnn.cl (the forward) and
 * kernels/rnn_backward.cl, which come after it in their programs (backends/programs.py SHARED_TEXTS).
 * A program holds one op and one combination of its optional fields: RNN_GATES, the gate count G (4 lstm,
 * 3 gru, 1 rnn), the activation of every slot and direction (RNN_ACT_<slot><dir>) and the RNN_<field>
 * flags below are compile-time variants of the launch (launches/rnn.py `variant`), so every gate loop has
 * a constant trip count and the cell has no branch on the op, its activations or its fields. The values
 * a field carries (clip, activation alpha and beta, seq_lens, peepholes, W_hr) are kernel arguments. */

#if RNN_GATES != 4 && RNN_GATES != 3 && RNN_GATES != 1
#error "RNN_GATES (a launch define: the op's gate count) must be 4 (lstm), 3 (gru) or 1 (rnn)"
#endif
#define RNN_HAS_CELL (RNN_GATES == 4) /* lstm carries a cell state c beside h */

/* The optional fields (0: absent, ABI.md §3's meaning). */
#ifndef RNN_LENS
#define RNN_LENS 0 /* seq_lens: row b runs lens[b] steps; the step kernels visit rows longest first */
#endif
#ifndef RNN_CLIP
#define RNN_CLIP 0 /* clip: every gate pre-activation clamped to [-clip, clip] */
#endif
#ifndef RNN_PEEP
#define RNN_PEEP 0 /* lstm peepholes */
#endif
#ifndef RNN_IFG
#define RNN_IFG 0 /* lstm input_forget: f = 1 - i */
#endif
#ifndef RNN_PROJ
#define RNN_PROJ 0 /* lstm proj_size: h = W_hr (o * h(c)), width K = P */
#endif
#ifndef RNN_LBR0
#define RNN_LBR0 0 /* gru linear_before_reset false: n = g(W_in x + b_in + W_hn (r * h) + b_hn), two phases a step */
#endif
#ifndef RNN_SAVE
#define RNN_SAVE 0 /* reserve, forward: the step kernels write the saved forward (ABI.md §9.1) */
#endif
#ifndef RNN_SAVED
#define RNN_SAVED 0 /* reserve, backward: the reverse walk reads the saved forward instead of running the forward */
#endif
#if (RNN_PEEP || RNN_IFG || RNN_PROJ) && RNN_GATES != 4
#error "RNN_PEEP, RNN_IFG and RNN_PROJ are lstm variants (RNN_GATES 4)"
#endif
#if RNN_LBR0 && RNN_GATES != 3
#error "RNN_LBR0 is a gru variant (RNN_GATES 3)"
#endif

/* The activation codes RNN_ACT_SIGMOID, RNN_ACT_TANH, ... (ABI.md §8's names) come with the program's
 * defines, from the one table of launches/activation_codes.py. Each slot's activation per direction (f drives
 * lstm i, f, o / gru r, z / rnn's one; g the candidate; h lstm's output o * h(c)); unset: §3's, and direction 1
 * as direction 0. */
#ifndef RNN_ACT_F0
#if RNN_GATES == 1
#define RNN_ACT_F0 RNN_ACT_TANH
#else
#define RNN_ACT_F0 RNN_ACT_SIGMOID
#endif
#endif
#ifndef RNN_ACT_G0
#define RNN_ACT_G0 RNN_ACT_TANH
#endif
#ifndef RNN_ACT_H0
#define RNN_ACT_H0 RNN_ACT_TANH
#endif
#ifndef RNN_ACT_F1
#define RNN_ACT_F1 RNN_ACT_F0
#endif
#ifndef RNN_ACT_G1
#define RNN_ACT_G1 RNN_ACT_G0
#endif
#ifndef RNN_ACT_H1
#define RNN_ACT_H1 RNN_ACT_H0
#endif

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

/* Activation `code` (a compile-time constant at every call, so the switch folds away) with its alpha a and
 * beta b. */
INLINE_FN real rnn_act(int code, real v, real a, real b)
{
    switch (code) {
    case RNN_ACT_SIGMOID: return rnn_sigmoid(v);
    case RNN_ACT_TANH: return rnn_tanh(v);
    case RNN_ACT_RELU: return v < (real)0 ? (real)0 : v;
    case RNN_ACT_AFFINE: return a * v + b;
    case RNN_ACT_LEAKY_RELU: return v >= (real)0 ? v : a * v;
    case RNN_ACT_THRESHOLDED_RELU: return v > a ? v : (real)0;
    case RNN_ACT_SCALED_TANH: return a * rnn_tanh(b * v);
    case RNN_ACT_HARD_SIGMOID: {
        const real y = a * v + b;
        return y < (real)0 ? (real)0 : (y > (real)1 ? (real)1 : y);
    }
    case RNN_ACT_ELU: return v >= (real)0 ? v : a * (rlx_exp(v) - (real)1);
    case RNN_ACT_SOFTSIGN: return v / ((real)1 + (v < (real)0 ? -v : v));
    case RNN_ACT_SOFTPLUS: /* log(1 + e^v) = max(v, 0) + log1p(e^-|v|): no overflow */
    default:
        return (v > (real)0 ? v : (real)0) + log1p(rlx_exp(v > (real)0 ? -v : v));
    }
}

/* What a cell needs besides its sums: the direction's alpha and beta of slots f, g, h (ab[2*slot],
 * ab[2*slot+1]), clip, and the direction (which picks each slot's activation). */
typedef struct {
    real ab[6];
    real clip;
    int dir;
} rnn_params;

INLINE_FN rnn_params rnn_params_of(int dir, real clip, real a_f0, real b_f0, real a_g0, real b_g0, real a_h0, real b_h0,
                                   real a_f1, real b_f1, real a_g1, real b_g1, real a_h1, real b_h1)
{
    rnn_params p;
    p.ab[0] = dir ? a_f1 : a_f0;
    p.ab[1] = dir ? b_f1 : b_f0;
    p.ab[2] = dir ? a_g1 : a_g0;
    p.ab[3] = dir ? b_g1 : b_g0;
    p.ab[4] = dir ? a_h1 : a_h0;
    p.ab[5] = dir ? b_h1 : b_h0;
    p.clip = clip;
    p.dir = dir;
    return p;
}

/* Slot `slot` (0 f, 1 g, 2 h) of the cell: code0 at direction 0, code1 at direction 1. */
INLINE_FN real rnn_slot(int code0, int code1, int slot, real v, const rnn_params* p)
{
    const real a = p->ab[2 * slot], b = p->ab[2 * slot + 1];
    return (code0 == code1 || !p->dir) ? rnn_act(code0, v, a, b) : rnn_act(code1, v, a, b);
}
INLINE_FN real rnn_f(real v, const rnn_params* p) { return rnn_slot(RNN_ACT_F0, RNN_ACT_F1, 0, v, p); }
INLINE_FN real rnn_g(real v, const rnn_params* p) { return rnn_slot(RNN_ACT_G0, RNN_ACT_G1, 1, v, p); }
INLINE_FN real rnn_h(real v, const rnn_params* p) { return rnn_slot(RNN_ACT_H0, RNN_ACT_H1, 2, v, p); }

/* A gate pre-activation clamped to [-clip, clip] (NaN kept), with RNN_CLIP. */
INLINE_FN real rnn_clip(real v, const rnn_params* p)
{
#if RNN_CLIP
    return v < -p->clip ? -p->clip : (v > p->clip ? p->clip : v);
#else
    return v;
#endif
}

/* What one unit's step leaves for the saved forward (RNN_SAVE, docs/abi.md 6a.1): each gate's value y, its
 * pre-activation u after peepholes and clip, whether the clip passes its gradient; lstm's cell entering and
 * leaving the step and h(c_new); gru's W_hn h + b_hn (with linear_before_reset). */
typedef struct {
    real y[RNN_GATES], u[RNN_GATES];
    uchar pass[RNN_GATES];
    real c_prev, c_new, hc, hn;
} rnn_record;

/* Gate g of activation slot `slot` (0 f, 1 g) from its pre-activation z: clipped, activated, and recorded. */
INLINE_FN real rnn_gate(int slot, int g, real z, rnn_record* rec, const rnn_params* p)
{
    const real v = rnn_clip(z, p), y = slot == 0 ? rnn_f(v, p) : rnn_g(v, p);
#if RNN_SAVE
    rec->u[g] = v;
    rec->y[g] = y;
    rec->pass[g] = z >= -p->clip && z <= p->clip; /* |z| <= clip, as the host's mask (NaN: 0) */
#endif
    return y;
}

/* gru's new h from the candidate n and the update gate z. */
INLINE_FN real rnn_gru_out(real n, real z, real h) { return ((real)1 - z) * n + z * h; }

/* One unit's step from its gate pre-activations in the op's gate order: xz = W_ih x + bias (input side),
 * hz = W_hh h (+ b_hh for gru; recurrent side), h the unit's previous output (gru), pp its peepholes
 * (i, o, f; RNN_PEEP). Returns what the step stores for the unit: its new h; lstm's o * h(c) before the
 * projection with RNN_PROJ; gru's r * h in phase 0 of RNN_LBR0. *c is read and updated: lstm's cell, or
 * RNN_LBR0's update gate z (phase 0 writes it, phase 1 reads it, where hz[2] = W_hn (r * h) + b_hn).
 * With RNN_SAVE the step's record goes to *rec (the phase's gates, and what the op keeps besides). */
INLINE_FN real rnn_unit(const real* xz, const real* hz, real h, real* c, const real* pp, const rnn_params* p, int phase,
                        rnn_record* rec)
{
#if RNN_GATES == 4
    real zi = xz[0] + hz[0], zf = xz[1] + hz[1], zo = xz[3] + hz[3];
#if RNN_PEEP
    zi += pp[0] * *c;
    zf += pp[2] * *c;
#endif
#if RNN_SAVE
    rec->c_prev = *c;
#endif
    const real i = rnn_gate(0, 0, zi, rec, p);
#if RNN_IFG
    const real f = (real)1 - i;
#if RNN_SAVE /* as the host keeps it: z_f unclipped (no gradient reads it), f = 1 - i, the mask passing */
    rec->u[1] = zf;
    rec->y[1] = f;
    rec->pass[1] = 1;
#endif
#else
    const real f = rnn_gate(0, 1, zf, rec, p);
#endif
    *c = f * *c + i * rnn_gate(1, 2, xz[2] + hz[2], rec, p);
#if RNN_PEEP
    zo += pp[1] * *c; /* the output gate sees the new cell */
#endif
    const real hc = rnn_h(*c, p);
#if RNN_SAVE
    rec->c_new = *c;
    rec->hc = hc;
#endif
    return rnn_gate(0, 3, zo, rec, p) * hc;
#elif RNN_GATES == 3
#if RNN_LBR0
    if (phase == 0) {
        *c = rnn_gate(0, 1, xz[1] + hz[1], rec, p);
        return rnn_gate(0, 0, xz[0] + hz[0], rec, p) * h;
    }
    return rnn_gru_out(rnn_gate(1, 2, xz[2] + hz[2], rec, p), *c, h);
#else
    const real r = rnn_gate(0, 0, xz[0] + hz[0], rec, p), z = rnn_gate(0, 1, xz[1] + hz[1], rec, p);
#if RNN_SAVE
    rec->hn = hz[2];
#endif
    return rnn_gru_out(rnn_gate(1, 2, xz[2] + r * hz[2], rec, p), z, h); /* the reset scales W_hn h + b_hn */
#endif
#else
    return rnn_gate(0, 0, xz[0] + hz[0], rec, p);
#endif
}

/* Whether a step's value goes to aux (lstm's o * h(c) awaiting the projection; gru's r * h awaiting
 * phase 1) rather than to h and the output. */
INLINE_FN int rnn_to_aux(int phase)
{
#if RNN_PROJ
    return 1;
#elif RNN_LBR0
    return phase == 0;
#else
    return 0;
#endif
}

/* The gates a step sums (g0 .. g0+ng-1): all but with RNN_LBR0, whose phase 0 takes r, z and phase 1 n. */
INLINE_FN int rnn_first_gate(int phase) { return RNN_LBR0 * (phase ? 2 : 0); }
/* Whether a step sums aux (r * h: phase 1 of RNN_LBR0) rather than h. */
INLINE_FN int rnn_sums_aux(int phase) { return RNN_LBR0 * phase; }
INLINE_FN int rnn_gate_count(int phase) { return RNN_LBR0 ? (phase ? 1 : 2) : RNN_GATES; }

/* Row b's steps (seq_lens with RNN_LENS, else S) and the time index of its step t: direction 1 and
 * `reverse` walk their steps backwards. */
INLINE_FN i64 rnn_len(GLOBAL const int* lens, i64 b, i64 S) { return RNN_LENS ? (i64)lens[b] : S; }
INLINE_FN i64 rnn_time(i64 t, int back, i64 len) { return back ? len - 1 - t : t; }

/* Item i of a layer's state into scratch: h[i] (i < nh) and c[i] (i < nc) from the storage h0, c0 with carry (c
 * only where the op carries a cell), else zeros: the forward's initial state, the reverse walk's final gradients. */
INLINE_FN void rnn_state_into(i64 i, int carry, i64 nh, i64 nc, GLOBAL const uchar* h0, GLOBAL const uchar* c0,
                              GLOBAL real* h, GLOBAL real* c)
{
    if (i < nh)
        h[i] = carry ? LOAD(h0, i) : (real)0;
    if (i < nc)
        c[i] = carry && RNN_HAS_CELL ? LOAD(c0, i) : (real)0;
}

/* The batch row at position pos of the step kernels' order: ord[pos] (the rows longest first, rnn_order) with
 * RNN_LENS, else pos. */
INLINE_FN i64 rnn_row(i64 pos, GLOBAL const int* ord)
{
#if RNN_LENS
    return (i64)ord[pos];
#else
    return pos;
#endif
}

/* The batch rows of a block of nb from position b0 at step t: rows[r] = ord[b0 + r] (the rows longest first,
 * rnn_order) with RNN_LENS, else b0 + r. Returns how many lead the block and still run at t (positions
 * past B or finished rows end it); the others repeat rows[0], so their sums are a live row's and dropped. */
INLINE_FN int rnn_rows(i64* rows, int nb, i64 b0, i64 B, i64 t, GLOBAL const int* lens, GLOBAL const int* ord)
{
    int n = 0;
    PRAGMA_UNROLL
    for (int r = 0; r < nb; ++r) {
        const i64 pos = b0 + r < B ? b0 + r : B - 1;
        rows[r] = rnn_row(pos, ord);
        n += b0 + r < B && n == r && rnn_len(lens, rows[r], t + 1) > t; /* without RNN_LENS every row runs */
    }
    PRAGMA_UNROLL
    for (int r = 1; r < nb; ++r)  /* constant indices: rows stays in registers */
        rows[r] = r < n ? rows[r] : rows[0];
    return n;
}

/* The peepholes of unit j (RNN_PEEP; row [3H] of the layer-direction, order i, o, f). */
INLINE_FN void rnn_peepholes(real* pp, GLOBAL const uchar* peep, i64 j, i64 H)
{
#if RNN_PEEP
    PRAGMA_UNROLL
    for (int k = 0; k < 3; ++k)
        pp[k] = LOAD(peep, k * H + j);
#endif
}

/* xz[g] = xw[row][g*H + j]: the input side of unit j's gates, row = b*S + tt. */
INLINE_FN void rnn_input_gates(real* xz, GLOBAL const real* xw, i64 row, i64 j, i64 H)
{
    PRAGMA_UNROLL
    for (int g = 0; g < RNN_GATES; ++g)
        xz[g] = xw[row * RNN_GATES * H + (i64)g * H + j];
}

/* The saved forward (ABI.md §9.1; the layout of docs/abi.md 6a.1, identical on every device): per layer-direction
 * a block of time-major arrays [S][B][width] (row tt*B + b) in the compute type, one after another: the gates'
 * values y and pre-activations u [G*H], the state entering the step h_prev [K], then lstm's c_prev, c_new, hc
 * (and raw = o * h(c_new) with RNN_PROJ) [H], gru's hn [H]; and per layer-direction the clip's mask [S][B][G*H]
 * (bytes). u is written only where the backward reads it (RNN_KEEPS_U: a clip, or a slot f or g activation
 * whose slope does not follow from its value), lstm's c_new likewise (RNN_KEEPS_CN), the mask with RNN_CLIP. */
#define RNN_SV_Y 0
#define RNN_SV_U 1
#define RNN_SV_HP 2
#define RNN_SV_CP 3
#define RNN_SV_HN 3 /* gru */
#define RNN_SV_CN 4
#define RNN_SV_HC 5
#define RNN_SV_RAW 6
#define RNN_SLOPE_FROM_VALUE(code) ((code) == RNN_ACT_SIGMOID || (code) == RNN_ACT_TANH)
#define RNN_KEEPS_U (RNN_CLIP || !RNN_SLOPE_FROM_VALUE(RNN_ACT_F0) || !RNN_SLOPE_FROM_VALUE(RNN_ACT_F1) \
                     || (RNN_GATES > 1 && (!RNN_SLOPE_FROM_VALUE(RNN_ACT_G0) || !RNN_SLOPE_FROM_VALUE(RNN_ACT_G1))))
#define RNN_KEEPS_CN (RNN_PEEP || RNN_ACT_H0 != RNN_ACT_TANH || RNN_ACT_H1 != RNN_ACT_TANH)

/* The first real of array `a` (RNN_SV_*) in a layer-direction's block, N = S*B. */
INLINE_FN i64 rnn_saved_at(int a, i64 N, i64 H, i64 K)
{
    const i64 GH = RNN_GATES * H;
    return N * (a <= RNN_SV_U ? a * GH : 2 * GH + (a > RNN_SV_HP ? K + (a - RNN_SV_CP) * H : 0));
}

/* The reals of a layer-direction's block. */
INLINE_FN i64 rnn_saved_block(i64 N, i64 H, i64 K)
{
    return rnn_saved_at(RNN_GATES == 4 ? RNN_SV_RAW + RNN_PROJ : (RNN_GATES == 3 ? RNN_SV_HN + 1 : RNN_SV_CP), N, H, K);
}

#if RNN_SAVE
/* Unit j's record of batch row b at time tt into its layer-direction's block sv and mask mk: the gates the phase
 * makes, and in phase 0 the state entering the step (h_prev, units j < K) and what the op keeps besides; v is the
 * step's value (lstm's o * h(c) with RNN_PROJ, gru's r * h in phase 0 of RNN_LBR0). */
INLINE_FN void rnn_save(GLOBAL real* sv, GLOBAL uchar* mk, const rnn_record* rec, int phase, real h_prev, real v, i64 b,
                        i64 tt, i64 B, i64 S, i64 H, i64 K, i64 j)
{
    const i64 N = B * S, at = tt * B + b, GH = RNN_GATES * H;
    const int g0 = rnn_first_gate(phase), ng = rnn_gate_count(phase);
    PRAGMA_UNROLL
    for (int g = 0; g < RNN_GATES; ++g) {
        if (g < g0 || g >= g0 + ng)
            continue;
        sv[at * GH + g * H + j] = rec->y[g];
        if (RNN_KEEPS_U)
            sv[rnn_saved_at(RNN_SV_U, N, H, K) + at * GH + g * H + j] = rec->u[g];
        if (RNN_CLIP)
            mk[at * GH + g * H + j] = rec->pass[g];
    }
    if (phase != 0)
        return;
    if (j < K)
        sv[rnn_saved_at(RNN_SV_HP, N, H, K) + at * K + j] = h_prev;
#if RNN_GATES == 4
    sv[rnn_saved_at(RNN_SV_CP, N, H, K) + at * H + j] = rec->c_prev;
    if (RNN_KEEPS_CN)
        sv[rnn_saved_at(RNN_SV_CN, N, H, K) + at * H + j] = rec->c_new;
    sv[rnn_saved_at(RNN_SV_HC, N, H, K) + at * H + j] = rec->hc;
    if (RNN_PROJ)
        sv[rnn_saved_at(RNN_SV_RAW, N, H, K) + at * H + j] = v;
#elif RNN_GATES == 3
    sv[rnn_saved_at(RNN_SV_HN, N, H, K) + at * H + j] = RNN_LBR0 ? v : rec->hn;
#endif
}
#endif

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

/* gru's new h from the candidate's pre-activation zn and the update gate z. */
INLINE_FN real rnn_gru_out(real zn, real z, real h, const rnn_params* p)
{
    return ((real)1 - z) * rnn_g(rnn_clip(zn, p), p) + z * h;
}

/* One unit's step from its gate pre-activations in the op's gate order: xz = W_ih x + bias (input side),
 * hz = W_hh h (+ b_hh for gru; recurrent side), h the unit's previous output (gru), pp its peepholes
 * (i, o, f; RNN_PEEP). Returns what the step stores for the unit: its new h; lstm's o * h(c) before the
 * projection with RNN_PROJ; gru's r * h in phase 0 of RNN_LBR0. *c is read and updated: lstm's cell, or
 * RNN_LBR0's update gate z (phase 0 writes it, phase 1 reads it, where hz[2] = W_hn (r * h) + b_hn). */
INLINE_FN real rnn_unit(const real* xz, const real* hz, real h, real* c, const real* pp, const rnn_params* p, int phase)
{
#if RNN_GATES == 4
    real zi = xz[0] + hz[0], zf = xz[1] + hz[1], zo = xz[3] + hz[3];
#if RNN_PEEP
    zi += pp[0] * *c;
    zf += pp[2] * *c;
#endif
    const real i = rnn_f(rnn_clip(zi, p), p);
#if RNN_IFG
    const real f = (real)1 - i;
#else
    const real f = rnn_f(rnn_clip(zf, p), p);
#endif
    *c = f * *c + i * rnn_g(rnn_clip(xz[2] + hz[2], p), p);
#if RNN_PEEP
    zo += pp[1] * *c; /* the output gate sees the new cell */
#endif
    return rnn_f(rnn_clip(zo, p), p) * rnn_h(*c, p);
#elif RNN_GATES == 3
#if RNN_LBR0
    if (phase == 0) {
        *c = rnn_f(rnn_clip(xz[1] + hz[1], p), p);
        return rnn_f(rnn_clip(xz[0] + hz[0], p), p) * h;
    }
    return rnn_gru_out(xz[2] + hz[2], *c, h, p);
#else
    const real r = rnn_f(rnn_clip(xz[0] + hz[0], p), p), z = rnn_f(rnn_clip(xz[1] + hz[1], p), p);
    return rnn_gru_out(xz[2] + r * hz[2], z, h, p); /* the reset scales W_hn h + b_hn */
#endif
#else
    return rnn_f(rnn_clip(xz[0] + hz[0], p), p);
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

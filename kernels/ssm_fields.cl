/* The version-2 fields of the state-space ops (ABI.md §8) as the forward kernels (kernels/ssm.cl)
 * and their backward (kernels/ssm_backward.cl) read them; rlx_gpu/backends/programs.py puts this text
 * before both families.
 *
 * A "row" is one independent sequence: a batch row, or with SSM_VARLEN one packed sequence of
 * cu_seqlens (tokens cu[r] .. cu[r+1]-1 of the one batch row). Token indices are absolute (batch row
 * times seq plus step), so both kinds of row index the tensors alike.
 *
 * The version-2 fields are compile-time variants (launches/ssm.py sets them, each 0 when absent):
 *   SSM_BIAS      delta (mamba2: dt) += delta_bias / dt_bias [H], in the parameter type
 *   SSM_SOFTPLUS  then delta = softplus(delta)
 *   SSM_LIMIT     then (mamba2) delta clamped to [lo, hi] (kernel arguments; hi may be +inf)
 *   SSM_D         y += d * x (d [H] in the parameter type)
 *   SSM_Z         then y *= silu(z)
 *   SSM_CARRY     each row starts from its entry of `state` and its final state is written there
 *   SSM_VARLEN    rows are the sequences of cu_seqlens
 *   SSM_SLOTS     row r's entry of `state` is state_slots[r] (the pool is used in place)
 *   SSM_STATE_F32 / SSM_PARAM_F32  state / a, d, bias stored as f32 beside a 16-bit thunk
 *   SSM_RESERVE   a saved forward (ABI.md §9.1, docs/abi.md 6a.1): the forward writes it, the backward
 *                 reads its states as checkpoints (ssm_saved below). */
#ifndef SSM_BIAS
#define SSM_BIAS 0
#endif
#ifndef SSM_SOFTPLUS
#define SSM_SOFTPLUS 0
#endif
#ifndef SSM_LIMIT
#define SSM_LIMIT 0
#endif
#ifndef SSM_D
#define SSM_D 0
#endif
#ifndef SSM_Z
#define SSM_Z 0
#endif
#ifndef SSM_CARRY
#define SSM_CARRY 0
#endif
#ifndef SSM_VARLEN
#define SSM_VARLEN 0
#endif
#ifndef SSM_SLOTS
#define SSM_SLOTS 0
#endif
#ifndef SSM_RESERVE
#define SSM_RESERVE 0
#endif

#ifdef SSM_PARAM_F32
typedef float param_t;
#define PLOAD(p, i) ((real)RLX_LD_F32(p, i))
#else
typedef store_t param_t;
#define PLOAD(p, i) LOAD(p, i)
#endif
#ifdef SSM_STATE_F32
typedef float state_t;
#define SLOAD(p, i) ((real)RLX_LD_F32(p, i))
#define SSTORE(p, i, v) RLX_ST_F32(p, i, v)
#else
typedef store_t state_t;
#define SLOAD(p, i) LOAD(p, i)
#define SSTORE(p, i, v) STORE(p, i, v)
#endif

/* log(1 + x) for finite x >= 0 (NaN carried): the library's, except for f32 at the cpu target, where
 * it is plain arithmetic as rlx_exp is (Cephes' logf: the exponent by bits, a degree-9 polynomial on
 * [sqrt(1/2), sqrt(2)), plus what rounding 1 + x lost), so that it inlines: PoCL's library log1p and
 * exp made a softplus per step cost twice the whole selective_scan step. */
INLINE_FN real ssm_log1p(real x)
{
#ifdef RLX_TARGET_CPU
    if (sizeof(real) == 4) {
        const float u = 1.0f + (float)x, lost = ((float)x - (u - 1.0f)) / u;
        const uint bits = F32_TO_BITS(u);
        const int e0 = (int)((bits >> 23) & 0xffu) - 126; /* u = m * 2^e0, m in [1/2, 1) */
        const float m = BITS_TO_F32((bits & 0x807fffffu) | 0x3f000000u);
        const int low = m < 0.707106781186547524f;
        const float f = low ? m + m - 1.0f : m - 1.0f, e = (float)(low ? e0 - 1 : e0), z = f * f;
        float p = 7.0376836292E-2f;
        p = p * f - 1.1514610310E-1f;
        p = p * f + 1.1676998740E-1f;
        p = p * f - 1.2420140846E-1f;
        p = p * f + 1.4249322787E-1f;
        p = p * f - 1.6668057665E-1f;
        p = p * f + 2.0000714765E-1f;
        p = p * f - 2.4999993993E-1f;
        p = p * f + 3.3333331174E-1f;
        const float y = (f + (p * f * z - 2.12194440e-4f * e - 0.5f * z)) + 0.693359375f * e + lost;
        return x != x ? x : (real)y;
    }
#endif
    return log1p(x);
}

/* softplus(u) = u above 20, else log(1 + exp(u)) (ABI.md §8). */
INLINE_FN real ssm_softplus(real u)
{
    return u > (real)20 ? u : ssm_log1p(rlx_exp(u));
}

/* silu(u) = u * sigmoid(u) through the fast exp, without a select (so that it vectorizes): where that
 * exp clamps (u < -87) the quotient is within 1e-36 of the exact value, and -inf gives NaN as
 * -inf * sigmoid(-inf) does, through min(u, 0) - min(u, 0) (0 for every other u). */
INLINE_FN real ssm_silu(real u)
{
    const real neg = fmin(u, (real)0);
    return u / ((real)1 + rlx_exp(-u)) + (neg - neg);
}

/* One step's delta (mamba2: dt) as §8 transforms it: plus the channel's (head's) bias, softplus,
 * clamp. The comparisons keep a NaN a NaN (a min/max would replace it). */
INLINE_FN real ssm_delta(real v, real bias, real lo, real hi)
{
    if (SSM_BIAS)
        v += bias;
    if (SSM_SOFTPLUS)
        v = ssm_softplus(v);
    if (SSM_LIMIT) {
        v = v < lo ? lo : v;
        v = v > hi ? hi : v;
    }
    return v;
}

/* The gradient of a step's delta (mamba2: dt) as stored, from `grad`, the gradient of the transformed one
 * (ssm_delta): back through the clamp (passing at its bounds), the softplus (the identity above 20) and the
 * bias. */
INLINE_FN real ssm_delta_grad(real v, real grad, real bias, real lo, real hi)
{
    if (SSM_BIAS)
        v += bias;
    if (SSM_SOFTPLUS) {
        if (!(v > (real)20))
            grad *= sigmoid_r(v);
        v = ssm_softplus(v);
    }
    return SSM_LIMIT && (v < lo || v > hi) ? (real)0 : grad;
}

/* z[at], or 0 for a variant without z. */
INLINE_FN real ssm_z(GLOBAL const store_t* z, i64 at)
{
    return SSM_Z ? LOAD(z, at) : (real)0;
}

/* One output as §8 finishes it: plus d * x, then times silu(z). The kernels that finish several
 * outputs load their z values first, apart from the stores: dst and z may alias as far as the
 * compiler knows, so loads between stores keep it from vectorizing the silu. */
INLINE_FN real ssm_finish(real y, real dv, real xv, real zv)
{
    if (SSM_D)
        y += dv * xv;
    if (SSM_Z)
        y *= ssm_silu(zv);
    return y;
}

/* A per-channel (per-head) parameter, or 0 for a field the variant does not take. */
INLINE_FN real ssm_param(GLOBAL const param_t* p, i64 i, int present)
{
    return present ? PLOAD(p, i) : (real)0;
}

/* The first token of row r, and one past its last. */
INLINE_FN i64 ssm_first(i64 r, i64 S, GLOBAL const int* cu)
{
    return SSM_VARLEN ? (i64)cu[r] : r * S;
}

INLINE_FN i64 ssm_end(i64 r, i64 S, GLOBAL const int* cu)
{
    return SSM_VARLEN ? (i64)cu[r + 1] : r * S + S;
}

/* The entry of `state` that row r reads and writes. */
INLINE_FN i64 ssm_slot(i64 r, GLOBAL const int* slots)
{
    return SSM_SLOTS ? (i64)slots[r] : r;
}


/* One state row's states in a saved forward (docs/abi.md 6a.1, in the compute type, which is the layout's
 * element type on every device: f64 state or parameters beside a narrower thunk run on the host): the state
 * leaving chunk k of `every` tokens of the row at at[k * stride + n]. Rows never are packed sequences (a
 * reserve with cu_seqlens is refused), so row r's tokens are r*S .. r*S + S-1. */
typedef struct {
    GLOBAL real* at;
    i64 stride, every;
} ssm_saved;

/* Row r's state row `entry` (its index among the state rows of one chunk: selective_scan's channel, mamba2's
 * (head, p)) of `entries`, in the reserve at rsb + rso, for rows of S tokens. */
INLINE_FN ssm_saved ssm_saved_of(GLOBAL uchar* rsb, i64 rso, i64 r, i64 S, i64 every, i64 entries, i64 entry, i64 N)
{
    ssm_saved sv;
    sv.every = every;
    sv.stride = entries * N;
    sv.at = AT(real, rsb, rso) + (r * ((S + every - 1) / every) * entries + entry) * N;
    return sv;
}

/* Whether token tok of a row of tokens [t0, t1) ends a chunk of the saved forward (the remainder by a
 * multiplication: a division and a remainder of the same operands become a `freeze`, which Oclgrind rejects). */
INLINE_FN int ssm_saved_ends(ssm_saved sv, i64 tok, i64 t0, i64 t1)
{
    return tok + 1 == t1 || (tok + 1 - t0) / sv.every * sv.every == tok + 1 - t0;
}

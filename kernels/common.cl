/* Shared by every family, after the dialect prelude: element types and 16-bit conversions.
 * rlx_gpu/backends/programs.py defines RLX_DT (F32 | F16 | BF16 | F64), RLX_REAL and RLX_STORE_T for
 * the launch's dtype, RLX_SRC_DT for the source side of a cast, RLX_TARGET_CPU or RLX_TARGET_GPU with
 * the target's tuning constants (launches/limits.py), and the launch's own compile-time variant. */
typedef RLX_REAL real;

/* Fully unroll the next loop (constant trip count): both OpenCL C and CUDA honour #pragma unroll. */
#define PRAGMA_UNROLL _Pragma("unroll")
/* Keep the next loop rolled (where a full unroll of a constant trip count costs registers, not time). */
#define PRAGMA_NO_UNROLL _Pragma("unroll 1")
/* A device function that must inline (so a caller's constant arguments fold and its unrolled copies
 * vectorize): PoCL's inliner leaves larger static inline functions out of line; CUDA's DEVICE_FN
 * already forces it, and both compilers take the GNU attribute. */
#define INLINE_FN DEVICE_FN __attribute__((always_inline))
typedef RLX_STORE_T store_t;

/* bf16 is the upper half of an f32; the store rounds to nearest even and keeps NaN a (quiet) NaN. */
DEVICE_FN ushort rlx_f32_to_bf16(float f)
{
    uint u = F32_TO_BITS(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (ushort)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (ushort)(u >> 16);
}

#define LOAD_BF16(p, i) BITS_TO_F32(((uint)((GLOBAL const ushort*)(p))[i]) << 16)
#define STORE_BF16(p, i, v) (((GLOBAL ushort*)(p))[i] = rlx_f32_to_bf16((float)(v)))

#define RLX_LD_F32(p, i) ((GLOBAL const float*)(p))[i]
#define RLX_ST_F32(p, i, v) (((GLOBAL float*)(p))[i] = (float)(v))
#define RLX_LD_F64(p, i) ((GLOBAL const double*)(p))[i]
#define RLX_ST_F64(p, i, v) (((GLOBAL double*)(p))[i] = (double)(v))
#define RLX_LD_F16(p, i) LOAD_F16(p, i)
#define RLX_ST_F16(p, i, v) STORE_F16(p, i, v)
#define RLX_LD_BF16(p, i) LOAD_BF16(p, i)
#define RLX_ST_BF16(p, i, v) STORE_BF16(p, i, v)

#define RLX_CAT2(a, b) a##b
#define RLX_CAT(a, b) RLX_CAT2(a, b)
/* LOAD gives the compute type; STORE rounds to the storage type (nearest even). */
#define LOAD(p, i) ((real)RLX_CAT(RLX_LD_, RLX_DT)(p, i))
#define STORE(p, i, v) RLX_CAT(RLX_ST_, RLX_DT)(p, i, v)
#ifdef RLX_SRC_DT
#define SRC_LOAD(p, i) RLX_CAT(RLX_LD_, RLX_SRC_DT)(p, i)
#endif

/* A tensor that is either arena storage (dtype) or backend scratch kept in the compute type. */
DEVICE_FN real load_any(GLOBAL const uchar* p, i64 i, int is_real)
{
    return is_real ? ((GLOBAL const real*)p)[i] : LOAD(p, i);
}

DEVICE_FN void store_any(GLOBAL uchar* p, i64 i, int is_real, real v)
{
    if (is_real)
        ((GLOBAL real*)p)[i] = v;
    else
        STORE(p, i, v);
}

DEVICE_FN real sigmoid_r(real x) { return (real)1 / ((real)1 + exp(-x)); }

/* The fast exp of the recurrent and state-space kernels. f64 (and any non-f32 compute type) keeps the
 * library exp. gpu target: the hardware exp (HW_EXP_F32, from the dialect prelude; one MUFU op on
 * NVIDIA instead of a dozen FMAs). cpu target: exp in plain arithmetic (Cephes' expf: Cody-Waite
 * reduction, degree-6 polynomial, exponent by bits; relative error ~2e-7 in [-87, 88], the argument
 * clamped to that range, NaN carried through the arithmetic): it inlines and vectorizes inside unrolled
 * straight-line loops where the library exp is an opaque scalar call (PoCL). No selects for the special
 * cases: each one measured costs as much as the whole polynomial there. */
INLINE_FN real rlx_exp(real x)
{
    if (sizeof(real) != 4)
        return exp(x);
#ifdef RLX_TARGET_GPU
    return (real)HW_EXP_F32((float)x);
#else
    const float xl = (float)x < -87.0f ? -87.0f : (float)x, xc = xl > 88.0f ? 88.0f : xl;
    const float y = xc * 1.44269504088896341f + 0.5f, tr = (float)(int)y;
    const float nf = tr > y ? tr - 1.0f : tr; /* floor(y) without a library call */
    const float f = (xc - nf * 0.693359375f) + nf * 2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * f + 1.3981999507E-3f;
    p = p * f + 8.3334519073E-3f;
    p = p * f + 4.1665795894E-2f;
    p = p * f + 1.6666665459E-1f;
    p = p * f + 5.0000001201E-1f;
    p = p * f * f + f + 1.0f;
    return (real)(p * BITS_TO_F32((uint)((int)nf + 127) << 23));
#endif
}

#ifdef SSM_L /* the state-space programs' gpu variants: a row's state spread over SSM_L lanes */
/* The sum of the SSM_L partial sums at part[at .. at+SSM_L) (LOCAL). */
INLINE_FN real ssm_row_sum(LOCAL_PTR const real* part, int at)
{
    real y = part[at];
    PRAGMA_UNROLL
    for (int l = 1; l < SSM_L; ++l)
        y += part[at + l];
    return y;
}
#endif

#ifdef RLX_MMA /* a launch's tensor-core variant (CUDA; kernels_cuda/prelude.cuh) */
/* The k-th 16x16 tile on or below the diagonal of a chunk's square product, row by row: its tile row, and
 * through *sj its tile column (k < tiles * (tiles + 1) / 2 for `tiles` tiles a side). */
INLINE_FN int mma_lower_tile(int k, int* sj)
{
    int ti = 0;
    while ((ti + 1) * (ti + 2) / 2 <= k)
        ++ti;
    *sj = k - ti * (ti + 1) / 2;
    return ti;
}

/* Product tile k of a chunk scan's (of lower + 16-step tiles): the square product's tiles (ti, sj) on and below the
 * diagonal (`lower` of them), row by row, then the state tiles of steps 16ti.. (sj = -1). */
INLINE_FN int mma_product_tile(int k, int lower, int* sj)
{
    *sj = -1;
    return k < lower ? mma_lower_tile(k, sj) : k - lower;
}

/* A chunk scan's LOCAL tiles of the MMA variant (mamba2_chunk_scan, mamba3_chunk_scan), for chunks of q steps and
 * tiles of pt rows: gm [q][q] f32, the square product (C.B^T, q~.k~^T) and then its diagonal tiles weighted; gmm
 * the operands below the diagonal (TF32: gm itself); ys [q][pt] f32, the output tile; rows, cols [q][16] and st
 * [pt][16], a slice of 16 columns of the square product's two factors and of the entering state. A kernel
 * declares the arrays itself (OpenCL wants LOCAL arrays at kernel scope) and puts them in one of these. */
typedef struct {
    LOCAL_PTR float* gm;
    LOCAL_PTR float* ys;
    LOCAL_PTR mma_t* gmm;
    LOCAL_PTR mma_t* rows;
    LOCAL_PTR mma_t* cols;
    LOCAL_PTR mma_t* st;
} mma_scan_local;

/* A warp's two product tiles of a chunk scan (mamba2_chunk_scan's C.B^T and C.S_in^T, mamba3_chunk_scan's
 * q~.k~^T and q~.S_in^T): tiles k = w and w + warps of mma_product_tile (`lower` square tiles, then `states`),
 * each with its accumulator (zero at first), row tile t, column tile s (-1: a state tile) and whether it exists. */
typedef struct {
    mma_acc a0, a1;
    int t0, s0, has0, t1, s1, has1;
} mma_scan_pair;

INLINE_FN mma_scan_pair mma_scan_pair_of(int w, int warps, int lower, int states)
{
    mma_scan_pair out;
    mma_zero(&out.a0);
    mma_zero(&out.a1);
    out.t0 = mma_product_tile(w, lower, &out.s0);
    out.t1 = mma_product_tile(w + warps, lower, &out.s1);
    out.has0 = w < lower + states;
    out.has1 = w + warps < lower + states;
    return out;
}

/* One slice of 16 columns into the pair's accumulators: rows [steps][16] (a), the square product's columns
 * [steps][16] (b), the state's [16][16] (st). */
INLINE_FN void mma_scan_pair_add(mma_scan_pair* m, LOCAL_PTR const mma_t* a, LOCAL_PTR const mma_t* b,
                                 LOCAL_PTR const mma_t* st)
{
    if (m->has0)
        mma_tile(&m->a0, MMA_ROW, a + m->t0 * 256, 16, MMA_COL, m->s0 < 0 ? st : b + m->s0 * 256, 16);
    if (m->has1)
        mma_tile(&m->a1, MMA_ROW, a + m->t1 * 256, 16, MMA_COL, m->s1 < 0 ? st : b + m->s1 * 256, 16);
}

/* The pair's tiles stored, f32: the square product's in gm (rows q apart), the state's in ys (rows pt apart). */
INLINE_FN void mma_scan_pair_store(const mma_scan_pair* m, LOCAL_PTR float* gm, int q, LOCAL_PTR float* ys, int pt)
{
    if (m->has0)
        mma_store(m->s0 < 0 ? ys + m->t0 * 16 * pt : gm + m->t0 * 16 * q + m->s0 * 16, &m->a0, m->s0 < 0 ? pt : q);
    if (m->has1)
        mma_store(m->s1 < 0 ? ys + m->t1 * 16 * pt : gm + m->t1 * 16 * q + m->s1 * 16, &m->a1, m->s1 < 0 ? pt : q);
}

/* One warp's 16x16 f32 tile of A^T B over a chunk's `steps` (whole 16-step slices; the steps past `steps` zero in A
 * or B): A [steps][16] (16 rows of the tile per step), B [steps][ldb] from column 16w; stored at out + 16w, rows
 * ldb apart (the chunk's own state of mamba2_chunk_state and mamba3_chunk_state). */
INLINE_FN void mma_steps_tile(LOCAL_PTR float* out, LOCAL_PTR const mma_t* a, LOCAL_PTR const mma_t* b, int ldb,
                              int steps, int w)
{
    mma_acc acc;
    mma_zero(&acc);
    for (int s0 = 0; s0 < steps; s0 += 16)
        mma_tile(&acc, MMA_COL, a + s0 * 16, 16, MMA_ROW, b + s0 * ldb + w * 16, ldb);
    mma_store(out + w * 16, &acc, ldb);
}
#endif

/* The tensor-core words of kernels_cuda/prelude.cuh (RLX_MMA) emulated in OpenCL C, so that the tests run the
 * MMA variants' kernel text -- its tiling, staging, masks and rounding to the operand type -- on an OpenCL CPU
 * device (tests/devices/test_mma_emulated.py), where no tensor core exists. Inserted after the OpenCL prelude
 * with RLX_MMA_EMULATED defined (which lets that prelude take RLX_MMA). A warp is 32 consecutive lanes; lane l
 * of a warp holds elements 8l .. 8l+7 (row-major) of its 16x16 accumulator tile, as a private array; a tile
 * product is plain f32 arithmetic on operands read from LOCAL memory, rounded as the hardware rounds them. */
typedef float mma_t;
typedef struct {
    float x[8];
} mma_acc;
#define MMA_LOCAL LOCAL
#define MMA_WARP(lane) ((lane) >> 5)
#define MMA_ROW 1
#define MMA_COL 0
#define RLX_EMU_CAT_(a, b) a##b
#define RLX_EMU_CAT(a, b) RLX_EMU_CAT_(a, b)

/* f32 to f16 and back, to nearest even (vstore_half_rte; no cl_khr_fp16 needed) */
DEVICE_FN float mma_round_F16(float v)
{
    ushort bits;
    vstore_half_rte(v, 0, (__private half*)&bits);
    return vload_half(0, (__private const half*)&bits);
}

/* f32 to bf16 and back, to nearest even (NaN kept) */
DEVICE_FN float mma_round_BF16(float v)
{
    const uint u = as_uint(v);
    return v != v ? v : as_float((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}

/* TF32 keeps f32 in LOCAL memory; the hardware rounds an operand as it enters the product (cvt.rna.tf32.f32:
 * 10 mantissa bits, to nearest, ties away from zero) */
DEVICE_FN float mma_round_F32(float v) { return v; }
DEVICE_FN float mma_operand(float v)
{
#if RLX_MMA == 2
    return v != v ? v : as_float((as_uint(v) + 0x1000u) & 0xFFFFE000u);
#else
    return v;
#endif
}

#define TO_MMA(v) RLX_EMU_CAT(mma_round_, RLX_DT)((float)(v))
#define FROM_MMA(v) ((float)(v))

DEVICE_FN void mma_zero(mma_acc* acc)
{
    for (int j = 0; j < 8; ++j)
        acc->x[j] = 0.0f;
}

/* *acc += A B over one 16x16x16 tile (a_layout MMA_ROW: a[i*lda + k], else a[k*lda + i]; b_layout MMA_ROW:
 * b[k*ldb + j], else b[j*ldb + k]): this lane's 8 elements */
DEVICE_FN void mma_tile(mma_acc* acc, int a_layout, LOCAL_PTR const float* a, int lda, int b_layout,
                        LOCAL_PTR const float* b, int ldb)
{
    const int l = (int)(LID(0) & 31);
    for (int j = 0; j < 8; ++j) {
        const int e = l * 8 + j, i = e / 16, c = e % 16;
        float sum = acc->x[j];
        for (int k = 0; k < 16; ++k)
            sum += mma_operand(a[a_layout == MMA_ROW ? i * lda + k : k * lda + i])
                   * mma_operand(b[b_layout == MMA_ROW ? k * ldb + c : c * ldb + k]);
        acc->x[j] = sum;
    }
}

DEVICE_FN void mma_store(LOCAL_PTR float* p, const mma_acc* acc, int ld)
{
    const int l = (int)(LID(0) & 31);
    for (int j = 0; j < 8; ++j)
        p[(l * 8 + j) / 16 * ld + (l * 8 + j) % 16] = acc->x[j];
}

DEVICE_FN void mma_store_global(GLOBAL float* p, const mma_acc* acc, int ld)
{
    const int l = (int)(LID(0) & 31);
    for (int j = 0; j < 8; ++j)
        p[(l * 8 + j) / 16 * ld + (l * 8 + j) % 16] = acc->x[j];
}

DEVICE_FN void mma_load(mma_acc* acc, LOCAL_PTR const float* p, int ld)
{
    const int l = (int)(LID(0) & 31);
    for (int j = 0; j < 8; ++j)
        acc->x[j] = p[(l * 8 + j) / 16 * ld + (l * 8 + j) % 16];
}

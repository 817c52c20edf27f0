/* CUDA C++ dialect of the portable kernel vocabulary (DESIGN.md principle 1), for NVRTC.
 * the family texts in kernels/ are written only in these words; kernels_opencl/prelude.cl defines the same ones. */
#include <cuda_fp16.h>

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef long long i64;

#define KERNEL extern "C" __global__ void
/* A kernel launched with work-groups of at most `lanes` lanes, `groups` of which should fit on one SM at
 * once: ptxas then holds the kernel within 65536 / (lanes * groups) registers, where it would otherwise
 * spend registers freely on scheduling. */
#define KERNEL_BOUNDED(lanes, groups) extern "C" __global__ void __launch_bounds__(lanes, groups)
#define GLOBAL
#define LOCAL __shared__
/* A function parameter pointing into LOCAL memory: a CUDA pointer is generic (once the function is inlined,
 * NVVM sees the __shared__ array it points into). */
#define LOCAL_PTR
#define DEVICE_FN static __device__ __forceinline__
/* GID(0) -> x: the dimension argument is always a literal, so token pasting picks the member. */
#define RLX_AXIS_0 x
#define RLX_AXIS_1 y
#define RLX_AXIS_2 z
#define RLX_AXIS(d) RLX_AXIS_##d
#define GID(d) ((i64)blockIdx.RLX_AXIS(d) * (i64)blockDim.RLX_AXIS(d) + (i64)threadIdx.RLX_AXIS(d))
#define LID(d) ((i64)threadIdx.RLX_AXIS(d))
#define GROUP(d) ((i64)blockIdx.RLX_AXIS(d))
#define LSIZE(d) ((i64)blockDim.RLX_AXIS(d))
#define GSIZE(d) ((i64)gridDim.RLX_AXIS(d) * (i64)blockDim.RLX_AXIS(d))
#define BARRIER() __syncthreads()

#define AT(T, base, off) ((T*)((uchar*)(base) + (off)))

#define BITS_TO_F32(u) __uint_as_float((uint)(u))
#define F32_TO_BITS(f) __float_as_uint((float)(f))

#define LOAD_F16(p, i) __half2float(__ushort_as_half(((const ushort*)(p))[i]))
#define STORE_F16(p, i, v) (((ushort*)(p))[i] = __half_as_ushort(__float2half_rn((float)(v))))

/* The hardware exp of the gpu target: ex2.approx.f32 (MUFU, ~2 ulp) on x*log2(e). Not __expf, which is
 * ex2.approx.ftz.f32 and flushes subnormal results to zero; exp2f without -ftz is the same instruction
 * without the flush. */
#define HW_EXP_F32(x) exp2f((x) * 1.44269504088896341f)

#ifdef RLX_MMA
/* The tensor-core words of a launch's RLX_MMA variant (CUDA only; kernels_opencl/prelude.cl refuses it):
 * RLX_MMA 1, 16-bit operands (the thunk's own f16 / bf16) with f32 accumulation; RLX_MMA 2, TF32 operands
 * from f32 (only when asked for: RLX_CUDA_TF32=1). The kernel text deals in one warp's 16x16 f32
 * accumulator tiles (mma_acc) and 16x16x16 products of mma_t operands in LOCAL memory (MMA_TILE); TF32's
 * native k is 8, so a tile is two of its steps. Written as macros over plain C: the tests run the same
 * text on an OpenCL CPU device with these words emulated (tests/support/mma_emulation.cl). */
#include <cuda_bf16.h>
#include <mma.h>
#define RLX_MMA_CAT_(a, b) a##b
#define RLX_MMA_CAT(a, b) RLX_MMA_CAT_(a, b)
#define RLX_MMA_T_F16 __half
#define RLX_MMA_T_BF16 __nv_bfloat16
#define RLX_MMA_T_F32 float
#define RLX_TO_MMA_F16(v) __float2half_rn(v)
#define RLX_TO_MMA_BF16(v) __float2bfloat16_rn(v)
#define RLX_TO_MMA_F32(v) (v)
/* an operand element in LOCAL memory, an f32 value rounded to it (TF32 rounds in MMA_TILE), and back (exact) */
typedef RLX_MMA_CAT(RLX_MMA_T_, RLX_DT) mma_t;
#define TO_MMA(v) RLX_MMA_CAT(RLX_TO_MMA_, RLX_DT)((float)(v))
#define FROM_MMA(v) ((float)(v))
#if RLX_MMA == 2
typedef nvcuda::wmma::precision::tf32 mma_in_t;
#define MMA_K 8
#else
typedef mma_t mma_in_t;
#define MMA_K 16
#endif
#define MMA_ROW nvcuda::wmma::row_major
#define MMA_COL nvcuda::wmma::col_major
/* a 16x16 f32 accumulator tile of one warp */
typedef nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, MMA_K, float> mma_acc;
/* whether a layout tag is row-major (the tags are incomplete types: only a template can tell them apart) */
template <typename L> struct mma_is_row;
template <> struct mma_is_row<MMA_ROW> { static constexpr bool value = true; };
template <> struct mma_is_row<MMA_COL> { static constexpr bool value = false; };

template <typename Frag> DEVICE_FN void mma_round(Frag& f)
{
#if RLX_MMA == 2
    for (int i = 0; i < f.num_elements; ++i)
        f.x[i] = nvcuda::wmma::__float_to_tf32(f.x[i]);
#endif
}

/* acc += A B over one 16x16x16 tile, warp-wide: A (16 x 16) at `a` with leading dimension `lda`, laid out
 * as LA (MMA_ROW: a[i*lda + k]; MMA_COL: a[k*lda + i]), B (16 x 16) at `b` as LB (MMA_ROW: b[k*ldb + j];
 * MMA_COL: b[j*ldb + k]). Leading dimensions are multiples of 8 elements, tiles 32-byte aligned. */
template <typename LA, typename LB>
DEVICE_FN void mma_tile(mma_acc& acc, const mma_t* a, unsigned lda, const mma_t* b, unsigned ldb)
{
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, MMA_K, mma_in_t, LA> fa;
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, MMA_K, mma_in_t, LB> fb;
    for (int k = 0; k < 16; k += MMA_K) {
        /* the k-th slice: along A's rows and down B's columns */
        nvcuda::wmma::load_matrix_sync(fa, a + (mma_is_row<LA>::value ? k : k * lda), lda);
        nvcuda::wmma::load_matrix_sync(fb, b + (mma_is_row<LB>::value ? k * ldb : k), ldb);
        mma_round(fa);
        mma_round(fb);
        nvcuda::wmma::mma_sync(acc, fa, fb, acc);
    }
}

/* The words the kernel text uses (LA, LB: ROW or COL); the accumulator to / from a row-major f32 tile in
 * LOCAL memory (leading dimension a multiple of 4) */
#define MMA_TILE(acc, LA, a, lda, LB, b, ldb) mma_tile<MMA_##LA, MMA_##LB>(acc, a, lda, b, ldb)
#define MMA_ZERO(acc) nvcuda::wmma::fill_fragment(acc, 0.0f)
#define MMA_STORE(p, acc, ld) nvcuda::wmma::store_matrix_sync(p, acc, ld, nvcuda::wmma::mem_row_major)
#define MMA_LOAD(acc, p, ld) nvcuda::wmma::load_matrix_sync(acc, p, ld, nvcuda::wmma::mem_row_major)
/* LOCAL memory holding MMA tiles (32-byte aligned, as wmma's loads and stores want), and the warp of a lane */
#define MMA_LOCAL __shared__ __align__(32)
#define MMA_WARP(lane) ((lane) >> 5)
#endif

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
 * accumulator tiles (mma_acc) and 16x16x16 products of mma_t operands in LOCAL memory (mma_tile); TF32's
 * native k is 8, so a tile is two of its steps. Plain C functions taking pointers: the tests run the same
 * text on an OpenCL CPU device with these words emulated (tests/support/mma_emulation.cl). */
#include <cuda_bf16.h>
#include <mma.h>
#define RLX_MMA_CAT_(a, b) a##b
#define RLX_MMA_CAT(a, b) RLX_MMA_CAT_(a, b)
typedef __half rlx_mma_F16;
typedef __nv_bfloat16 rlx_mma_BF16;
typedef float rlx_mma_F32;
#define RLX_TO_MMA_F16(v) __float2half_rn(v)
#define RLX_TO_MMA_BF16(v) __float2bfloat16_rn(v)
#define RLX_TO_MMA_F32(v) (v)
/* an operand element in LOCAL memory, an f32 value rounded to it (TF32 rounds in mma_tile), and back (exact) */
typedef RLX_MMA_CAT(rlx_mma_, RLX_DT) mma_t;
#define TO_MMA(v) RLX_MMA_CAT(RLX_TO_MMA_, RLX_DT)((float)(v))
#define FROM_MMA(v) ((float)(v))
#if RLX_MMA == 2
typedef nvcuda::wmma::precision::tf32 mma_in_t;
#define MMA_K 8
#else
typedef mma_t mma_in_t;
#define MMA_K 16
#endif
/* an operand's layout, as mma_tile takes it */
#define MMA_ROW 1
#define MMA_COL 0
typedef nvcuda::wmma::row_major mma_row_major;
typedef nvcuda::wmma::col_major mma_col_major;
/* a 16x16 f32 accumulator tile of one warp */
typedef nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, MMA_K, float> mma_acc;

template <typename Frag> DEVICE_FN void mma_round(Frag& f)
{
#if RLX_MMA == 2
    for (int i = 0; i < f.num_elements; ++i)
        f.x[i] = nvcuda::wmma::__float_to_tf32(f.x[i]);
#endif
}

template <typename LA, typename LB>
DEVICE_FN void mma_tile_as(mma_acc* acc, const mma_t* a, unsigned lda, const mma_t* b, unsigned ldb, int a_row, int b_row)
{
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, MMA_K, mma_in_t, LA> fa;
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, MMA_K, mma_in_t, LB> fb;
    for (int k = 0; k < 16; k += MMA_K) { /* the k-th slice: along A's rows and down B's columns */
        nvcuda::wmma::load_matrix_sync(fa, a + (a_row ? k : k * lda), lda);
        nvcuda::wmma::load_matrix_sync(fb, b + (b_row ? k * ldb : k), ldb);
        mma_round(fa);
        mma_round(fb);
        nvcuda::wmma::mma_sync(*acc, fa, fb, *acc);
    }
}

/* *acc += A B over one 16x16x16 tile, warp-wide: A (16 x 16) at `a` with leading dimension `lda`, laid out
 * as a_layout (MMA_ROW: a[i*lda + k]; MMA_COL: a[k*lda + i]), B (16 x 16) at `b` as b_layout (MMA_ROW:
 * b[k*ldb + j]; MMA_COL: b[j*ldb + k]). The layouts are literals (the branches fold once inlined); leading
 * dimensions are multiples of 8 elements, tiles 32-byte aligned. */
DEVICE_FN void mma_tile(mma_acc* acc, int a_layout, const mma_t* a, unsigned lda, int b_layout, const mma_t* b,
                        unsigned ldb)
{
    if (a_layout == MMA_ROW && b_layout == MMA_ROW)
        mma_tile_as<mma_row_major, mma_row_major>(acc, a, lda, b, ldb, 1, 1);
    else if (a_layout == MMA_ROW)
        mma_tile_as<mma_row_major, mma_col_major>(acc, a, lda, b, ldb, 1, 0);
    else if (b_layout == MMA_ROW)
        mma_tile_as<mma_col_major, mma_row_major>(acc, a, lda, b, ldb, 0, 1);
    else
        mma_tile_as<mma_col_major, mma_col_major>(acc, a, lda, b, ldb, 0, 0);
}

DEVICE_FN void mma_zero(mma_acc* acc) { nvcuda::wmma::fill_fragment(*acc, 0.0f); }
/* the accumulator to / from a row-major f32 tile in LOCAL memory (leading dimension a multiple of 4) */
DEVICE_FN void mma_store(float* p, const mma_acc* acc, unsigned ld)
{
    nvcuda::wmma::store_matrix_sync(p, *acc, ld, nvcuda::wmma::mem_row_major);
}
/* the same into GLOBAL memory (a CUDA pointer is generic; the emulation's OpenCL names the address space) */
DEVICE_FN void mma_store_global(float* p, const mma_acc* acc, unsigned ld) { mma_store(p, acc, ld); }
DEVICE_FN void mma_load(mma_acc* acc, const float* p, unsigned ld)
{
    nvcuda::wmma::load_matrix_sync(*acc, p, ld, nvcuda::wmma::mem_row_major);
}
/* LOCAL memory holding MMA tiles (32-byte aligned, as wmma's loads and stores want), and the warp of a lane */
#define MMA_LOCAL __shared__ __align__(32)
#define MMA_WARP(lane) ((lane) >> 5)
#endif

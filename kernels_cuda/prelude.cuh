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

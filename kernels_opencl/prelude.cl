/* OpenCL C dialect of the portable kernel vocabulary (DESIGN.md principle 1).
 * the family texts in kernels/ are written only in these words; kernels_cuda/prelude.cuh defines the same ones. */
#ifdef RLX_NEED_FP64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#endif

typedef long i64;

#define KERNEL __kernel void
/* A kernel launched with work-groups of at most `lanes` lanes (CUDA bounds its registers by it; here a hint). */
#define KERNEL_BOUNDED(lanes, groups) __kernel __attribute__((work_group_size_hint(lanes, 1, 1))) void
#define GLOBAL __global
#define LOCAL __local
/* A function parameter pointing into LOCAL memory: OpenCL names its address space. */
#define LOCAL_PTR __local
#define DEVICE_FN static inline
#define GID(d) ((i64)get_global_id(d))
#define LID(d) ((i64)get_local_id(d))
#define GROUP(d) ((i64)get_group_id(d))
#define LSIZE(d) ((i64)get_local_size(d))
#define GSIZE(d) ((i64)get_global_size(d))
#define BARRIER() barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE)

/* Rebase an arena pointer by a 64-bit byte offset: the only way a kernel reaches a tensor. */
#define AT(T, base, off) ((GLOBAL T*)((GLOBAL uchar*)(base) + (off)))

#define BITS_TO_F32(u) as_float((uint)(u))
#define F32_TO_BITS(f) as_uint((float)(f))

/* f16 storage needs no cl_khr_fp16: vload_half/vstore_half_rte are core and round to nearest even. */
#define LOAD_F16(p, i) vload_half((i), (GLOBAL const half*)(p))
#define STORE_F16(p, i, v) vstore_half_rte((float)(v), (i), (GLOBAL half*)(p))

/* The hardware exp of the gpu target (the device's own precision; PoCL and Oclgrind give exp's). */
#define HW_EXP_F32(x) exp(x)

/* RLX_MMA (the tensor-core variants) is CUDA's alone: an OpenCL launch never asks for it (the tests run its text
 * with the tensor-core words emulated: RLX_MMA_EMULATED) */
#if defined(RLX_MMA) && !defined(RLX_MMA_EMULATED)
#error "RLX_MMA (tensor-core variants) is CUDA's alone: an OpenCL launch never asks for it"
#endif

/* Split tensor-core operands (issue 38): where rounding an f32 operand once to the MMA operand type moves a sum whose
 * terms cancel past the conformance bounds, a variant takes v = hi + lo, hi = mma_hi(v) (v as the tensor cores take
 * it), lo = v - hi (rounded in turn as it enters the product), as the three products hi.hi + hi.lo + lo.hi with f32
 * accumulation. Shared by the RLX_MMA variants of mamba2_backward_chunk, mamba3_cb_chunk and mamba2_chunk_state as
 * mamba2's backward launches it (M2_SPLIT_STATES); empty in the portable programs. */
#ifdef RLX_MMA
#if RLX_MMA == 2
/* TF32 as cvt.rna.tf32.f32 rounds (10 mantissa bits, to nearest, ties away from zero; NaN kept) */
INLINE_FN float mma_hi(float v)
{
    return v != v ? v : BITS_TO_F32((F32_TO_BITS(v) + 0x1000u) & 0xFFFFE000u);
}
#else
/* the thunk's own 16-bit type, to nearest even */
INLINE_FN float mma_hi(float v)
{
    return FROM_MMA(TO_MMA(v));
}
#endif
#endif

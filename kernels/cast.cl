/* cast family: one small program per (dtype, source dtype), so that a cast never rebuilds the body
 * family (RLX_SRC_DT is defined only for casts). */

#ifdef RLX_SRC_DT
/* dst[0:n] = src[0:n] converted from RLX_SRC_DT to the dtype */
KERNEL cast(GLOBAL uchar* sb, i64 so, GLOBAL uchar* db, i64 dof, i64 n)
{
    GLOBAL const uchar* src = AT(uchar, sb, so);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    const i64 i = GID(0);
    if (i < n)
        STORE(dst, i, SRC_LOAD(src, i));
}
#endif

/* Body ops (ABI.md §5) and the tiled GEMM that the recurrent family reuses for its input projection. */

/* RLX_UNARY_* / RLX_BINARY_* are emitted by rlx_gpu/backends/programs.py from launches/body.py FN_CODES. */
DEVICE_FN real unary_fn(int fn, real x)
{
    switch (fn) {
    case RLX_UNARY_EXP: return exp(x);
    case RLX_UNARY_LOG: return log(x);
    case RLX_UNARY_TANH: return tanh(x);
    case RLX_UNARY_SIGMOID: return sigmoid_r(x);
    case RLX_UNARY_RELU: return x < (real)0 ? (real)0 : x;  /* keeps NaN, as NumPy's maximum does */
    case RLX_UNARY_NEG: return -x;
    case RLX_UNARY_SQRT: return sqrt(x);
    case RLX_UNARY_RSQRT: return (real)1 / sqrt(x);
    case RLX_UNARY_SQUARE: return x * x;
    case RLX_UNARY_ABS: return fabs(x);
    case RLX_UNARY_RECIP: return (real)1 / x;
    case RLX_UNARY_SOFTPLUS: return fmax(x, (real)0) + log1p(exp(-fabs(x)));  /* softplus without overflow */
    case RLX_UNARY_STEP: default: return x > (real)0 ? (real)1 : (real)0;
    }
}

DEVICE_FN real binary_fn(int fn, real a, real b)
{
    switch (fn) {
    case RLX_BINARY_ADD: return a + b;
    case RLX_BINARY_SUB: return a - b;
    case RLX_BINARY_MUL: return a * b;
    case RLX_BINARY_DIV: return a / b;
    /* fmax/fmin drop a NaN operand; the ABI (like NumPy) propagates it. */
    case RLX_BINARY_MAX: return (a != a || b != b) ? a + b : fmax(a, b);
    case RLX_BINARY_MIN: default: return (a != a || b != b) ? a + b : fmin(a, b);
    }
}

KERNEL unary(GLOBAL uchar* xb, i64 xo, GLOBAL uchar* db, i64 dof, i64 n, int fn)
{
    GLOBAL const store_t* x = AT(store_t, xb, xo);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    const i64 i = GID(0);
    if (i >= n)
        return;
    STORE(dst, i, unary_fn(fn, LOAD(x, i)));
}

/* dst is dense with shape d0..d5 (padded in front with ones); a and b are read at element strides. */
KERNEL binary(GLOBAL uchar* ab, i64 ao, GLOBAL uchar* bb, i64 bo, GLOBAL uchar* db, i64 dof, i64 n, int fn,
              i64 d0, i64 d1, i64 d2, i64 d3, i64 d4, i64 d5,
              i64 as0, i64 as1, i64 as2, i64 as3, i64 as4, i64 as5,
              i64 bs0, i64 bs1, i64 bs2, i64 bs3, i64 bs4, i64 bs5)
{
    GLOBAL const store_t* a = AT(store_t, ab, ao);
    GLOBAL const store_t* b = AT(store_t, bb, bo);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    const i64 i = GID(0);
    if (i >= n)
        return;
    /* peel coordinates from the last dimension; the remainder is taken as rest - q*d (not %) because
     * LLVM turns a div/rem pair into a `freeze`, which Oclgrind's uninitialized-value checker rejects */
    i64 rest = i, q, ia = 0, ib = 0;
    q = rest / d5; ia += (rest - q * d5) * as5; ib += (rest - q * d5) * bs5; rest = q;
    q = rest / d4; ia += (rest - q * d4) * as4; ib += (rest - q * d4) * bs4; rest = q;
    q = rest / d3; ia += (rest - q * d3) * as3; ib += (rest - q * d3) * bs3; rest = q;
    q = rest / d2; ia += (rest - q * d2) * as2; ib += (rest - q * d2) * bs2; rest = q;
    q = rest / d1; ia += (rest - q * d1) * as1; ib += (rest - q * d1) * bs1; rest = q;
    ia += rest * as0;
    ib += rest * bs0;
    STORE(dst, i, binary_fn(fn, LOAD(a, ia), LOAD(b, ib)));
}

/* dst[z](r, c) = sum_k A[z](r, k) * B[z](k, c) (+ bias[z](c)); every operand is addressed by element
 * strides so one kernel serves transposed and batched matmul and the recurrent input projection.
 * An operand flagged *_real is backend scratch in the compute type, otherwise arena storage. */
#ifdef RLX_TARGET_GPU
/* gpu target: one work-group (GEMM_LX x GEMM_LY items, 1-D grid over batch x row tiles x column
 * tiles) computes a GEMM_TILE x GEMM_TILE block of D. Per GEMM_TK slice of the reduction, the items
 * stage A's and B's tiles in LOCAL memory (reading along whichever of A's axes is contiguous; zeros
 * past the edges), then each accumulates GEMM_TM x GEMM_TM outputs in registers: rows ty + i*GEMM_LY,
 * columns tx + j*GEMM_LX, so a warp's LOCAL reads are broadcasts or consecutive (no bank conflicts)
 * and its stores to D are consecutive columns. A's tile has one pad column against bank conflicts. */
#define GEMM_ITEMS (GEMM_LX * GEMM_LY)
#define GEMM_KT (GEMM_TK * 4 / (int)sizeof(real))  /* f64 stages half the slice: same LOCAL bytes as f32 */
KERNEL gemm(GLOBAL uchar* ab, i64 ao, int a_real, i64 a_bs, i64 a_rs, i64 a_cs,
            GLOBAL uchar* bb, i64 bo, int b_real, i64 b_bs, i64 b_rs, i64 b_cs,
            GLOBAL uchar* cb, i64 co, int has_bias, i64 c_bs,
            GLOBAL uchar* db, i64 dof, int d_real, i64 d_bs, i64 d_rs,
            i64 m, i64 n, i64 k)
{
    LOCAL real As[GEMM_KT][GEMM_TILE + 1];
    LOCAL real Bs[GEMM_KT][GEMM_TILE];
    GLOBAL const uchar* A = AT(uchar, ab, ao);
    GLOBAL const uchar* B = AT(uchar, bb, bo);
    GLOBAL const uchar* bias = AT(uchar, cb, co);
    GLOBAL uchar* D = AT(uchar, db, dof);
    const i64 tiles_n = (n + GEMM_TILE - 1) / GEMM_TILE, tiles = tiles_n * ((m + GEMM_TILE - 1) / GEMM_TILE);
    const i64 z = GROUP(0) / tiles, t = GROUP(0) - z * tiles, tm = t / tiles_n;
    const i64 row0 = tm * GEMM_TILE, col0 = (t - tm * tiles_n) * GEMM_TILE;
    const int tx = (int)LID(0), ty = (int)LID(1), item = ty * GEMM_LX + tx;
    const int a_k_fast = a_cs == 1;  /* A's rows contiguous: consecutive items read consecutive k */
    real acc[GEMM_TM][GEMM_TM];
    PRAGMA_UNROLL
    for (int i = 0; i < GEMM_TM; ++i)
        PRAGMA_UNROLL
        for (int j = 0; j < GEMM_TM; ++j)
            acc[i][j] = (real)0;
    for (i64 k0 = 0; k0 < k; k0 += GEMM_KT) {
        PRAGMA_UNROLL
        for (int s = 0; s < GEMM_KT * GEMM_TILE / GEMM_ITEMS; ++s) {
            /* element e of a tile as (slow, fast) coordinates; remainders as e - q*d, not %: LLVM turns a
             * div/rem pair into a `freeze`, which Oclgrind's uninitialized-value checker rejects */
            const int e = item + s * GEMM_ITEMS, ek = e / GEMM_KT, et = e / GEMM_TILE;
            const int kk = a_k_fast ? e - ek * GEMM_KT : et, r = a_k_fast ? ek : e - et * GEMM_TILE;
            const i64 row = row0 + r, kq = k0 + kk;
            As[kk][r] = (row < m && kq < k) ? load_any(A, z * a_bs + row * a_rs + kq * a_cs, a_real) : (real)0;
            const int kb = et, c = e - et * GEMM_TILE;
            const i64 col = col0 + c, kr = k0 + kb;
            Bs[kb][c] = (col < n && kr < k) ? load_any(B, z * b_bs + kr * b_rs + col * b_cs, b_real) : (real)0;
        }
        BARRIER();
        PRAGMA_UNROLL
        for (int kk = 0; kk < GEMM_KT; ++kk) {
            real av[GEMM_TM], bv[GEMM_TM];
            PRAGMA_UNROLL
            for (int i = 0; i < GEMM_TM; ++i)
                av[i] = As[kk][ty + i * GEMM_LY];
            PRAGMA_UNROLL
            for (int j = 0; j < GEMM_TM; ++j)
                bv[j] = Bs[kk][tx + j * GEMM_LX];
            PRAGMA_UNROLL
            for (int i = 0; i < GEMM_TM; ++i)
                PRAGMA_UNROLL
                for (int j = 0; j < GEMM_TM; ++j)
                    acc[i][j] += av[i] * bv[j];
        }
        BARRIER();
    }
    PRAGMA_UNROLL
    for (int j = 0; j < GEMM_TM; ++j) {
        const i64 col = col0 + tx + j * GEMM_LX;
        if (col < n) {
            const real bval = has_bias ? LOAD(bias, z * c_bs + col) : (real)0;
            PRAGMA_UNROLL
            for (int i = 0; i < GEMM_TM; ++i) {
                const i64 row = row0 + ty + i * GEMM_LY;
                if (row < m)
                    store_any(D, z * d_bs + row * d_rs + col, d_real, acc[i][j] + bval);
            }
        }
    }
}
#else
/* cpu target: each item computes a GEMM_RM x GEMM_CN block as rank-1 updates per k: GEMM_RM broadcast A values
 * times a contiguous run of GEMM_CN B values, with no barrier, so the sums stay in registers. The
 * loops are unrolled and, for a full run of columns with B's columns contiguous, the B run is addressed
 * as base + jj so compilers emit vector loads and FMAs (6 x 16 is the classic AVX2 register block: 12
 * accumulators, 2 B vectors, 1 broadcast). Edge runs and strided B take the clamped path. Rows past
 * the edge are clamped on load and dropped on store. */

/* acc = the sums over k of A's rows ra[i] times B's columns: column jj starts at bcol[jj], or at brun + jj
 * where `run` (a full run of contiguous columns, which compilers load as vectors). A and B are arena storage
 * or, with a_real / b_real, the compute type; every flag is a constant at each call, so the loads fold to
 * one form per call. */
INLINE_FN void gemm_sums(real acc[GEMM_RM][GEMM_CN], GLOBAL const uchar* A, int a_real, const i64* ra, i64 a_cs,
                         GLOBAL const uchar* B, int b_real, const i64* bcol, i64 brun, int run, i64 b_rs, i64 k)
{
    PRAGMA_UNROLL
    for (int i = 0; i < GEMM_RM; ++i)
        PRAGMA_UNROLL
        for (int jj = 0; jj < GEMM_CN; ++jj)
            acc[i][jj] = (real)0;
    for (i64 kk = 0; kk < k; ++kk) {
        real av[GEMM_RM], bv[GEMM_CN];
        PRAGMA_UNROLL
        for (int i = 0; i < GEMM_RM; ++i)
            av[i] = load_any(A, ra[i] + kk * a_cs, a_real);
        PRAGMA_UNROLL
        for (int jj = 0; jj < GEMM_CN; ++jj)
            bv[jj] = load_any(B, (run ? brun + jj : bcol[jj]) + kk * b_rs, b_real);
        PRAGMA_UNROLL
        for (int i = 0; i < GEMM_RM; ++i)
            PRAGMA_UNROLL
            for (int jj = 0; jj < GEMM_CN; ++jj)
                acc[i][jj] += av[i] * bv[jj];
    }
}

KERNEL gemm(GLOBAL uchar* ab, i64 ao, int a_real, i64 a_bs, i64 a_rs, i64 a_cs,
            GLOBAL uchar* bb, i64 bo, int b_real, i64 b_bs, i64 b_rs, i64 b_cs,
            GLOBAL uchar* cb, i64 co, int has_bias, i64 c_bs,
            GLOBAL uchar* db, i64 dof, int d_real, i64 d_bs, i64 d_rs,
            i64 m, i64 n, i64 k)
{
    GLOBAL const uchar* A = AT(uchar, ab, ao);
    GLOBAL const uchar* B = AT(uchar, bb, bo);
    GLOBAL const uchar* bias = AT(uchar, cb, co);
    GLOBAL uchar* D = AT(uchar, db, dof);
    const i64 z = GID(2), row0 = GID(1) * GEMM_RM, col0 = GID(0) * GEMM_CN;
    if (row0 >= m || col0 >= n)
        return;
    i64 ra[GEMM_RM], cb_[GEMM_CN];
    PRAGMA_UNROLL
    for (int i = 0; i < GEMM_RM; ++i)
        ra[i] = z * a_bs + (row0 + i < m ? row0 + i : m - 1) * a_rs;
    PRAGMA_UNROLL
    for (int jj = 0; jj < GEMM_CN; ++jj)
        cb_[jj] = z * b_bs + (col0 + jj < n ? col0 + jj : n - 1) * b_cs;
    const i64 cbase = z * b_bs + col0;
    real acc[GEMM_RM][GEMM_CN];
    if (b_cs == 1 && col0 + GEMM_CN <= n) {
        if (a_real && b_real)
            gemm_sums(acc, A, 1, ra, a_cs, B, 1, cb_, cbase, 1, b_rs, k);
        else if (a_real)
            gemm_sums(acc, A, 1, ra, a_cs, B, 0, cb_, cbase, 1, b_rs, k);
        else if (b_real)
            gemm_sums(acc, A, 0, ra, a_cs, B, 1, cb_, cbase, 1, b_rs, k);
        else
            gemm_sums(acc, A, 0, ra, a_cs, B, 0, cb_, cbase, 1, b_rs, k);
    } else {
        gemm_sums(acc, A, a_real, ra, a_cs, B, b_real, cb_, cbase, 0, b_rs, k);
    }
    for (int jj = 0; jj < GEMM_CN; ++jj) {
        const i64 col = col0 + jj;
        if (col >= n)
            break;
        const real bval = has_bias ? LOAD(bias, z * c_bs + col) : (real)0;
        for (int i = 0; i < GEMM_RM; ++i)
            if (row0 + i < m)
                store_any(D, z * d_bs + (row0 + i) * d_rs + col, d_real, acc[i][jj] + bval);
    }
}
#endif

/* dst[z][c][r] = src[z](r, c) in the compute type, src (arena storage, or compute-type scratch: s_real) at
 * element strides (batch, row, col): gives the gemm a B operand whose columns are contiguous, or an A operand
 * whose rows are. Columns and batch items past the grid are strided over (the gpu target caps grid y/z). */
KERNEL transpose_real(GLOBAL uchar* sb, i64 so, int s_real, i64 s_bs, i64 s_rs, i64 s_cs,
                      GLOBAL uchar* db, i64 dof, i64 rows, i64 cols, i64 batch)
{
    const i64 r = GID(0);
    if (r >= rows)
        return;
    GLOBAL const uchar* src = AT(uchar, sb, so);
    for (i64 z = GID(2); z < batch; z += GSIZE(2))
        for (i64 c = GID(1); c < cols; c += GSIZE(1))
            AT(real, db, dof)[(z * cols + c) * rows + r] = load_any(src, z * s_bs + r * s_rs + c * s_cs, s_real);
}

/* dst[o, i] = sum_r x[o, r, i]; outer rows past the grid are strided over (the gpu target caps grid y) */
KERNEL reduce_sum(GLOBAL uchar* xb, i64 xo, GLOBAL uchar* db, i64 dof, i64 outer, i64 r, i64 inner)
{
    GLOBAL const store_t* x = AT(store_t, xb, xo);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    const i64 i = GID(0);
    if (i >= inner)
        return;
    for (i64 o = GID(1); o < outer; o += GSIZE(1)) {
        real acc = (real)0;
        for (i64 j = 0; j < r; ++j)
            acc += LOAD(x, (o * r + j) * inner + i);
        STORE(dst, o * inner + i, acc);
    }
}

/* dst[0:nbytes] = src[0:nbytes] (non-overlapping) */
KERNEL copy_bytes(GLOBAL uchar* sb, i64 so, GLOBAL uchar* db, i64 dof, i64 nbytes)
{
    GLOBAL const uchar* src = AT(uchar, sb, so);
    GLOBAL uchar* dst = AT(uchar, db, dof);
    const i64 i = GID(0);
    if (i < nbytes)
        dst[i] = src[i];
}

/* dst[0:n] = value */
KERNEL fill(GLOBAL uchar* db, i64 dof, i64 n, real value)
{
    GLOBAL store_t* dst = AT(store_t, db, dof);
    const i64 i = GID(0);
    if (i < n)
        STORE(dst, i, value);
}

/* State-space family (ABI.md §4 and the version-2 fields of §8), in two shapes chosen by the program's target.
 * cpu: one work-item owns one row of the state (mamba2: M2_PB rows) and walks the sequence, so no
 * step needs a barrier; the state row stays in private memory in the compute type. Each step
 * updates the row in one loop (no loop-carried dependence: vectorizable) and reduces it in another
 * with SSM_ACC independent partial sums, so the sum is not one serial add chain.
 * gpu: a row's state spread across the lanes of a work-group (decode, short sequences), and the
 * chunked forms for long sequences (selective_scan_chunked, mamba2_chunk_*); see the gpu block.
 *
 * Rows, token indices and the version-2 switches: kernels/ssm_fields.cl, which precedes this text. */

/* The token-major tensors of selective_scan and mamba2, as their kernels find them in their arguments: x,
 * delta (mamba2: dt), the b and c rows ([tokens][G][N]), z and the output. */
typedef struct {
    GLOBAL const store_t* x;
    GLOBAL const store_t* delta;
    GLOBAL const store_t* bm;
    GLOBAL const store_t* cm;
    GLOBAL const store_t* z;
    GLOBAL store_t* dst;
} ssm_tensors;

INLINE_FN ssm_tensors ssm_tensors_of(GLOBAL uchar* xb, i64 xo, GLOBAL uchar* deb, i64 deo, GLOBAL uchar* bb, i64 bo,
                                     GLOBAL uchar* cb, i64 co, GLOBAL uchar* zb, i64 zo, GLOBAL uchar* db, i64 dof)
{
    ssm_tensors out;
    out.x = AT(store_t, xb, xo);
    out.delta = AT(store_t, deb, deo);
    out.bm = AT(store_t, bb, bo);
    out.cm = AT(store_t, cb, co);
    out.z = AT(store_t, zb, zo);
    out.dst = AT(store_t, db, dof);
    return out;
}

/* mamba2's saved forward (docs/abi.md 6a.1) past its states [R][K][HD][P][N]: y [R*S][HD][P], the outputs before
 * d and z; then the scores (mamba2_reserve_scores). */
INLINE_FN GLOBAL real* mamba2_saved_y(GLOBAL uchar* rsb, i64 rso, i64 R, i64 S, i64 HD, i64 P, i64 N, i64 RQ)
{
    return AT(real, rsb, rso) + R * ((S + RQ - 1) / RQ) * HD * P * N;
}

#ifdef RLX_TARGET_CPU /* cpu target (PoCL): the kernels up to the gpu block below */
#define SSM_ACC 8 /* the stores below sum exactly these 8 partial sums */

#define SS_W 16 /* the state_size of selective_scan's fixed-width path */
#define SS_TB 8 /* steps per block of that path */

/* A private state row h[N] into chunk k's entry of a saved forward. */
INLINE_FN void ssm_save_row(ssm_saved sv, i64 k, const real* h, i64 N)
{
    for (i64 n = 0; n < N; ++n)
        sv.at[k * sv.stride + n] = h[n];
}

/* Mamba-1, the steps of one channel from token tok0 on (SS_TB, or 1: called with either constant, so
 * that the guards fold away) for state_size SS_W: the state row lives in registers and each step is straight-line code over SS_W
 * contiguous values, so the (plain-arithmetic) exp, the update and the products vectorize across n;
 * y sums by a pairwise tree. The block's delta transforms, before its steps, and its output finishes
 * (d, silu(z)), after them, are straight-line code across the steps, so they vectorize across steps
 * too: taken one per step, a softplus or a silu sat on the step's serial path and cost as much as
 * the step. b and c rows are those of the channel's group. */
INLINE_FN void selective_scan_block16(int steps, real* h, const real* av, i64 tok0, i64 H, i64 G, i64 ch, i64 grp,
                                      real bias, real dv, ssm_tensors io)
{
    real xv[SS_TB], dl[SS_TB], y[SS_TB];
    PRAGMA_UNROLL
    for (int i = 0; i < SS_TB; ++i) {
        const i64 at = (tok0 + i) * H + ch;
        xv[i] = i < steps ? LOAD(io.x, at) : (real)0;
        dl[i] = ssm_delta(i < steps ? LOAD(io.delta, at) : (real)0, bias, (real)0, (real)0);
    }
    PRAGMA_UNROLL
    for (int i = 0; i < SS_TB; ++i) {
        y[i] = (real)0;
        if (i < steps) {
            GLOBAL const store_t* brow = io.bm + ((tok0 + i) * G + grp) * SS_W;
            GLOBAL const store_t* crow = io.cm + ((tok0 + i) * G + grp) * SS_W;
            const real dx = dl[i] * xv[i];
            real part[SS_W];
            PRAGMA_UNROLL
            for (int n = 0; n < SS_W; ++n) {
                h[n] = rlx_exp(dl[i] * av[n]) * h[n] + dx * LOAD(brow, n);
                part[n] = LOAD(crow, n) * h[n];
            }
            PRAGMA_UNROLL
            for (int w = SS_W / 2; w > 0; w /= 2)
                PRAGMA_UNROLL
                for (int n = 0; n < w; ++n)
                    part[n] += part[n + w];
            y[i] = part[0];
        }
    }
    real zv[SS_TB];
    PRAGMA_UNROLL
    for (int i = 0; i < SS_TB; ++i)
        zv[i] = i < steps ? ssm_z(io.z, (tok0 + i) * H + ch) : (real)0;
    PRAGMA_UNROLL
    for (int i = 0; i < SS_TB; ++i)
        if (i < steps)
            STORE(io.dst, (tok0 + i) * H + ch, ssm_finish(y[i], dv, xv[i], zv[i]));
}

/* The SS_W values h of selective_scan's fixed-width path into chunk k's entry of a saved forward, unrolled:
 * indexed in a loop, h would live in memory through the walk (1.25x its time on PoCL). */
INLINE_FN void selective_scan_save16(ssm_saved sv, i64 k, const real* h)
{
    PRAGMA_UNROLL
    for (int n = 0; n < SS_W; ++n)
        sv.at[k * sv.stride + n] = h[n];
}

/* Mamba-1, the walk of one channel over tokens [t0, t1) for state_size SS_W, in blocks of SS_TB steps and
 * the rest one step at a time: a block run with fewer steps still computed all SS_TB delta transforms and
 * finishes, which made a decode step (one token) cost 2.2x its one-step form on PoCL (B1 D1536: 200 vs 93 µs).
 * With SSM_RESERVE the state leaving each chunk of the saved forward is stored after the block ending it. */
INLINE_FN void selective_scan_w16(i64 t0, i64 t1, i64 H, i64 G, i64 ch, i64 grp, real bias, real dv,
                                  ssm_tensors io, GLOBAL const param_t* a, GLOBAL state_t* st, ssm_saved sv)
{
    real h[SS_W], av[SS_W];
    PRAGMA_UNROLL
    for (int n = 0; n < SS_W; ++n) {
        h[n] = SSM_CARRY ? SLOAD(st, n) : (real)0;
        av[n] = PLOAD(a, n);
    }
    i64 tok = t0;
    for (; tok + SS_TB <= t1; tok += SS_TB) {
        selective_scan_block16(SS_TB, h, av, tok, H, G, ch, grp, bias, dv, io);
        if (SSM_RESERVE && ssm_saved_ends(sv, tok + SS_TB - 1, t0, t1)) /* sv.every: a multiple of SS_TB */
            selective_scan_save16(sv, (tok + SS_TB - 1 - t0) / sv.every, h);
    }
    for (; tok < t1; ++tok)
        selective_scan_block16(1, h, av, tok, H, G, ch, grp, bias, dv, io);
    if (SSM_RESERVE && t1 > t0)
        selective_scan_save16(sv, (t1 - 1 - t0) / sv.every, h);
    if (SSM_CARRY)
        PRAGMA_UNROLL
        for (int n = 0; n < SS_W; ++n)
            SSTORE(st, n, h[n]);
}

/* Mamba-1, one channel's state row in a decode step: updated where it lies in a loop over n (h = exp(d*a)*h +
 * d*x*b, contiguous: vectorized along n), then y = sum_n c*h in a second loop with two partial sums (even and
 * odd n); returns y. */
INLINE_FN real selective_scan_token_row(i64 N, real d, real xv, GLOBAL const param_t* a, GLOBAL state_t* st,
                                        GLOBAL const store_t* brow, GLOBAL const store_t* crow)
{
    const real dx = d * xv;
    real h[STATE_MAX];
    for (i64 n = 0; n < N; ++n) {
        h[n] = rlx_exp(d * PLOAD(a, n)) * (SSM_CARRY ? SLOAD(st, n) : (real)0) + dx * LOAD(brow, n);
        if (SSM_CARRY)
            SSTORE(st, n, h[n]);
    }
    real y0 = (real)0, y1 = (real)0;
    i64 n = 0;
    for (; n + 2 <= N; n += 2) {
        y0 += h[n] * LOAD(crow, n);
        y1 += h[n + 1] * LOAD(crow, n + 1);
    }
    if (n < N)
        y0 += h[n] * LOAD(crow, n);
    return y0 + y1;
}

/* Mamba-1, one channel's state row in a decode step for state_size SS_W: the loop over n < SS_W/2 takes n and
 * n + SS_W/2 together and is left to the compiler's loop vectorizer, which runs its SS_W/2 iterations as one
 * (two vectors of 8, the exps inlined); unrolled by hand the same text went to the SLP vectorizer, which split
 * it into scalar and vector pieces with a shuffle between each (PoCL 3.1: 2.5x the time). c is loaded before
 * the state is stored (a store between the loads kept the stores scalar: b, c and the state may alias), and y
 * sums its SS_W/2 pairs by a tree; returns y. */
INLINE_FN real selective_scan_token_w16(real d, real xv, GLOBAL const param_t* a, GLOBAL state_t* st,
                                        GLOBAL const store_t* brow, GLOBAL const store_t* crow)
{
    const real dx = d * xv;
    real y[SS_W / 2];
    for (int n = 0; n < SS_W / 2; ++n) {
        const int m = n + SS_W / 2;
        const real c0 = LOAD(crow, n), c1 = LOAD(crow, m);
        const real h0 = rlx_exp(d * PLOAD(a, n)) * (SSM_CARRY ? SLOAD(st, n) : (real)0) + dx * LOAD(brow, n);
        const real h1 = rlx_exp(d * PLOAD(a, m)) * (SSM_CARRY ? SLOAD(st, m) : (real)0) + dx * LOAD(brow, m);
        if (SSM_CARRY) {
            SSTORE(st, n, h0);
            SSTORE(st, m, h1);
        }
        y[n] = h0 * c0 + h1 * c1;
    }
    PRAGMA_UNROLL
    for (int w = SS_W / 4; w > 0; w /= 2)
        PRAGMA_UNROLL
        for (int n = 0; n < w; ++n)
            y[n] += y[n + w];
    return y[0];
}

/* Mamba-1, the decode step of the `nc` consecutive channels from ch0 of row r (called with the constant SS_TC
 * for a whole item, so that its guards fold away, and with the rest of H for the last item): the delta transforms
 * before the rows and the finishes after them are loops across the channels, contiguous loads that PoCL's loop
 * vectorizer takes 8 lanes wide; the rows lie one after another (a and the state: SS_TC * N contiguous values).
 * A channel past nc reads channel ch0 (in range: no select of a guard in the loads) and only the stores are
 * guarded. With one group a row's b and c take no 64-bit division per channel. */
INLINE_FN void selective_scan_token_block(int nc, i64 ch0, i64 r, i64 H, i64 N, i64 G, ssm_tensors io,
                                          GLOBAL const param_t* a, GLOBAL const param_t* bias,
                                          GLOBAL const param_t* skip, GLOBAL state_t* st)
{
    real xv[SS_TC], dl[SS_TC], y[SS_TC], out[SS_TC];
    const i64 per = H / G;
    for (int c = 0; c < SS_TC; ++c) {
        const i64 ch = ch0 + (c < nc ? c : 0);
        xv[c] = LOAD(io.x, r * H + ch);
        dl[c] = ssm_delta(LOAD(io.delta, r * H + ch), ssm_param(bias, ch, SSM_BIAS), (real)0, (real)0);
        y[c] = (real)0;
    }
    for (int c = 0; c < SS_TC; ++c)
        if (c < nc) {
            const i64 ch = ch0 + c, row = r * G + (G == 1 ? 0 : ch / per);
            y[c] = N == SS_W ? selective_scan_token_w16(dl[c], xv[c], a + ch * N, st + ch * N, io.bm + row * N,
                                                        io.cm + row * N)
                             : selective_scan_token_row(N, dl[c], xv[c], a + ch * N, st + ch * N, io.bm + row * N,
                                                        io.cm + row * N);
        }
    for (int c = 0; c < SS_TC; ++c) {
        const i64 ch = ch0 + (c < nc ? c : 0);
        out[c] = ssm_finish(y[c], ssm_param(skip, ch, SSM_D), xv[c], ssm_z(io.z, r * H + ch));
    }
    for (int c = 0; c < SS_TC; ++c)
        if (c < nc)
            STORE(io.dst, r * H + ch0 + c, out[c]);
}

/* Mamba-1, a decode step (seq 1, no cu_seqlens: row r's one token is token r) at the cpu target: item i holds
 * the SS_TC consecutive channels from i * SS_TC (the last item those left of H), so that its loads of x, delta
 * and its outputs are contiguous and its state rows one block. B1 D1536 N16 at PoCL 3.1's cpu target, one
 * work-group, µs of kernel time: 23-26 against 36-40 for the item's channels strided by the items of a row
 * (46-48 for the rows as a loop over N and the channel loops unrolled; one channel per item, N unrolled: 95);
 * Intel's runtime, which vectorizes across items (now 8 channels apart), 28-29 against 25-27. */
INLINE_FN void selective_scan_token(i64 i, i64 r, i64 H, i64 N, i64 G, ssm_tensors io, GLOBAL const param_t* a,
                                    GLOBAL const param_t* bias, GLOBAL const param_t* skip, GLOBAL state_t* st)
{
    const i64 ch0 = i * SS_TC;
    if (ch0 + SS_TC <= H)
        selective_scan_token_block(SS_TC, ch0, r, H, N, G, io, a, bias, skip, st);
    else if (ch0 < H)
        selective_scan_token_block((int)(H - ch0), ch0, r, H, N, G, io, a, bias, skip, st);
}

/* Mamba-1: per (channel ch, row r), h[n] = exp(delta*a[ch,n])*h[n] + delta*b[g,n]*x; y = sum_n c[g,n]*h[n],
 * g = ch's group. */
KERNEL selective_scan(i64 R, i64 S, i64 H, i64 N, i64 G,
                      GLOBAL uchar* xb, i64 xo, GLOBAL uchar* deb, i64 deo, GLOBAL uchar* ab, i64 ao,
                      GLOBAL uchar* bb, i64 bo, GLOBAL uchar* cb, i64 co, GLOBAL uchar* db, i64 dof,
                      GLOBAL uchar* biasb, i64 biaso, GLOBAL uchar* skb, i64 sko, GLOBAL uchar* zb, i64 zo,
                      GLOBAL uchar* stb, i64 sto, GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo,
                      GLOBAL uchar* rsb, i64 rso, i64 RQ)
{
    const i64 ch = GID(0), r = GID(1);
    if (ch >= H || r >= R)
        return;
    const ssm_tensors io = ssm_tensors_of(xb, xo, deb, deo, bb, bo, cb, co, zb, zo, db, dof);
    const ssm_saved sv = ssm_saved_of(rsb, rso, r, S, RQ, H, ch, N); /* read only with SSM_RESERVE */
    if (SSM_VARLEN || SSM_RESERVE ? 0 : S == 1) { /* a decode step: launches/ssm.py gives each item SS_TC channels */
        selective_scan_token(ch, r, H, N, G, io, AT(param_t, ab, ao), AT(param_t, biasb, biaso),
                             AT(param_t, skb, sko), AT(state_t, stb, sto) + ssm_slot(r, AT(int, slb, slo)) * H * N);
        return;
    }
    GLOBAL const param_t* a = AT(param_t, ab, ao) + ch * N;
    GLOBAL const int* cu = AT(int, cub, cuo);
    GLOBAL state_t* st = AT(state_t, stb, sto) + (ssm_slot(r, AT(int, slb, slo)) * H + ch) * N;
    const i64 grp = ch / (H / G), t0 = ssm_first(r, S, cu), t1 = ssm_end(r, S, cu);
    const real bias = ssm_param(AT(param_t, biasb, biaso), ch, SSM_BIAS), dv = ssm_param(AT(param_t, skb, sko), ch, SSM_D);
    if (N == SS_W) {
        selective_scan_w16(t0, t1, H, G, ch, grp, bias, dv, io, a, st, sv);
        return;
    }
    real h[STATE_MAX], av[STATE_MAX];
    for (i64 n = 0; n < N; ++n) {
        h[n] = SSM_CARRY ? SLOAD(st, n) : (real)0;
        av[n] = PLOAD(a, n);
    }
    for (i64 tok = t0; tok < t1; ++tok) {
        GLOBAL const store_t* brow = io.bm + (tok * G + grp) * N;
        GLOBAL const store_t* crow = io.cm + (tok * G + grp) * N;
        const real xv = LOAD(io.x, tok * H + ch);
        const real dl = ssm_delta(LOAD(io.delta, tok * H + ch), bias, (real)0, (real)0), dx = dl * xv;
        for (i64 n = 0; n < N; ++n)
            h[n] = exp(dl * av[n]) * h[n] + dx * LOAD(brow, n);
        real y[SSM_ACC];
        for (int k = 0; k < SSM_ACC; ++k)
            y[k] = (real)0;
        i64 n = 0;
        for (; n + SSM_ACC <= N; n += SSM_ACC)
            for (int k = 0; k < SSM_ACC; ++k)
                y[k] += LOAD(crow, n + k) * h[n + k];
        for (; n < N; ++n)
            y[0] += LOAD(crow, n) * h[n];
        const real sum = ((y[0] + y[1]) + (y[2] + y[3])) + ((y[4] + y[5]) + (y[6] + y[7]));
        STORE(io.dst, tok * H + ch, ssm_finish(sum, dv, xv, ssm_z(io.z, tok * H + ch)));
        if (SSM_RESERVE && ssm_saved_ends(sv, tok, t0, t1))
            ssm_save_row(sv, (tok - t0) / RQ, h, N);
    }
    if (SSM_CARRY)
        for (i64 n = 0; n < N; ++n)
            SSTORE(st, n, h[n]);
}

/* Stores the outputs of an item's first `np` rows (y0 + y1, finished) at dst[at ..]; called with the
 * constant M2_PB for a whole block, so that its guards fold away. */
INLINE_FN void m2_finish_rows(int np, GLOBAL store_t* dst, GLOBAL const store_t* z, i64 at, const real* y0,
                              const real* y1, real dv, const real* xv)
{
    real zv[M2_PB];
    PRAGMA_UNROLL
    for (int c = 0; c < M2_PB; ++c)
        zv[c] = c < np ? ssm_z(z, at + c) : (real)0;
    PRAGMA_UNROLL
    for (int c = 0; c < M2_PB; ++c)
        if (c < np)
            STORE(dst, at + c, ssm_finish(y0[c] + y1[c], dv, xv[c], zv[c]));
}

/* An item's np state rows s[n * M2_PB + c] (mamba2's walk below) into chunk k's entries of a saved forward. */
INLINE_FN void m2_save_rows(ssm_saved sv, i64 k, const real* s, int np, i64 N)
{
    for (int c = 0; c < np; ++c)
        for (i64 n = 0; n < N; ++n)
            sv.at[k * sv.stride + c * N + n] = s[n * M2_PB + c];
}

/* Mamba-2, the one token of a row (a decode step) at the cpu target: each of the item's np rows of the
 * state updated where it lies (contiguous in n), with the sums of mamba2's walk below (even and odd n
 * apart), but no private copy of the state, whose transposed load and store cost more than the step. */
INLINE_FN void mamba2_one_token(int np, i64 N, GLOBAL state_t* st, GLOBAL const store_t* x, GLOBAL const store_t* brow,
                                GLOBAL const store_t* crow, GLOBAL const store_t* z, GLOBAL store_t* dst, i64 at,
                                real d, real decay, real dv)
{
    for (int c = 0; c < np; ++c) {
        GLOBAL state_t* row = st + c * N;
        const real xv = LOAD(x, at + c), dx = d * xv;
        real y0 = (real)0, y1 = (real)0;
        i64 n = 0;
        for (; n + 2 <= N; n += 2) {
            const real s0 = decay * (SSM_CARRY ? SLOAD(row, n) : (real)0) + dx * LOAD(brow, n);
            const real s1 = decay * (SSM_CARRY ? SLOAD(row, n + 1) : (real)0) + dx * LOAD(brow, n + 1);
            y0 += s0 * LOAD(crow, n);
            y1 += s1 * LOAD(crow, n + 1);
            if (SSM_CARRY) {
                SSTORE(row, n, s0);
                SSTORE(row, n + 1, s1);
            }
        }
        if (n < N) {
            const real s0 = decay * (SSM_CARRY ? SLOAD(row, n) : (real)0) + dx * LOAD(brow, n);
            y0 += s0 * LOAD(crow, n);
            if (SSM_CARRY)
                SSTORE(row, n, s0);
        }
        STORE(dst, at + c, ssm_finish(y0 + y1, dv, xv, ssm_z(z, at + c)));
    }
}

/* Mamba-2 (SSD): per (p, head hh, row r), S[p,n] = exp(dt*a[hh])*S[p,n] + dt*x[p]*b[g,n]; y[p] = sum_n S[p,n]*c[g,n],
 * g = hh's group. One work-item owns M2_PB adjacent p (rows of the state) of one (head, row) and walks
 * the sequence. The item's rows are the innermost, contiguous index of its private state s[n*M2_PB + c],
 * so each b[n] / c[n] load serves M2_PB rows and the row loop (fully unrolled) vectorizes; the decay
 * is one scalar per (step, head). A step is two passes over the state: the update, then the output
 * sum with two independent partial sums per row (even and odd n), so the sum over n is not one
 * serial FMA chain. Fused into one pass, PoCL's vectorizer split and spilled the accumulators (f32
 * B=2 S=1024 H=8 P=64 N=64: 7.8 ms fused vs 4.3 ms in two passes; 16 rows per item vs 8: 4.3 vs 14;
 * four partial sums instead of two: 5.0). With SSM_RESERVE (no decode step then) the item also stores its
 * rows' states leaving each chunk of RQ tokens and their outputs before d and z (mamba2_saved_y). */
KERNEL mamba2(i64 R, i64 S, i64 HD, i64 P, i64 N, i64 G,
              GLOBAL uchar* xb, i64 xo, GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* ab, i64 ao,
              GLOBAL uchar* bb, i64 bo, GLOBAL uchar* cb, i64 co, GLOBAL uchar* db, i64 dof,
              GLOBAL uchar* biasb, i64 biaso, GLOBAL uchar* skb, i64 sko, GLOBAL uchar* zb, i64 zo,
              GLOBAL uchar* stb, i64 sto, GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo, real lo, real hi,
              GLOBAL uchar* rsb, i64 rso, i64 RQ)
{
    const i64 p0 = GID(0) * M2_PB, hh = GID(1), r = GID(2);
    if (p0 >= P || hh >= HD || r >= R)
        return;
    const int np = P - p0 < M2_PB ? (int)(P - p0) : M2_PB; /* rows of this item inside the head */
    const ssm_tensors io = ssm_tensors_of(xb, xo, dtb, dto, bb, bo, cb, co, zb, zo, db, dof);
    GLOBAL const int* cu = AT(int, cub, cuo);
    GLOBAL state_t* st = AT(state_t, stb, sto) + ((ssm_slot(r, AT(int, slb, slo)) * HD + hh) * P + p0) * N;
    const i64 grp = hh / (HD / G), t0 = ssm_first(r, S, cu), t1 = ssm_end(r, S, cu);
    const real a = PLOAD(AT(param_t, ab, ao), hh), bias = ssm_param(AT(param_t, biasb, biaso), hh, SSM_BIAS);
    const real dv = ssm_param(AT(param_t, skb, sko), hh, SSM_D);
    const ssm_saved sv = ssm_saved_of(rsb, rso, r, S, RQ, HD * P, hh * P + p0, N); /* read only with SSM_RESERVE */
    GLOBAL real* ys = mamba2_saved_y(rsb, rso, R, S, HD, P, N, RQ);
    if (!SSM_RESERVE && t1 - t0 == 1) {
        const i64 head = t0 * HD + hh;
        const real d = ssm_delta(LOAD(io.delta, head), bias, lo, hi);
        mamba2_one_token(np, N, st, io.x, io.bm + (t0 * G + grp) * N, io.cm + (t0 * G + grp) * N, io.z, io.dst,
                         head * P + p0, d, exp(d * a), dv);
        return;
    }
    real s[STATE_MAX * M2_PB];
    for (i64 n = 0; n < N; ++n)
        PRAGMA_UNROLL
        for (int c = 0; c < M2_PB; ++c)
            s[n * M2_PB + c] = SSM_CARRY && c < np ? SLOAD(st, c * N + n) : (real)0;
    for (i64 tok = t0; tok < t1; ++tok) {
        const i64 head = tok * HD + hh;
        GLOBAL const store_t* brow = io.bm + (tok * G + grp) * N;
        GLOBAL const store_t* crow = io.cm + (tok * G + grp) * N;
        const real d = ssm_delta(LOAD(io.delta, head), bias, lo, hi), decay = exp(d * a);
        real xv[M2_PB], dx[M2_PB], y0[M2_PB], y1[M2_PB];
        PRAGMA_UNROLL
        for (int c = 0; c < M2_PB; ++c) {
            xv[c] = c < np ? LOAD(io.x, head * P + p0 + c) : (real)0;
            dx[c] = d * xv[c];
            y0[c] = y1[c] = (real)0;
        }
        for (i64 n = 0; n < N; ++n) {
            const real b0 = LOAD(brow, n);
            PRAGMA_UNROLL
            for (int c = 0; c < M2_PB; ++c)
                s[n * M2_PB + c] = decay * s[n * M2_PB + c] + dx[c] * b0;
        }
        i64 n = 0;
        for (; n + 2 <= N; n += 2) {
            const real c0 = LOAD(crow, n), c1 = LOAD(crow, n + 1);
            PRAGMA_UNROLL
            for (int c = 0; c < M2_PB; ++c) {
                y0[c] += s[n * M2_PB + c] * c0;
                y1[c] += s[(n + 1) * M2_PB + c] * c1;
            }
        }
        if (n < N) {
            const real c0 = LOAD(crow, n);
            PRAGMA_UNROLL
            for (int c = 0; c < M2_PB; ++c)
                y0[c] += s[n * M2_PB + c] * c0;
        }
        if (SSM_RESERVE) {
            for (int c = 0; c < np; ++c)
                ys[head * P + p0 + c] = y0[c] + y1[c];
            if (ssm_saved_ends(sv, tok, t0, t1))
                m2_save_rows(sv, (tok - t0) / RQ, s, np, N);
        }
        if (np == M2_PB) /* a whole block of rows, unguarded: the finish vectorizes across them */
            m2_finish_rows(M2_PB, io.dst, io.z, head * P + p0, y0, y1, dv, xv);
        else
            m2_finish_rows(np, io.dst, io.z, head * P + p0, y0, y1, dv, xv);
    }
    if (SSM_CARRY)
        for (i64 n = 0; n < N; ++n)
            PRAGMA_UNROLL
            for (int c = 0; c < M2_PB; ++c)
                if (c < np)
                    SSTORE(st, c * N + n, s[n * M2_PB + c]);
}
#endif

#if defined(RLX_TARGET_GPU) && defined(SSM_N) /* a gpu program variant: SSM_N, SSM_L from its launch */
/* GPU shapes (target gpu): the state of one row (selective_scan: one channel of one row; mamba2:
 * one head_dim position p of one (row, head)) is spread across SSM_L lanes of a work-group, each
 * lane holding SSM_W = SSM_N / SSM_L values in registers (a fixed-size private array, fully
 * unrolled: no stack). Lane nl holds n = w*SSM_L + nl, so the lanes of a row read b and c
 * contiguously. SSM_N (the state-size variant, >= state_size) and SSM_L come from the launch's
 * defines, SSM_WG (the largest work-group) from the gpu tuning table. Each step the lanes' partial
 * sums of y meet in LOCAL memory, double-buffered so that one barrier per step suffices: the buffer
 * written at step t is rewritten only at step t+2, after every reader of step t has passed the
 * barrier of step t+1. A work-group's rows all belong to one row of the batch (or one sequence), so
 * its lanes walk the same tokens and meet the same barriers. The grid is 1-D (groups of rows folded
 * into x), so no extent reaches CUDA's 65,535 cap on y/z. */
#define SSM_W (SSM_N / SSM_L)


/* The final state of a row: this lane's values (n = w*SSM_L + nl) into the row's entry of `state`. */
INLINE_FN void ssm_lanes_write_state(GLOBAL state_t* st, const real* h, int nl, i64 N)
{
    PRAGMA_UNROLL
    for (int w = 0; w < SSM_W; ++w)
        if (w * SSM_L + nl < N)
            SSTORE(st, w * SSM_L + nl, h[w]);
}

/* A lane's values of a state row (n = w*SSM_L + nl) into chunk k's entry of a saved forward. */
INLINE_FN void ssm_lanes_save(ssm_saved sv, i64 k, const real* h, int nl, i64 N)
{
    PRAGMA_UNROLL
    for (int w = 0; w < SSM_W; ++w)
        if (w * SSM_L + nl < N)
            sv.at[k * sv.stride + w * SSM_L + nl] = h[w];
}

/* The end of step `step` of a row (every lane of the group calls it: it meets the step's barrier): this
 * lane's partial sum y into the step's buffer of `part`, then the lane that stores (`store`: the row's
 * first lane, when the row is live) finishes the output at `at` from the row's sum and stores it. Returns
 * that sum (0 to the other lanes). */
INLINE_FN real ssm_lanes_finish_barrier(LOCAL_PTR real* part, real y, i64 step, int lane, int first, int store,
                                        ssm_tensors io, i64 at, real dv, real xv)
{
    const int buf = (int)(step & 1) * SSM_WG;
    part[buf + lane] = y;
    BARRIER();
    const real sum = store ? ssm_row_sum(part, buf + first) : (real)0;
    if (store)
        STORE(io.dst, at, ssm_finish(sum, dv, xv, ssm_z(io.z, at)));
    return sum;
}

/* Mamba-1, state rows = (row, channel): h[n] = exp(delta*a[ch,n])*h[n] + delta*x*b[g,n]; y = sum_n c[g,n]*h[n]. */
KERNEL selective_scan_lanes(i64 R, i64 S, i64 H, i64 N, i64 G,
                            GLOBAL uchar* xb, i64 xo, GLOBAL uchar* deb, i64 deo, GLOBAL uchar* ab, i64 ao,
                            GLOBAL uchar* bb, i64 bo, GLOBAL uchar* cb, i64 co, GLOBAL uchar* db, i64 dof,
                            GLOBAL uchar* biasb, i64 biaso, GLOBAL uchar* skb, i64 sko, GLOBAL uchar* zb, i64 zo,
                            GLOBAL uchar* stb, i64 sto, GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo,
                            GLOBAL uchar* rsb, i64 rso, i64 RQ)
{
    LOCAL real part[2 * SSM_WG];
    /* remainders as x - q*d, not %: LLVM turns a div/rem pair into a `freeze`, which Oclgrind rejects */
    const int lane = (int)LID(0), k = lane / SSM_L, nl = lane - k * SSM_L, first = k * SSM_L;
    const i64 rows = LSIZE(0) / SSM_L, blocks = (H + rows - 1) / rows;
    const i64 r = GROUP(0) / blocks, ch = (GROUP(0) - r * blocks) * rows + k;
    const int live = ch < H; /* a lane past the last channel still meets every barrier */
    const i64 cl = live ? ch : 0;
    const ssm_tensors io = ssm_tensors_of(xb, xo, deb, deo, bb, bo, cb, co, zb, zo, db, dof);
    GLOBAL const param_t* a = AT(param_t, ab, ao) + cl * N;
    GLOBAL const int* cu = AT(int, cub, cuo);
    GLOBAL state_t* st = AT(state_t, stb, sto) + (ssm_slot(r, AT(int, slb, slo)) * H + cl) * N;
    const i64 grp = cl / (H / G), t0 = ssm_first(r, S, cu), t1 = ssm_end(r, S, cu);
    const real bias = ssm_param(AT(param_t, biasb, biaso), cl, SSM_BIAS), dv = ssm_param(AT(param_t, skb, sko), cl, SSM_D);
    const ssm_saved sv = ssm_saved_of(rsb, rso, r, S, RQ, H, cl, N); /* read only with SSM_RESERVE */
    real h[SSM_W], av[SSM_W];
    PRAGMA_UNROLL
    for (int w = 0; w < SSM_W; ++w) {
        const int n = w * SSM_L + nl, in = live && n < N;
        h[w] = SSM_CARRY && in ? SLOAD(st, n) : (real)0;
        av[w] = in ? PLOAD(a, n) : (real)0;
    }
    for (i64 tok = t0; tok < t1; ++tok) {
        GLOBAL const store_t* brow = io.bm + (tok * G + grp) * N;
        GLOBAL const store_t* crow = io.cm + (tok * G + grp) * N;
        const real xv = live ? LOAD(io.x, tok * H + ch) : (real)0;
        const real dl = live ? ssm_delta(LOAD(io.delta, tok * H + ch), bias, (real)0, (real)0) : (real)0;
        const real dx = dl * xv;
        real y = (real)0;
        PRAGMA_UNROLL
        for (int w = 0; w < SSM_W; ++w) {
            const int n = w * SSM_L + nl;
            if (n < N) {
                h[w] = rlx_exp(dl * av[w]) * h[w] + dx * LOAD(brow, n);
                y += LOAD(crow, n) * h[w];
            }
        }
        ssm_lanes_finish_barrier(part, y, tok - t0, lane, first, live && nl == 0, io, tok * H + ch, dv, xv);
        if (SSM_RESERVE && live && ssm_saved_ends(sv, tok, t0, t1))
            ssm_lanes_save(sv, (tok - t0) / RQ, h, nl, N);
    }
    if (SSM_CARRY && live)
        ssm_lanes_write_state(st, h, nl, N);
}

/* Mamba-2, state rows = (row, head, p): S[p,n] = exp(dt*a[hh])*S[p,n] + dt*x[p]*b[g,n]; y[p] = sum_n S[p,n]*c[g,n]. */
KERNEL mamba2_lanes(i64 R, i64 S, i64 HD, i64 P, i64 N, i64 G,
                    GLOBAL uchar* xb, i64 xo, GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* ab, i64 ao,
                    GLOBAL uchar* bb, i64 bo, GLOBAL uchar* cb, i64 co, GLOBAL uchar* db, i64 dof,
                    GLOBAL uchar* biasb, i64 biaso, GLOBAL uchar* skb, i64 sko, GLOBAL uchar* zb, i64 zo,
                    GLOBAL uchar* stb, i64 sto, GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo, real lo,
                    real hi, GLOBAL uchar* rsb, i64 rso, i64 RQ)
{
    LOCAL real part[2 * SSM_WG];
    /* remainders as x - q*d, not %: LLVM turns a div/rem pair into a `freeze`, which Oclgrind rejects */
    const int lane = (int)LID(0), k = lane / SSM_L, nl = lane - k * SSM_L, first = k * SSM_L;
    const i64 rows = LSIZE(0) / SSM_L, blocks = (P + rows - 1) / rows;
    const i64 rh = GROUP(0) / blocks, r = rh / HD, hh = rh - r * HD, p = (GROUP(0) - rh * blocks) * rows + k;
    const int live = p < P;
    const ssm_tensors io = ssm_tensors_of(xb, xo, dtb, dto, bb, bo, cb, co, zb, zo, db, dof);
    GLOBAL const int* cu = AT(int, cub, cuo);
    GLOBAL state_t* st = AT(state_t, stb, sto) + ((ssm_slot(r, AT(int, slb, slo)) * HD + hh) * P + (live ? p : 0)) * N;
    const i64 grp = hh / (HD / G), t0 = ssm_first(r, S, cu), t1 = ssm_end(r, S, cu);
    const real a = PLOAD(AT(param_t, ab, ao), hh), bias = ssm_param(AT(param_t, biasb, biaso), hh, SSM_BIAS);
    const real dv = ssm_param(AT(param_t, skb, sko), hh, SSM_D);
    const ssm_saved sv = ssm_saved_of(rsb, rso, r, S, RQ, HD * P, hh * P + (live ? p : 0), N); /* with SSM_RESERVE */
    GLOBAL real* ys = mamba2_saved_y(rsb, rso, R, S, HD, P, N, RQ);
    real s[SSM_W];
    PRAGMA_UNROLL
    for (int w = 0; w < SSM_W; ++w)
        s[w] = SSM_CARRY && live && w * SSM_L + nl < N ? SLOAD(st, w * SSM_L + nl) : (real)0;
    for (i64 tok = t0; tok < t1; ++tok) {
        const i64 head = tok * HD + hh;
        GLOBAL const store_t* brow = io.bm + (tok * G + grp) * N;
        GLOBAL const store_t* crow = io.cm + (tok * G + grp) * N;
        const real d = ssm_delta(LOAD(io.delta, head), bias, lo, hi), decay = rlx_exp(d * a);
        const real xv = live ? LOAD(io.x, head * P + p) : (real)0;
        const real dx = d * xv;
        real y = (real)0;
        PRAGMA_UNROLL
        for (int w = 0; w < SSM_W; ++w) {
            const int n = w * SSM_L + nl;
            if (n < N) {
                s[w] = decay * s[w] + dx * LOAD(brow, n);
                y += s[w] * LOAD(crow, n);
            }
        }
        const real sum = ssm_lanes_finish_barrier(part, y, tok - t0, lane, first, live && nl == 0, io, head * P + p, dv,
                                                  xv);
        if (SSM_RESERVE && live && nl == 0)
            ys[head * P + p] = sum;
        if (SSM_RESERVE && live && ssm_saved_ends(sv, tok, t0, t1))
            ssm_lanes_save(sv, (tok - t0) / RQ, s, nl, N);
    }
    if (SSM_CARRY && live)
        ssm_lanes_write_state(st, s, nl, N);
}
#endif

#if defined(RLX_TARGET_GPU) && !defined(SSM_N) /* the gpu program without a state-size variant: the chunked forms */
/* Mamba-1 chunked over the sequence (target gpu, long sequences): one work-group per (row, block of
 * SSC_CB channels). The group walks its row's tokens in chunks of SSC_SL*SSC_T steps; the SSC_SL
 * lanes of a channel each own SSC_T consecutive steps of the chunk (lanes of adjacent channels are
 * adjacent, so the x/delta/y accesses of one step are contiguous). The state index n is a loop, so
 * no register array depends on state_size. Per n:
 *   1. each lane composes its own steps into (A, B): h_out = A*h_in + B, with the per-step decay
 *      exp(delta*a[n]) and input delta*x*b[n] kept in registers, and publishes (A, B) in LOCAL;
 *   2. after a barrier each lane forms its entering state from the channel's state at the chunk
 *      start (LOCAL `carry`) composed with the (A, B) of the channel's earlier lanes, in order, and
 *      reruns its steps, adding c[n]*h to its outputs;
 *   3. after a second barrier the channel's last lane stores its final h as the next chunk's start.
 * Steps past the row's end compose as the identity (A=1, B=0): masked, never multiplied by
 * zero, so a NaN or Inf reaches only later steps. `carry` of n is rewritten only after the barrier
 * that follows every read of it; (A, B) of n+1 only after the barrier that follows every read of n's.
 * A varlen row is one sequence, so a chunk never holds a sequence start: every sequence restarts at
 * its first chunk, whatever its length. Bounded to 4 groups per SM (128 registers): left free, ptxas
 * spends more on scheduling than the budget of tests/devices/test_ptxas.py. With SSM_RESERVE a lane whose
 * steps end a chunk of the saved forward (RQ, a multiple of SSC_T: launches/ssm.py) stores its final h of
 * each n there. */
KERNEL_BOUNDED(SSC_CB * SSC_SL, 4) selective_scan_chunked(i64 R, i64 S, i64 H, i64 N, i64 G,
                              GLOBAL uchar* xb, i64 xo, GLOBAL uchar* deb, i64 deo, GLOBAL uchar* ab, i64 ao,
                              GLOBAL uchar* bb, i64 bo, GLOBAL uchar* cb, i64 co, GLOBAL uchar* db, i64 dof,
                              GLOBAL uchar* biasb, i64 biaso, GLOBAL uchar* skb, i64 sko, GLOBAL uchar* zb, i64 zo,
                              GLOBAL uchar* stb, i64 sto, GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo,
                              GLOBAL uchar* rsb, i64 rso, i64 RQ)
{
    LOCAL real pa[SSC_CB * SSC_SL], pb[SSC_CB * SSC_SL], carry[SSC_CB * STATE_MAX];
    const int lane = (int)LID(0), sl = lane / SSC_CB, k = lane - sl * SSC_CB;
    const i64 blocks = (H + SSC_CB - 1) / SSC_CB, r = GROUP(0) / blocks, ch = (GROUP(0) - r * blocks) * SSC_CB + k;
    const int live = ch < H; /* a lane past the last channel still meets every barrier */
    const i64 cl = live ? ch : 0;
    const ssm_tensors io = ssm_tensors_of(xb, xo, deb, deo, bb, bo, cb, co, zb, zo, db, dof);
    GLOBAL const param_t* a = AT(param_t, ab, ao) + cl * N;
    GLOBAL const int* cu = AT(int, cub, cuo);
    const i64 grp = cl / (H / G), first = ssm_first(r, S, cu), end = ssm_end(r, S, cu);
    const int gn = (int)(G * N); /* b, c elements from one step to the next */
    const real bias = ssm_param(AT(param_t, biasb, biaso), cl, SSM_BIAS), dv = ssm_param(AT(param_t, skb, sko), cl, SSM_D);
    /* the channel's entry of `state`, found where it is read and again where it is written, so that
     * no register holds it through the walk */
    GLOBAL state_t* st = AT(state_t, stb, sto) + (ssm_slot(r, AT(int, slb, slo)) * H + cl) * N;
    for (i64 n = sl; n < N; n += SSC_SL)
        carry[k * STATE_MAX + n] = SSM_CARRY && live ? SLOAD(st, n) : (real)0;
    BARRIER();
    for (i64 c0 = first; c0 < end; c0 += SSC_SL * SSC_T) {
        const i64 t0 = c0 + sl * SSC_T; /* this lane's first token */
        const i64 last = (t0 + SSC_T < end ? t0 + SSC_T : end) - 1; /* and its last */
        const ssm_saved sv = ssm_saved_of(rsb, rso, r, S, RQ, H, cl, N); /* with SSM_RESERVE */
        const int saves = SSM_RESERVE && live && last >= t0 && ssm_saved_ends(sv, last, first, end);
        GLOBAL const store_t* brow = io.bm + (t0 * G + grp) * N; /* its first step's b and c rows */
        GLOBAL const store_t* crow = io.cm + (t0 * G + grp) * N;
        real dl[SSC_T], dx[SSC_T], y[SSC_T];
        PRAGMA_UNROLL
        for (int i = 0; i < SSC_T; ++i) {
            const i64 at = (t0 + i) * H + ch;
            const int in = live && t0 + i < end;
            dl[i] = in ? ssm_delta(LOAD(io.delta, at), bias, (real)0, (real)0) : (real)0;
            dx[i] = in ? dl[i] * LOAD(io.x, at) : (real)0;
            y[i] = (real)0;
        }
        for (i64 n = 0; n < N; ++n) {
            const real an = live ? PLOAD(a, n) : (real)0;
            real da[SSC_T], db_[SSC_T], A = (real)1, Bv = (real)0;
            PRAGMA_UNROLL
            for (int i = 0; i < SSC_T; ++i) {
                const int in = t0 + i < end;
                da[i] = in ? rlx_exp(dl[i] * an) : (real)1;
                db_[i] = in ? dx[i] * LOAD(brow, i * gn + n) : (real)0;
                A *= da[i];
                Bv = da[i] * Bv + db_[i];
            }
            pa[lane] = A;
            pb[lane] = Bv;
            BARRIER();
            real h = carry[k * STATE_MAX + n];
            for (int j = 0; j < sl; ++j)
                h = pa[j * SSC_CB + k] * h + pb[j * SSC_CB + k];
            PRAGMA_UNROLL
            for (int i = 0; i < SSC_T; ++i) {
                if (t0 + i < end) {
                    h = da[i] * h + db_[i];
                    y[i] += LOAD(crow, i * gn + n) * h;
                }
            }
            if (saves)
                sv.at[(last - first) / RQ * sv.stride + n] = h;
            BARRIER();
            if (sl == SSC_SL - 1)
                carry[k * STATE_MAX + n] = h;
        }
        PRAGMA_UNROLL
        for (int i = 0; i < SSC_T; ++i) { /* x again for d * x: no register array holds it through the walk */
            const i64 at = (t0 + i) * H + ch;
            if (live && t0 + i < end)
                STORE(io.dst, at, ssm_finish(y[i], dv, SSM_D ? LOAD(io.x, at) : (real)0, ssm_z(io.z, at)));
        }
    }
    if (SSM_CARRY) {
        BARRIER(); /* the last lanes' final states are in `carry` */
        st = AT(state_t, stb, sto) + (ssm_slot(r, AT(int, slb, slo)) * H + cl) * N;
        for (i64 n = sl; n < N; n += SSC_SL)
            if (live)
                SSTORE(st, n, carry[k * STATE_MAX + n]);
    }
}
#ifndef RLX_NEED_FP64 /* f64 keeps the step kernel on GPUs: its LOCAL tiles would pass CUDA's 48 KiB static limit */
/* Mamba-2 chunked (SSD, target gpu, long sequences), chunks of M2_Q steps, three launches over
 * scratch holding one state [P, N] per (head, chunk slot) in the compute type:
 *   mamba2_chunk_state  each chunk's own final state from zero, sum_s exp(L[last]-L[s]) dt[s] x[s] (x) b[s],
 *                       and its total decay exp(L[last]), where L[t] = a * sum_{s<=t} dt[s] in the chunk;
 *   mamba2_state_pass   per state element of a row, in chunk order: replaces each chunk's own state by
 *                       the state entering it (the inter-chunk pass), from the row's initial state
 *                       (zero, or its entry of `state` with SSM_CARRY, where the final one is written);
 *   mamba2_chunk_scan   y[t] = exp(L[t]) C[t] . S_in  +  sum_{s<=t} exp(L[t]-L[s]) dt[s] (C[t] . B[s]) x[s],
 *                       the intra-chunk product as M2_Q x M2_Q work-group tiles in LOCAL memory.
 * Chunks are laid per row: row r's tokens fill its chunks from its first token, the last one
 * partial. With varlen a row is one sequence of cu_seqlens, so a sequence boundary anywhere in the
 * packed tokens starts a chunk and the state restarts there (at most num_seqs partial chunks more
 * than seq / M2_Q; mamba2_varlen_chunks lays the slots out). Groups of M2_LANES lanes own (head,
 * chunk slot, M2_PT rows of P); the grid is 1-D. Sums over s <= t are loops bounded by t, never
 * products with a zero mask, so a NaN at step t reaches only steps >= t: within its chunk through L
 * and the s <= t bound, beyond it through the state. With SSM_RESERVE (chunks of M2_Q = the saved forward's
 * 64) the state pass stores each state leaving a chunk and the scan each output before d and z. */

/* One chunk slot: its row, first token and steps (0: a slot no sequence uses). */
typedef struct {
    i64 row, first, steps;
} m2_chunk;

/* Chunk slot k of K. Without varlen, row r holds slots r*chunks .. r*chunks+chunks-1; with it the
 * scratch table of mamba2_varlen_chunks names each slot's sequence. */
INLINE_FN m2_chunk m2_chunk_at(i64 k, i64 K, i64 S, GLOBAL const int* cu, GLOBAL const int* table)
{
    m2_chunk out;
    if (SSM_VARLEN) {
        const i64 r = table[k];
        out.row = r < 0 ? 0 : r;
        out.first = r < 0 ? 0 : (i64)cu[r] + (k - table[K + r]) * M2_Q;
        const i64 left = r < 0 ? 0 : (i64)cu[r + 1] - out.first;
        out.steps = left < M2_Q ? left : M2_Q;
    } else {
        const i64 chunks = (S + M2_Q - 1) / M2_Q, r = k / chunks, c = k - r * chunks;
        out.row = r;
        out.first = r * S + c * M2_Q;
        out.steps = S - c * M2_Q < M2_Q ? S - c * M2_Q : M2_Q;
    }
    return out;
}

/* What the work-group `group` of mamba2_chunk_state / mamba2_chunk_scan owns: chunk slot `slot`
 * (head * K + chunk), the rows p0 .. p0+M2_PT-1 of P, and that chunk. */
typedef struct {
    i64 slot, head, p0;
    m2_chunk chunk;
} m2_tile;

INLINE_FN m2_tile m2_tile_of(i64 group, i64 P, i64 K, i64 S, GLOBAL const int* cu, GLOBAL const int* table)
{
    const i64 ptiles = (P + M2_PT - 1) / M2_PT;
    m2_tile out;
    out.slot = group / ptiles;
    out.p0 = (group - out.slot * ptiles) * M2_PT;
    out.head = out.slot / K;
    out.chunk = m2_chunk_at(out.slot - out.head * K, K, S, cu, table);
    return out;
}

/* The first chunk slot of row r (of row R: the slots in use). */
INLINE_FN i64 m2_row_slot(i64 r, i64 K, i64 S, GLOBAL const int* table)
{
    return SSM_VARLEN ? (i64)table[K + r] : r * ((S + M2_Q - 1) / M2_Q);
}

/* varlen: the slot table in scratch: table[k] = the sequence of slot k (-1: unused), table[K + r] =
 * the first slot of sequence r, table[K + R] = the slots in use. One work-item (R + K steps). */
KERNEL mamba2_varlen_chunks(i64 R, i64 K, GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* tb, i64 to)
{
    if (GID(0) != 0)
        return;
    GLOBAL const int* cu = AT(int, cub, cuo);
    GLOBAL int* table = AT(int, tb, to);
    i64 k = 0;
    for (i64 r = 0; r < R; ++r) {
        table[K + r] = (int)k;
        for (i64 t = cu[r]; t < cu[r + 1]; t += M2_Q)
            table[k++] = (int)r;
    }
    table[K + R] = (int)k;
    for (; k < K; ++k)
        table[k] = -1;
}

/* dts[t] = dt of token t0+t at head hh as §8 transforms it and Ls[t] = a * sum_{s<=t} dts[s], for
 * the chunk's `steps` steps, in LOCAL (lane 0 sums serially: M2_Q adds). Every lane of the work-group
 * calls it: it meets two barriers, the second once both arrays are complete. */
INLINE_FN void m2_stage_decay_barrier(LOCAL_PTR real* dts, LOCAL_PTR real* Ls, int lane, int steps,
                                      GLOBAL const store_t* dt, i64 t0, i64 HD, i64 hh, real a, real bias, real lo,
                                      real hi)
{
    if (lane < steps)
        dts[lane] = ssm_delta(LOAD(dt, (t0 + lane) * HD + hh), bias, lo, hi);
    BARRIER();
    if (lane == 0) {
        real acc = (real)0;
        for (int i = 0; i < steps; ++i) {
            acc += dts[i] * a;
            Ls[i] = acc;
        }
    }
    BARRIER();
}

/* The operands of the chunk products in LOCAL memory: the compute type on the portable path; with a
 * launch's RLX_MMA (CUDA only) the tensor cores' operand type (kernels_cuda/prelude.cuh), rounded once as
 * staged: a 16-bit thunk's x, b and c are exact there, the decay-weighted x, the chunk states and
 * C.B^T's decayed entries round to it (as mamba_ssm's chunk kernels round them to the input type). */
#ifndef M2_SPLIT_STATES
#define M2_SPLIT_STATES 0 /* 1, with RLX_MMA: mamba2_chunk_state's product from split operands (mamba2's backward) */
#endif
#ifdef RLX_MMA
#if M2_PT != 16 || M2_NT != 16 || M2_Q % 16 != 0 || M2_LANES < 128
#error "the MMA variant of mamba2's chunk products tiles 16x16: M2_PT = M2_NT = 16, M2_Q % 16 = 0, 4 warps at least"
#endif
typedef mma_t m2_op_t;
#define M2_OP(v) TO_MMA(v)
#define M2_LOCAL MMA_LOCAL
#define M2_NW (M2_LANES / 32 * 16) /* state columns per pass of mamba2_chunk_state: 16 per warp */
#else
typedef real m2_op_t;
#define M2_OP(v) (v)
#define M2_LOCAL LOCAL
#endif

#ifdef RLX_MMA
/* states[p0+p][n] = sum_s xw[s][p] b[s][n] for the chunk's steps: each warp one 16x16 tile of M2_NW
 * columns per pass, from b staged as [M2_Q][M2_NW] operands (bs), through an f32 tile (out) to the bounded
 * store. */
INLINE_FN void m2_state_mma_barrier(GLOBAL real* states, LOCAL_PTR const mma_t* xw, LOCAL_PTR mma_t* bs,
                                    LOCAL_PTR float* out, GLOBAL const store_t* bm, i64 t0, int steps, i64 G, i64 grp,
                                    i64 N, i64 P, i64 p0, int lane)
{
    const int w = MMA_WARP(lane);
    for (i64 n0 = 0; n0 < (steps > 0 ? N : 0); n0 += M2_NW) {
        BARRIER(); /* the previous pass's readers are done */
        for (int e = lane; e < M2_Q * M2_NW; e += M2_LANES) {
            const int s = e / M2_NW, nn = e - s * M2_NW;
            bs[e] = TO_MMA(s < steps && n0 + nn < N ? LOAD(bm, ((t0 + s) * G + grp) * N + n0 + nn) : (real)0);
        }
        BARRIER();
        mma_steps_tile(out, xw, bs, M2_NW, steps, w);
        BARRIER();
        for (int e = lane; e < M2_PT * M2_NW; e += M2_LANES) {
            const int p = e / M2_NW, nn = e - p * M2_NW;
            if (p0 + p < P && n0 + nn < N)
                states[(p0 + p) * N + n0 + nn] = out[e];
        }
    }
}
#if M2_SPLIT_STATES
/* The same product from split operands, as mamba2's backward recomputes the chunk states (M2_SPLIT_STATES, its
 * launch's define; mma_hi: kernels/mma_split.cl, before this text): xw = hi + lo (xw, xl), at TF32 b = hi + lo too, the
 * products hi.hi + lo.hi (+ hi.lo at TF32; a 16-bit thunk's own b is exact) with f32 accumulation. Rounded once,
 * the states move the log-decay's gradient (sums of cancelling terms gy.y - u.du) past the conformance bounds.
 * b staged 16 steps at a time ([16][M2_NW] operands in bs, at TF32 its lo part after): the chunk's whole b and its
 * lo part would pass CUDA's 48 KiB at TF32. */
INLINE_FN void m2_state_split_mma_barrier(GLOBAL real* states, LOCAL_PTR const mma_t* xw, LOCAL_PTR const mma_t* xl,
                                          LOCAL_PTR mma_t* bs, LOCAL_PTR float* out, GLOBAL const store_t* bm, i64 t0,
                                          int steps, i64 G, i64 grp, i64 N, i64 P, i64 p0, int lane)
{
    const int w = MMA_WARP(lane);
    for (i64 n0 = 0; n0 < (steps > 0 ? N : 0); n0 += M2_NW) {
        mma_acc acc;
        mma_zero(&acc);
        for (int s0 = 0; s0 < steps; s0 += 16) {
            BARRIER(); /* the previous slice's operands and the previous pass's out are read no more */
            for (int e = lane; e < 16 * M2_NW; e += M2_LANES) {
                const int s = s0 + e / M2_NW, nn = e - e / M2_NW * M2_NW;
                const real v = s < steps && n0 + nn < N ? LOAD(bm, ((t0 + s) * G + grp) * N + n0 + nn) : (real)0;
#if RLX_MMA == 2
                const float hi = mma_hi(v);
                bs[e] = TO_MMA(hi);
                bs[16 * M2_NW + e] = TO_MMA(v - hi);
#else
                bs[e] = TO_MMA(v);
#endif
            }
            BARRIER();
            PRAGMA_NO_UNROLL
            for (int h = 0; h < (RLX_MMA == 2 ? 3 : 2); ++h)
                mma_tile(&acc, MMA_COL, (h == 1 ? xl : xw) + s0 * 16, 16, MMA_ROW,
                         bs + (h == 2 ? 16 * M2_NW : 0) + w * 16, M2_NW);
        }
        mma_store(out + w * 16, &acc, M2_NW);
        BARRIER();
        for (int e = lane; e < M2_PT * M2_NW; e += M2_LANES) {
            const int p = e / M2_NW, nn = e - p * M2_NW;
            if (p0 + p < P && n0 + nn < N)
                states[(p0 + p) * N + n0 + nn] = out[e];
        }
    }
}
#endif
#else
/* states[p0+p][n] = sum_s xw[s][p] b[s][n] for the chunk's steps: one lane per state column n. */
INLINE_FN void m2_state_product(GLOBAL real* states, LOCAL_PTR const m2_op_t* xw, GLOBAL const store_t* bm, i64 t0,
                                int steps, i64 G, i64 grp, i64 N, i64 P, i64 p0, int lane)
{
    for (i64 n = lane; n < (steps > 0 ? N : 0); n += M2_LANES) {
        real acc[M2_PT];
        PRAGMA_UNROLL
        for (int p = 0; p < M2_PT; ++p)
            acc[p] = (real)0;
        for (int s = 0; s < steps; ++s) {
            const real bv = LOAD(bm, ((t0 + s) * G + grp) * N + n);
            PRAGMA_UNROLL
            for (int p = 0; p < M2_PT; ++p)
                acc[p] += xw[s * M2_PT + p] * bv;
        }
        PRAGMA_UNROLL
        for (int p = 0; p < M2_PT; ++p)
            if (p0 + p < P)
                states[(p0 + p) * N + n] = acc[p];
    }
}
#endif

KERNEL mamba2_chunk_state(i64 R, i64 S, i64 HD, i64 P, i64 N, i64 G, i64 K,
                          GLOBAL uchar* xb, i64 xo, GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* ab, i64 ao,
                          GLOBAL uchar* bb, i64 bo, GLOBAL uchar* biasb, i64 biaso, GLOBAL uchar* cub, i64 cuo,
                          GLOBAL uchar* sb, i64 so, GLOBAL uchar* eb, i64 eo, GLOBAL uchar* tb, i64 to, real lo, real hi)
{
    LOCAL real dts[M2_Q], Ls[M2_Q];
    M2_LOCAL m2_op_t xw[M2_Q * M2_PT];
#if defined(RLX_MMA) && M2_SPLIT_STATES
    MMA_LOCAL mma_t xl[M2_Q * M2_PT]; /* xw's lo part */
#endif
    const int lane = (int)LID(0);
    const m2_tile tile = m2_tile_of(GROUP(0), P, K, S, AT(int, cub, cuo), AT(int, tb, to));
    /* a slot no sequence uses has no steps: the whole group walks empty loops to every barrier (a
     * work-item that returns before a barrier is undefined in OpenCL; Intel's CPU runtime crashes on it) */
    const int steps = (int)tile.chunk.steps;
    const i64 t0 = tile.chunk.first, hh = tile.head, slot = tile.slot, p0 = tile.p0, grp = hh / (HD / G);
    GLOBAL const store_t* x = AT(store_t, xb, xo);
    GLOBAL const store_t* dt = AT(store_t, dtb, dto);
    GLOBAL const store_t* bm = AT(store_t, bb, bo);
    GLOBAL real* states = AT(real, sb, so) + slot * P * N; /* this chunk's [P, N] */
    const real a = PLOAD(AT(param_t, ab, ao), hh), bias = ssm_param(AT(param_t, biasb, biaso), hh, SSM_BIAS);
    m2_stage_decay_barrier(dts, Ls, lane, steps, dt, t0, HD, hh, a, bias, lo, hi);
    /* xw[s][p] = exp(L[last] - L[s]) dt[s] x[s][p]: the weight of step s in the chunk's final state (zero
     * past the chunk's steps, which the MMA tiles cover) */
    for (int e = lane; e < M2_Q * M2_PT; e += M2_LANES) {
        const int s = e / M2_PT, p = e - s * M2_PT;
        const real v = s < steps && p0 + p < P
                           ? rlx_exp(Ls[steps - 1] - Ls[s]) * dts[s] * LOAD(x, ((t0 + s) * HD + hh) * P + p0 + p)
                           : (real)0;
#if defined(RLX_MMA) && M2_SPLIT_STATES
        const float hi = mma_hi(v);
        xw[e] = TO_MMA(hi);
        xl[e] = TO_MMA(v - hi);
#else
        xw[e] = M2_OP(v);
#endif
    }
    if (p0 == 0 && lane == 0 && steps > 0)
        AT(real, eb, eo)[slot] = rlx_exp(Ls[steps - 1]);
    BARRIER();
#ifdef RLX_MMA
    MMA_LOCAL float out[M2_PT * M2_NW];
#if M2_SPLIT_STATES
    MMA_LOCAL mma_t bs[(RLX_MMA == 2 ? 2 : 1) * 16 * M2_NW]; /* a 16-step slice of b, at TF32 its lo part after */
    m2_state_split_mma_barrier(states, xw, xl, bs, out, bm, t0, steps, G, grp, N, P, p0, lane);
#else
    MMA_LOCAL mma_t bs[M2_Q * M2_NW];
    m2_state_mma_barrier(states, xw, bs, out, bm, t0, steps, G, grp, N, P, p0, lane);
#endif
#else
    m2_state_product(states, xw, bm, t0, steps, G, grp, N, P, p0, lane);
#endif
}

/* One work-item per state element of one (row, head): walks the row's chunks in order, leaving in
 * each chunk's slot the state entering it. */
KERNEL mamba2_state_pass(i64 R, i64 S, i64 HD, i64 P, i64 N, i64 K,
                         GLOBAL uchar* stb, i64 sto, GLOBAL uchar* slb, i64 slo,
                         GLOBAL uchar* sb, i64 so, GLOBAL uchar* eb, i64 eo, GLOBAL uchar* tb, i64 to,
                         GLOBAL uchar* rsb, i64 rso, i64 RQ)
{
    const i64 e = GID(0), pn = P * N;
    if (e >= R * HD * pn)
        return;
    const i64 rh = e / pn, el = e - rh * pn, r = rh / HD, hh = rh - r * HD;
    GLOBAL const int* table = AT(int, tb, to);
    const i64 k0 = m2_row_slot(r, K, S, table), k1 = m2_row_slot(r + 1, K, S, table);
    GLOBAL real* st = AT(real, sb, so) + hh * K * pn + el;
    GLOBAL const real* dec = AT(real, eb, eo) + hh * K;
    GLOBAL state_t* carried = AT(state_t, stb, sto) + (ssm_slot(r, AT(int, slb, slo)) * HD + hh) * pn + el;
    const ssm_saved sv = ssm_saved_of(rsb, rso, r, S, RQ, HD * P, hh * P, N); /* with SSM_RESERVE (RQ = M2_Q) */
    real s = SSM_CARRY ? SLOAD(carried, 0) : (real)0;
    for (i64 k = k0; k < k1; ++k) {
        const real own = st[k * pn];
        st[k * pn] = s;
        s = dec[k] * s + own;
        if (SSM_RESERVE) /* the state leaving the row's chunk k - k0 */
            sv.at[(k - k0) * sv.stride + el] = s;
    }
    if (SSM_CARRY)
        SSTORE(carried, 0, s);
}

#define M2_NTP (M2_NT + 1) /* LOCAL row strides padded by one so that a column walk spreads over banks */
#define M2_QP (M2_Q + 1)
#define M2_GS (M2_Q * M2_Q / M2_LANES) /* entries of C.B^T per lane: row t = lane % M2_Q, M2_GS columns */
#define M2_TS (M2_LANES / M2_PT)       /* output rows apart for one lane: p = lane % M2_PT, t = lane / M2_PT + i*M2_TS */
#define M2_YI (M2_Q / M2_TS)           /* outputs per lane */

#ifdef RLX_MMA
/* Where mamba2_chunk_scan's outputs of one tile go: y of step t and row p (p < rows) at at + t * stride + p
 * of dst (and of z), finished with D and z. */
typedef struct {
    GLOBAL store_t* dst;
    GLOBAL const store_t* z;
    GLOBAL real* ys; /* with SSM_RESERVE: the saved forward's y, indexed as dst */
    i64 at, stride, rows;
    real dv;
} m2_scan_out;

#define M2_QT (M2_Q / 16)                    /* 16-step tiles of a chunk */
#define M2_GT (M2_QT * (M2_QT + 1) / 2)      /* C.B^T tiles on and below the diagonal */
#if (M2_LANES / 32) * 2 < M2_GT + M2_QT
#error "mamba2_chunk_scan's MMA variant gives each warp at most two product tiles"
#endif

/* C.B^T and C.S_in^T of one chunk on the tensor cores (the LOCAL tiles at: mma_scan_local, c and b the rows and
 * cols), over N in slices of 16: warp w accumulates product tiles w and w + warps (mma_scan_pair: C.B^T, then
 * C.S_in^T), then stores them, f32, in gm [M2_Q][M2_Q] and ys [M2_Q][M2_PT].
 * c and b: the chunk's first row of the group's c and b, rows `stride` apart; states: the tile's first state
 * row (of `rows`). */
INLINE_FN void m2_scan_tiles_barrier(mma_scan_local at, GLOBAL const real* states, i64 rows, GLOBAL const store_t* c,
                                     GLOBAL const store_t* b, i64 stride, i64 N, int steps, int lane)
{
    LOCAL_PTR mma_t* const cs = at.rows;
    LOCAL_PTR mma_t* const bs = at.cols;
    LOCAL_PTR mma_t* const ss = at.st;
    LOCAL_PTR float* const gm = at.gm;
    LOCAL_PTR float* const ys = at.ys;
    mma_scan_pair pair = mma_scan_pair_of(MMA_WARP(lane), M2_LANES / 32, M2_GT, M2_QT);
    for (i64 n0 = 0; n0 < (steps > 0 ? N : 0); n0 += 16) {
        BARRIER(); /* the previous slice's readers are done */
        for (int e = lane; e < M2_Q * 16; e += M2_LANES) {
            const int s = e / 16, nn = e - s * 16;
            const int in = s < steps && n0 + nn < N;
            cs[e] = TO_MMA(in ? LOAD(c, s * stride + n0 + nn) : (real)0);
            bs[e] = TO_MMA(in ? LOAD(b, s * stride + n0 + nn) : (real)0);
        }
        for (int e = lane; e < M2_PT * 16; e += M2_LANES) {
            const int p = e / 16, nn = e - p * 16;
            ss[e] = TO_MMA(p < rows && n0 + nn < N ? states[p * N + n0 + nn] : (real)0);
        }
        BARRIER();
        mma_scan_pair_add(&pair, cs, bs, ss);
    }
    mma_scan_pair_store(&pair, gm, M2_Q, ys, M2_PT);
}

/* y[t][p] = exp(L[t]) C[t].S_in[p] + sum_{s<=t} exp(L[t]-L[s]) dt[s] (C[t].B[s]) x[s][p] on the tensor
 * cores (m2_scan_tiles_barrier), then: the decayed C.B^T entries below the diagonal tiles become operands (gmm),
 * those of the diagonal tiles stay f32 in gm; the state part scaled by exp(L[t]) takes gmm times x on the
 * tensor cores (warp w < M2_Q/16: steps 16w..), and each lane adds its diagonal terms, a sum bounded by t,
 * and stores. As on the portable path nothing at a step s > t reaches y[t], not even a NaN: such entries
 * are selected away, never multiplied by a zero mask. */
INLINE_FN void m2_scan_product_barrier(m2_scan_out out, mma_scan_local at, GLOBAL const real* states,
                                       GLOBAL const store_t* c, GLOBAL const store_t* b, i64 stride, i64 N, int steps,
                                       LOCAL_PTR const real* dts, LOCAL_PTR const real* Ls, LOCAL_PTR const mma_t* xs,
                                       int lane)
{
    LOCAL_PTR float* const gm = at.gm;
    LOCAL_PTR float* const ys = at.ys;
    LOCAL_PTR mma_t* const gmm = at.gmm;
    m2_scan_tiles_barrier(at, states, out.rows, c, b, stride, N, steps, lane);
    BARRIER();
    for (int e = lane; e < M2_Q * M2_Q; e += M2_LANES) {
        const int t = e / M2_Q, s = e - t * M2_Q;
        const real v = s <= t && t < steps ? rlx_exp(Ls[t] - Ls[s]) * dts[s] * gm[e] : (real)0;
        if (s / 16 == t / 16)
            gm[e] = v;
        else if (s / 16 < t / 16)
            gmm[e] = TO_MMA(v);
    }
    for (int e = lane; e < M2_Q * M2_PT; e += M2_LANES) {
        const int t = e / M2_PT;
        ys[e] = t < steps ? rlx_exp(Ls[t]) * ys[e] : (real)0;
    }
    BARRIER();
    const int w = MMA_WARP(lane);
    if (w < M2_Q / 16) {
        mma_acc y;
        mma_load(&y, ys + w * 16 * M2_PT, M2_PT);
        for (int sj = 0; sj < w; ++sj)
            mma_tile(&y, MMA_ROW, gmm + w * 16 * M2_Q + sj * 16, M2_Q, MMA_ROW, xs + sj * 16 * M2_PT, M2_PT);
        mma_store(ys + w * 16 * M2_PT, &y, M2_PT);
    }
    BARRIER();
    for (int e = lane; e < M2_Q * M2_PT; e += M2_LANES) {
        const int t = e / M2_PT, p = e - t * M2_PT;
        if (t < steps && p < out.rows) {
            real y = ys[e];
            for (int s = t / 16 * 16; s <= t; ++s)
                y += gm[t * M2_Q + s] * FROM_MMA(xs[s * M2_PT + p]);
            const i64 at = out.at + t * out.stride + p;
            if (SSM_RESERVE)
                out.ys[at] = y;
            STORE(out.dst, at, ssm_finish(y, out.dv, FROM_MMA(xs[e]), ssm_z(out.z, at)));
        }
    }
}
#endif

KERNEL mamba2_chunk_scan(i64 R, i64 S, i64 HD, i64 P, i64 N, i64 G, i64 K,
                         GLOBAL uchar* xb, i64 xo, GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* ab, i64 ao,
                         GLOBAL uchar* bb, i64 bo, GLOBAL uchar* cb, i64 co, GLOBAL uchar* db, i64 dof,
                         GLOBAL uchar* biasb, i64 biaso, GLOBAL uchar* skb, i64 sko, GLOBAL uchar* zb, i64 zo,
                         GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* sb, i64 so, GLOBAL uchar* tb, i64 to, real lo, real hi,
                         GLOBAL uchar* rsb, i64 rso, i64 RQ)
{
    LOCAL real dts[M2_Q], Ls[M2_Q];
    M2_LOCAL m2_op_t xs[M2_Q * M2_PT];
    const int lane = (int)LID(0);
    const m2_tile tile = m2_tile_of(GROUP(0), P, K, S, AT(int, cub, cuo), AT(int, tb, to));
    const int steps = (int)tile.chunk.steps; /* 0: a slot no sequence uses, walked empty as in mamba2_chunk_state */
    const i64 t0 = tile.chunk.first, hh = tile.head, slot = tile.slot, p0 = tile.p0, grp = hh / (HD / G);
    GLOBAL const store_t* x = AT(store_t, xb, xo);
    GLOBAL const store_t* dt = AT(store_t, dtb, dto);
    GLOBAL const store_t* bm = AT(store_t, bb, bo);
    GLOBAL const store_t* cm = AT(store_t, cb, co);
    GLOBAL const store_t* z = AT(store_t, zb, zo);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    GLOBAL const real* states = AT(real, sb, so) + slot * P * N; /* the state entering this chunk */
    const real a = PLOAD(AT(param_t, ab, ao), hh), bias = ssm_param(AT(param_t, biasb, biaso), hh, SSM_BIAS);
    const real dv = ssm_param(AT(param_t, skb, sko), hh, SSM_D);
    m2_stage_decay_barrier(dts, Ls, lane, steps, dt, t0, HD, hh, a, bias, lo, hi);
    for (int e = lane; e < M2_Q * M2_PT; e += M2_LANES) { /* zero past the chunk's steps, which MMA tiles cover */
        const int s = e / M2_PT, p = e - s * M2_PT;
        xs[e] = M2_OP(s < steps && p0 + p < P ? LOAD(x, ((t0 + s) * HD + hh) * P + p0 + p) : (real)0);
    }
#ifdef RLX_MMA
    MMA_LOCAL float at_gm[M2_Q * M2_Q], at_ys[M2_Q * M2_PT];
    MMA_LOCAL mma_t at_rows[M2_Q * 16], at_cols[M2_Q * 16], at_st[M2_PT * 16];
#if RLX_MMA == 2 /* TF32 operands are f32: those below the diagonal in place */
    const mma_scan_local at = {at_gm, at_ys, at_gm, at_rows, at_cols, at_st};
#else
    MMA_LOCAL mma_t at_gmm[M2_Q * M2_Q];
    const mma_scan_local at = {at_gm, at_ys, at_gmm, at_rows, at_cols, at_st};
#endif
    const m2_scan_out out = {dst, z, mamba2_saved_y(rsb, rso, R, S, HD, P, N, RQ) /* with SSM_RESERVE */,
                             (t0 * HD + hh) * P + p0, HD * P, P - p0, dv};
    const i64 rows_at = (t0 * G + grp) * N;
    m2_scan_product_barrier(out, at, states + p0 * N, cm + rows_at, bm + rows_at, G * N, N, steps, dts, Ls, xs,
                            lane);
#else
    LOCAL real cs[M2_Q * M2_NTP], bs[M2_Q * M2_NTP], ss[M2_PT * M2_NTP], gm[M2_Q * M2_QP];
    /* this lane's C.B^T entries: row tg, columns s0..; its outputs: row p0+py, steps ty + i*M2_TS
     * (remainders as x - q*d: a div/rem pair becomes an LLVM `freeze`, which Oclgrind rejects) */
    const int sh = lane / M2_Q, tg = lane - sh * M2_Q, s0 = sh * M2_GS, ty = lane / M2_PT, py = lane - ty * M2_PT;
    real g[M2_GS], yi[M2_YI];
    PRAGMA_UNROLL
    for (int j = 0; j < M2_GS; ++j)
        g[j] = (real)0;
    PRAGMA_UNROLL
    for (int i = 0; i < M2_YI; ++i)
        yi[i] = (real)0;
    for (i64 n0 = 0; n0 < (steps > 0 ? N : 0); n0 += M2_NT) {
        BARRIER(); /* the previous tile's readers are done */
        for (int e = lane; e < M2_Q * M2_NT; e += M2_LANES) {
            const int s = e / M2_NT, nn = e - s * M2_NT;
            const int in = s < steps && n0 + nn < N;
            const i64 at = ((t0 + s) * G + grp) * N + n0 + nn;
            cs[s * M2_NTP + nn] = in ? LOAD(cm, at) : (real)0;
            bs[s * M2_NTP + nn] = in ? LOAD(bm, at) : (real)0;
        }
        for (int e = lane; e < M2_PT * M2_NT; e += M2_LANES) {
            const int p = e / M2_NT, nn = e - p * M2_NT;
            ss[p * M2_NTP + nn] = p0 + p < P && n0 + nn < N ? states[(p0 + p) * N + n0 + nn] : (real)0;
        }
        BARRIER();
        for (int nn = 0; nn < M2_NT; ++nn) { /* not unrolled: ptxas would hoist all tile loads (204 registers) */
            const real ct = cs[tg * M2_NTP + nn], sv = ss[py * M2_NTP + nn];
            PRAGMA_UNROLL
            for (int j = 0; j < M2_GS; ++j)
                g[j] += ct * bs[(s0 + j) * M2_NTP + nn];
            PRAGMA_UNROLL
            for (int i = 0; i < M2_YI; ++i)
                yi[i] += cs[(ty + i * M2_TS) * M2_NTP + nn] * sv;
        }
    }
    /* gm[t][s] = exp(L[t] - L[s]) dt[s] (C[t] . B[s]) for s <= t < steps; the rest is never read */
    PRAGMA_UNROLL
    for (int j = 0; j < M2_GS; ++j)
        if (s0 + j <= tg && tg < steps)
            gm[tg * M2_QP + s0 + j] = rlx_exp(Ls[tg] - Ls[s0 + j]) * dts[s0 + j] * g[j];
    BARRIER();
    PRAGMA_UNROLL
    for (int i = 0; i < M2_YI; ++i) {
        const int t = ty + i * M2_TS;
        if (t < steps && p0 + py < P) {
            real y = rlx_exp(Ls[t]) * yi[i];
            for (int s = 0; s <= t; ++s)
                y += gm[t * M2_QP + s] * xs[s * M2_PT + py];
            const i64 at = ((t0 + t) * HD + hh) * P + p0 + py;
            if (SSM_RESERVE) /* the reserve's y, addressed here: a pointer held across the loops cost 16 registers */
                mamba2_saved_y(rsb, rso, R, S, HD, P, N, RQ)[at] = y;
            STORE(dst, at, ssm_finish(y, dv, xs[t * M2_PT + py], ssm_z(z, at)));
        }
    }
#endif
}
#endif
#endif

#if SSM_RESERVE
/* c . b over N values, in four partial sums (n mod 4): one serial chain of N adds made the scores below
 * latency-bound (1.6x mamba2's forward on PoCL at P = N = 64). */
INLINE_FN real mamba2_dot(GLOBAL const store_t* c, GLOBAL const store_t* b, i64 N)
{
    real part[4] = {(real)0, (real)0, (real)0, (real)0};
    i64 n = 0;
    for (; n + 4 <= N; n += 4)
        PRAGMA_UNROLL
        for (int k = 0; k < 4; ++k)
            part[k] += LOAD(c, n + k) * LOAD(b, n + k);
    for (; n < N; ++n)
        part[0] += LOAD(c, n) * LOAD(b, n);
    return (part[0] + part[1]) + (part[2] + part[3]);
}

/* mamba2's saved scores (docs/abi.md 6a.1), a launch after the forward of the same program: item (l, head hh,
 * row r * K + chunk k) writes row l of the chunk's W[l, s] = (c_l . b_s) exp(cum_l - cum_s) for s <= l, 0 for
 * s > l and for a token l past the row's end; cum_t = sum of dt*a over the chunk's tokens 0 .. t, summed in
 * token order (as the layout's definition: every device gives the host's cumulative sums). */
KERNEL mamba2_reserve_scores(i64 R, i64 S, i64 HD, i64 P, i64 N, i64 G, i64 RQ,
                             GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* ab, i64 ao, GLOBAL uchar* bb, i64 bo,
                             GLOBAL uchar* cb, i64 co, GLOBAL uchar* biasb, i64 biaso, GLOBAL uchar* rsb, i64 rso,
                             real lo, real hi)
{
    const i64 l = GID(0), hh = GID(1), rk = GID(2), K = (S + RQ - 1) / RQ;
    if (l >= RQ || hh >= HD || rk >= R * K)
        return;
    const i64 r = rk / K, t0 = r * S + (rk - r * K) * RQ, grp = hh / (HD / G);
    const i64 steps = r * S + S - t0 < RQ ? r * S + S - t0 : RQ; /* the chunk's tokens */
    GLOBAL real* w = mamba2_saved_y(rsb, rso, R, S, HD, P, N, RQ) + R * S * HD * P + ((rk * HD + hh) * RQ + l) * RQ;
    GLOBAL const store_t* dt = AT(store_t, dtb, dto);
    GLOBAL const store_t* crow = AT(store_t, cb, co) + ((t0 + l) * G + grp) * N;
    const real a = PLOAD(AT(param_t, ab, ao), hh), bias = ssm_param(AT(param_t, biasb, biaso), hh, SSM_BIAS);
    const int live = l < steps;
    real cum_l = (real)0, cum = (real)0;
    for (i64 s = 0; live && s <= l; ++s)
        cum_l += ssm_delta(LOAD(dt, (t0 + s) * HD + hh), bias, lo, hi) * a;
    for (i64 s = 0; s < RQ; ++s) {
        real v = (real)0;
        if (live && s <= l) {
            GLOBAL const store_t* brow = AT(store_t, bb, bo) + ((t0 + s) * G + grp) * N;
            cum += ssm_delta(LOAD(dt, (t0 + s) * HD + hh), bias, lo, hi) * a;
            v = rlx_exp(cum_l - cum) * mamba2_dot(crow, brow, N);
        }
        w[s] = v;
    }
}
#endif

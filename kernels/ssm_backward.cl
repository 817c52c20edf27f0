/* Backward of the state-space family (ABI.md §9): selective_scan_backward and mamba2_backward, one
 * text for both targets. kernels/ssm_fields.cl (the version-2 switches, rows, the delta transform)
 * precedes it.
 *
 * Both ops are made of "state rows": a vector h[N] that walks a row's tokens as
 *   h[n] = exp(dl * a[n]) * h[n] + dl * x * b[n],   y = sum_n c[n] * h[n],
 * one per (row, channel) for selective_scan (a[n] = a[ch, n]) and one per (row, head, p) for mamba2
 * (a[n] = a[head] for every n), where dl is the step's transformed delta (dt). The backward walks each
 * state row in reverse with the states recomputed from checkpoints: a forward pass stores the state
 * entering every chunk of SSMB_Q steps, then chunk by chunk from the last the chunk's states are
 * recomputed into a workspace and walked back; with SSM_RESERVE the forward pass takes the saved forward's
 * states (every RQ steps) where a chunk starts at one and steps only the chunks between. Memory per state row:
 * (ceil(seq / SSMB_Q) + SSMB_Q + 1) states, in the compute type, in the launch's scratch; at the cpu target
 * selective_scan's workspace keeps the chunk's SSMB_Q decays exp(dl * a[n]) too, so that the reverse step takes
 * no exp, and the checkpoints of the state rows an item walks together chunk by chunk, a block's channels or a
 * head's P rows (SSMB_KEEP_DECAYS, SSMB_ROWS_TOGETHER below). Nothing is held in private arrays, so the program needs no stack at any state size.
 *
 * Work-items: one per (row, group, block of the group's channels / heads). An item walks its block's
 * state rows one after the other, so the gradients they share are sums taken in one fixed order by
 * one item, with no atomics: d_b and d_c of the group's tokens (into the block's partial, in scratch),
 * the per-token delta gradient of a head (mamba2: summed over p). What several items share (d_b and
 * d_c over the blocks; d_a, d_d and the delta bias's gradient over the rows) is written per item as a
 * partial and summed by ssm_backward_reduce, in the order of the partials: the same bytes every run.
 * Scratch is in the compute type (f32 for 16-bit thunks); each d_ output is rounded once, on store. */

/* At the cpu target (PoCL) selective_scan's recomputation keeps its decays, and an item walks its state rows (a
 * block's channels, a head's P rows) together, chunk by chunk, so that the chunk's b, c and d_b, d_c partials stay
 * in cache (the gpu target: exp is cheaper than the registers these take). */
#ifdef RLX_TARGET_CPU
#define SSMB_KEEP_DECAYS 1
#define SSMB_ROWS_TOGETHER 1
#else
#define SSMB_KEEP_DECAYS 0
#define SSMB_ROWS_TOGETHER 0
#endif

#ifdef SSM_PARAM_F32
#define PSTORE(p, i, v) RLX_ST_F32(p, i, v)
#else
#define PSTORE(p, i, v) STORE(p, i, v)
#endif

/* One work-item's workspace (reals) for `rows` state rows walked together, of up to S tokens: the states after
 * each step of one chunk, with `decays` the decays of those steps (else dec is 0), then per row the checkpoints
 * (the state entering each chunk) and the running state and then its gradient (ssmb_workspace_row). */
typedef struct {
    GLOBAL real* ckpt;
    GLOBAL real* work;
    GLOBAL real* dec;
    GLOBAL real* g;
} ssmb_workspace;

INLINE_FN ssmb_workspace ssmb_workspace_of(GLOBAL real* scratch, i64 item, i64 S, i64 N, int decays, i64 rows)
{
    const i64 chunks = (S + SSMB_Q - 1) / SSMB_Q, steps = decays ? 2 * SSMB_Q : SSMB_Q;
    ssmb_workspace w;
    w.work = scratch + item * (steps + rows * (chunks + 1)) * N;
    w.dec = decays ? w.work + SSMB_Q * N : 0;
    w.ckpt = w.work + steps * N;
    w.g = w.ckpt + chunks * N;
    return w;
}

/* Row `row`'s view of a workspace of rows of up to S tokens: its checkpoints and running state. */
INLINE_FN ssmb_workspace ssmb_workspace_row(ssmb_workspace w, i64 row, i64 S, i64 N)
{
    const i64 chunks = (S + SSMB_Q - 1) / SSMB_Q;
    w.ckpt += row * (chunks + 1) * N;
    w.g = w.ckpt + chunks * N;
    return w;
}

/* Where one state row's tensors are: x, z, d_dst, d_x and d_z at tok*xs + xo; delta and its gradient
 * sum at tok*ds + dof; the b, c rows and their gradient partials at tok*bs + bo; a[n] at a[n*an]. */
typedef struct {
    i64 xs, xo, ds, dof, bs, bo, an;
} ssmb_index;

/* The step's transformed delta (dt) of token tok. */
INLINE_FN real ssmb_dl(GLOBAL const store_t* delta, i64 at, real bias, real lo, real hi)
{
    return ssm_delta(LOAD(delta, at), bias, lo, hi);
}

/* exp(dl * a[n]): for a state row of one shared a (an = 0, mamba2) the step's one value `shared`. */
INLINE_FN real ssmb_decay(real dl, GLOBAL const param_t* a, i64 n, i64 an, real shared)
{
    return an ? rlx_exp(dl * PLOAD(a, n)) : shared;
}

/* h_next[n] = exp(dl*a[n]) * h[n] + dl*x*b[n] for token tok (h_next may be h); the decays exp(dl*a[n]) into
 * dec[n] unless dec is 0. */
INLINE_FN void ssmb_step(ssmb_index ix, i64 tok, i64 N, GLOBAL const param_t* a, real bias, real lo, real hi,
                         GLOBAL const store_t* x, GLOBAL const store_t* delta, GLOBAL const store_t* bm,
                         GLOBAL const real* h, GLOBAL real* h_next, GLOBAL real* dec)
{
    const real dl = ssmb_dl(delta, tok * ix.ds + ix.dof, bias, lo, hi), u = dl * LOAD(x, tok * ix.xs + ix.xo);
    GLOBAL const store_t* brow = bm + tok * ix.bs + ix.bo;
    const real shared = rlx_exp(dl * PLOAD(a, 0));
    for (i64 n = 0; n < N; ++n) {
        const real decay = ssmb_decay(dl, a, n, ix.an, shared);
        if (dec)
            dec[n] = decay;
        h_next[n] = decay * h[n] + u * LOAD(brow, n);
    }
}

/* The checkpoints of one state row over tokens [t0, t1): the state entering each chunk of SSMB_Q steps into
 * ckpt, from the initial state (h0 with SSM_CARRY, else 0); `g` is the running state. With SSM_RESERVE a chunk
 * starting where a chunk of the saved forward `sv` does takes the state saved there, and the steps of a chunk
 * followed by such a one are not run (nor the last chunk's: no checkpoint follows it). */
INLINE_FN void ssmb_checkpoints(ssmb_index ix, i64 t0, i64 t1, i64 N, GLOBAL const param_t* a, real bias, real lo,
                                real hi, GLOBAL const store_t* x, GLOBAL const store_t* delta, GLOBAL const store_t* bm,
                                GLOBAL const state_t* h0, ssm_saved sv, GLOBAL real* ckpt, GLOBAL real* g)
{
    const i64 chunks = (t1 - t0 + SSMB_Q - 1) / SSMB_Q;
    for (i64 n = 0; n < N; ++n)
        g[n] = SSM_CARRY ? SLOAD(h0, n) : (real)0;
    for (i64 k = 0; k < chunks; ++k) {
        const i64 c0 = t0 + k * SSMB_Q, c1 = c0 + SSMB_Q < t1 ? c0 + SSMB_Q : t1;
        const i64 saved = (c0 - t0) / sv.every; /* remainders by multiplication, as ssmb_item_of's */
        GLOBAL const real* from = SSM_RESERVE && k > 0 && saved * sv.every == c0 - t0 ? sv.at + (saved - 1) * sv.stride
                                                                                      : g;
        int walk = k + 1 < chunks; /* to the next checkpoint, unless the saved forward holds it */
        if (SSM_RESERVE && (c1 - t0) / sv.every * sv.every == c1 - t0)
            walk = 0;
        for (i64 n = 0; n < N; ++n)
            ckpt[k * N + n] = g[n] = from[n];
        if (walk)
            for (i64 tok = c0; tok < c1; ++tok)
                ssmb_step(ix, tok, N, a, bias, lo, hi, x, delta, bm, g, g, 0);
    }
}

/* The tensors and parameters a state row reads and writes (a: its a row, or its head's a). */
typedef struct {
    GLOBAL const param_t* a;
    real bias, dv, lo, hi;
    GLOBAL const store_t* x;
    GLOBAL const store_t* delta;
    GLOBAL const store_t* bm;
    GLOBAL const store_t* cm;
    GLOBAL const store_t* z;
    GLOBAL const store_t* gout;
    GLOBAL store_t* dx;
    GLOBAL store_t* dz;
} ssmb_io;

/* The reverse walk of chunk k of one state row over tokens [t0, t1), its states recomputed from the row's
 * checkpoint, its running gradient in ws.g: writes d_x and d_z of the chunk's tokens, adds its share to the
 * partials of d_b, d_c (db, dc), of the delta gradient (ddl, before the transform's own derivative) and of
 * d_a (da[n]). Returns dd plus the chunk's share of d_d (sum of dy * x), added token by token. */
INLINE_FN real ssmb_chunk(ssmb_index ix, ssmb_io io, i64 k, i64 t0, i64 t1, i64 N, ssmb_workspace ws, GLOBAL real* ddl,
                          GLOBAL real* db, GLOBAL real* dc, GLOBAL real* da, real dd)
{
    GLOBAL const param_t* a = io.a;
    GLOBAL real* ckpt = ws.ckpt;
    GLOBAL real* work = ws.work;
    GLOBAL real* g = ws.g;
    const real bias = io.bias, dv = io.dv, lo = io.lo, hi = io.hi;
    const i64 c0 = t0 + k * SSMB_Q, c1 = c0 + SSMB_Q < t1 ? c0 + SSMB_Q : t1;
    for (i64 tok = c0; tok < c1; ++tok)
        ssmb_step(ix, tok, N, a, bias, lo, hi, io.x, io.delta, io.bm,
                  tok == c0 ? ckpt + k * N : work + (tok - c0 - 1) * N, work + (tok - c0) * N,
                  ws.dec ? ws.dec + (tok - c0) * N : 0);
    for (i64 tok = c1 - 1; tok >= c0; --tok) {
        GLOBAL const real* h = work + (tok - c0) * N;
        GLOBAL const real* hp = tok == c0 ? ckpt + k * N : h - N;
        const i64 xi = tok * ix.xs + ix.xo, di = tok * ix.ds + ix.dof, bi = tok * ix.bs + ix.bo;
        const real xv = LOAD(io.x, xi), dl = ssmb_dl(io.delta, di, bias, lo, hi), u = dl * xv;
        real y = (real)0;
        for (i64 n = 0; n < N; ++n)
            y += LOAD(io.cm + bi, n) * h[n];
        real gy = LOAD(io.gout, xi);
        if (SSM_Z) { /* out = (y + d*x) * silu(z) */
            const real zv = LOAD(io.z, xi), sz = sigmoid_r(zv), pre = SSM_D ? y + dv * xv : y;
            STORE(io.dz, xi, gy * pre * sz * ((real)1 + zv * ((real)1 - sz)));
            gy *= zv * sz;
        }
        real gx = SSM_D ? gy * dv : (real)0, gb = (real)0, gdl = (real)0;
        if (SSM_D)
            dd += gy * xv;
        const real shared = rlx_exp(dl * PLOAD(a, 0)); /* mamba2's; selective_scan's may be in dec */
        const i64 step = (tok - c0) * N;
        for (i64 n = 0; n < N; ++n) {
            const real an = PLOAD(a, n * ix.an);
            const real decay = ws.dec ? ws.dec[step + n] : ssmb_decay(dl, a, n, ix.an, shared);
            const real bn = LOAD(io.bm + bi, n);
            const real gn = g[n] + gy * LOAD(io.cm + bi, n), carried = gn * decay * hp[n];
            dc[bi + n] += gy * h[n];
            db[bi + n] += gn * u;
            gb += gn * bn;
            gdl += carried * an;
            da[n] += carried * dl;
            g[n] = gn * decay;
        }
        STORE(io.dx, xi, gx + dl * gb);
        ddl[di] += gdl + xv * gb;
    }
    return dd;
}

/* The start of one state row's reverse walk over tokens [t0, t1): its checkpoints (`sv`: its saved states, with
 * SSM_RESERVE) and its running gradient, with SSM_CARRY the final state's gradient at dstate. */
INLINE_FN void ssmb_row_start(ssmb_index ix, ssmb_io io, i64 t0, i64 t1, i64 N, GLOBAL const state_t* h0,
                              GLOBAL const state_t* dstate, ssm_saved sv, ssmb_workspace ws)
{
    ssmb_checkpoints(ix, t0, t1, N, io.a, io.bias, io.lo, io.hi, io.x, io.delta, io.bm, h0, sv, ws.ckpt, ws.g);
    for (i64 n = 0; n < N; ++n)
        ws.g[n] = SSM_CARRY ? SLOAD(dstate, n) : (real)0;
}

/* The end of one state row's reverse walk: with SSM_CARRY the initial state's gradient into dstate. */
INLINE_FN void ssmb_row_end(i64 N, GLOBAL state_t* dstate, ssmb_workspace ws)
{
    if (SSM_CARRY)
        for (i64 n = 0; n < N; ++n)
            SSTORE(dstate, n, ws.g[n]);
}

/* The reverse walk of one state row over tokens [t0, t1), chunk by chunk from the last (ssmb_chunk's sums).
 * Returns the row's share of d_d. */
INLINE_FN real ssmb_row(ssmb_index ix, ssmb_io io, i64 t0, i64 t1, i64 N, GLOBAL const state_t* h0,
                        GLOBAL state_t* dstate, ssm_saved sv, ssmb_workspace ws, GLOBAL real* ddl, GLOBAL real* db,
                        GLOBAL real* dc, GLOBAL real* da)
{
    real dd = (real)0;
    ssmb_row_start(ix, io, t0, t1, N, h0, dstate, sv, ws);
    for (i64 k = (t1 - t0 + SSMB_Q - 1) / SSMB_Q - 1; k >= 0; --k)
        dd = ssmb_chunk(ix, io, k, t0, t1, N, ws, ddl, db, dc, da, dd);
    ssmb_row_end(N, dstate, ws);
    return dd;
}

/* The delta (dt) gradients of one channel (head) over tokens [t0, t1), from the sums ddl of the
 * gradient with respect to the transformed delta: back through the clamp (passing at its bounds), the
 * softplus (the identity above 20) and the bias. Returns their sum, the row's share of the bias's
 * gradient. */
INLINE_FN real ssmb_delta_grads(i64 t0, i64 t1, i64 ds, i64 dof, real bias, real lo, real hi,
                                GLOBAL const store_t* delta, GLOBAL const real* ddl, GLOBAL store_t* ddelta)
{
    real sum = (real)0;
    for (i64 tok = t0; tok < t1; ++tok) {
        const i64 di = tok * ds + dof;
        const real grad = ssm_delta_grad(LOAD(delta, di), ddl[di], bias, lo, hi);
        STORE(ddelta, di, grad);
        sum += grad;
    }
    return sum;
}

/* Zeroes n reals at p. */
INLINE_FN void ssmb_clear(GLOBAL real* p, i64 n)
{
    for (i64 i = 0; i < n; ++i)
        p[i] = (real)0;
}

/* Zeroes this item's partials of d_b and d_c (the group's entries of tokens [t0, t1)) and the delta
 * gradient sums of the channels (heads) [l0, l1) over those tokens (lanes per token: L). */
INLINE_FN void ssmb_clear_sums(i64 t0, i64 t1, i64 bs, i64 bo, i64 N, i64 L, i64 l0, i64 l1, GLOBAL real* db,
                               GLOBAL real* dc, GLOBAL real* ddl)
{
    for (i64 tok = t0; tok < t1; ++tok) {
        ssmb_clear(db + tok * bs + bo, N);
        ssmb_clear(dc + tok * bs + bo, N);
        ssmb_clear(ddl + tok * L + l0, l1 - l0);
    }
}

/* One work-item's share: its row r (tokens [t0, t1), state entry slot), group grp, block blk of the
 * group's channels (heads) [j0, j1) counted inside the group of `width`, and its scratch: workspace,
 * delta-gradient sums, the block's partials of d_b and d_c. */
typedef struct {
    i64 r, grp, blk, t0, t1, slot, width, j0, j1;
    ssmb_workspace ws;
    GLOBAL real* ddl;
    GLOBAL real* db;
    GLOBAL real* dc;
} ssmb_item;

/* Item `item`'s share (block fastest) of L channels (heads) in G groups, with its sums zeroed. The
 * remainders by multiplication, not `%`: a division and a remainder of the same operands become a
 * `freeze` instruction in the compiler that Oclgrind's uninitialized-value checker cannot interpret. */
INLINE_FN ssmb_item ssmb_item_of(i64 item, i64 blocks, i64 per, i64 G, i64 L, i64 N, i64 S, i64 T,
                                 GLOBAL const int* cu, GLOBAL const int* slots, GLOBAL uchar* scb, i64 wso, i64 ddlo,
                                 i64 dbo, i64 dco, int decays, i64 rows)
{
    ssmb_item at;
    at.r = item / (blocks * G);
    const i64 rest = item - at.r * blocks * G;
    at.grp = rest / blocks;
    at.blk = rest - at.grp * blocks;
    at.t0 = ssm_first(at.r, S, cu);
    at.t1 = ssm_end(at.r, S, cu);
    at.slot = ssm_slot(at.r, slots);
    at.width = L / G;
    at.j0 = at.blk * per;
    at.j1 = at.j0 + per < at.width ? at.j0 + per : at.width;
    at.ws = ssmb_workspace_of(AT(real, scb, wso), item, S, N, decays, rows);
    at.ddl = AT(real, scb, ddlo);
    at.db = AT(real, scb, dbo) + at.blk * T * G * N;
    at.dc = AT(real, scb, dco) + at.blk * T * G * N;
    ssmb_clear_sums(at.t0, at.t1, G * N, at.grp * N, N, L, at.grp * at.width + at.j0, at.grp * at.width + at.j1, at.db,
                    at.dc, at.ddl);
    return at;
}

/* Channel (head) j of an item's group: its index c among the L, its per-row partials' index, its bias
 * and d, and its d_a partial (N reals). */
typedef struct {
    i64 c, lane;
    real bias, dv;
    GLOBAL real* da;
} ssmb_lane;

INLINE_FN ssmb_lane ssmb_lane_of(ssmb_item at, i64 j, i64 L, i64 N, GLOBAL uchar* biasb, i64 biaso, GLOBAL uchar* skb,
                                 i64 sko, GLOBAL uchar* scb, i64 pao)
{
    ssmb_lane ln;
    ln.c = at.grp * at.width + j;
    ln.lane = at.r * L + ln.c;
    ln.bias = ssm_param(AT(param_t, biasb, biaso), ln.c, SSM_BIAS);
    ln.dv = ssm_param(AT(param_t, skb, sko), ln.c, SSM_D);
    ln.da = AT(real, scb, pao) + ln.lane * N;
    return ln;
}

/* The tensors of lane ln's state rows, a its a row (selective_scan) or head's a (mamba2). */
INLINE_FN ssmb_io ssmb_io_of(GLOBAL const param_t* a, ssmb_lane ln, real lo, real hi, GLOBAL uchar* xb, i64 xo,
                             GLOBAL uchar* deb, i64 deo, GLOBAL uchar* bb, i64 bo, GLOBAL uchar* cb, i64 co,
                             GLOBAL uchar* zb, i64 zo, GLOBAL uchar* gb, i64 go, GLOBAL uchar* dxb, i64 dxo,
                             GLOBAL uchar* dzb, i64 dzo)
{
    ssmb_io io;
    io.a = a; io.bias = ln.bias; io.dv = ln.dv; io.lo = lo; io.hi = hi;
    io.x = AT(store_t, xb, xo); io.delta = AT(store_t, deb, deo); io.bm = AT(store_t, bb, bo);
    io.cm = AT(store_t, cb, co); io.z = AT(store_t, zb, zo); io.gout = AT(store_t, gb, go);
    io.dx = AT(store_t, dxb, dxo); io.dz = AT(store_t, dzb, dzo);
    return io;
}

/* Mamba-1 backward: item = (row r, group grp, block blk of `per` channels of the group). T: tokens of
 * the arena (batch * seq). Scratch (reals, at the offsets given): the items' workspaces; ddl [T][H];
 * the d_b and d_c partials [blocks][T][G][N]; the per-row partials of d_a [R][H][N], d_d and the
 * delta bias's gradient [R][H]. */
KERNEL selective_scan_backward(i64 R, i64 S, i64 T, i64 H, i64 N, i64 G, i64 blocks, i64 per,
                               GLOBAL uchar* xb, i64 xo, GLOBAL uchar* deb, i64 deo, GLOBAL uchar* ab, i64 ao,
                               GLOBAL uchar* bb, i64 bo, GLOBAL uchar* cb, i64 co, GLOBAL uchar* biasb, i64 biaso,
                               GLOBAL uchar* skb, i64 sko, GLOBAL uchar* zb, i64 zo, GLOBAL uchar* stb, i64 sto,
                               GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo, GLOBAL uchar* gb, i64 go,
                               GLOBAL uchar* dxb, i64 dxo, GLOBAL uchar* ddeb, i64 ddeo, GLOBAL uchar* dzb, i64 dzo,
                               GLOBAL uchar* dstb, i64 dsto, GLOBAL uchar* scb, i64 wso, i64 ddlo, i64 dbo, i64 dco,
                               i64 pao, i64 pdo, i64 pbo, GLOBAL uchar* rsb, i64 rso, i64 RQ)
{
    const i64 item = GID(0);
    if (item >= R * G * blocks)
        return;
    const ssmb_item at = ssmb_item_of(item, blocks, per, G, H, N, S, T, AT(int, cub, cuo), AT(int, slb, slo), scb, wso,
                                      ddlo, dbo, dco, SSMB_KEEP_DECAYS, SSMB_ROWS_TOGETHER ? per : 1);
    GLOBAL real* pd = AT(real, scb, pdo);
    for (i64 j = at.j0; j < at.j1; ++j) {
        const ssmb_lane ln = ssmb_lane_of(at, j, H, N, biasb, biaso, skb, sko, scb, pao);
        ssmb_clear(ln.da, N);
        pd[ln.lane] = (real)0;
    }
    /* with SSMB_ROWS_TOGETHER the block's channels chunk by chunk (each chunk's in j order), else one by one */
    const i64 chunks = (at.t1 - at.t0 + SSMB_Q - 1) / SSMB_Q, last = chunks > 0 ? chunks - 1 : 0; /* an empty row: 0 */
    for (i64 k = SSMB_ROWS_TOGETHER ? last : 0; k >= 0; --k)
        for (i64 j = at.j0; j < at.j1; ++j) {
            const ssmb_lane ln = ssmb_lane_of(at, j, H, N, biasb, biaso, skb, sko, scb, pao);
            ssmb_index ix;
            ix.xs = H; ix.xo = ln.c; ix.ds = H; ix.dof = ln.c; ix.bs = G * N; ix.bo = at.grp * N; ix.an = 1;
            const ssmb_io io = ssmb_io_of(AT(param_t, ab, ao) + ln.c * N, ln, (real)0, (real)0, xb, xo, deb, deo, bb,
                                          bo, cb, co, zb, zo, gb, go, dxb, dxo, dzb, dzo);
            const i64 entry = (at.slot * H + ln.c) * N;
            GLOBAL state_t* dstate = AT(state_t, dstb, dsto) + entry;
            const ssmb_workspace ws = ssmb_workspace_row(at.ws, SSMB_ROWS_TOGETHER ? j - at.j0 : 0, S, N);
            if (SSMB_ROWS_TOGETHER && k == last)
                ssmb_row_start(ix, io, at.t0, at.t1, N, AT(state_t, stb, sto) + entry, dstate,
                               ssm_saved_of(rsb, rso, at.r, S, RQ, H, ln.c, N), ws);
            if (SSMB_ROWS_TOGETHER)
                pd[ln.lane] = ssmb_chunk(ix, io, k, at.t0, at.t1, N, ws, at.ddl, at.db, at.dc, ln.da, pd[ln.lane]);
            else
                pd[ln.lane] = ssmb_row(ix, io, at.t0, at.t1, N, AT(state_t, stb, sto) + entry, dstate,
                                       ssm_saved_of(rsb, rso, at.r, S, RQ, H, ln.c, N), ws, at.ddl, at.db, at.dc,
                                       ln.da);
            if (k > 0)
                continue;
            if (SSMB_ROWS_TOGETHER)
                ssmb_row_end(N, dstate, ws);
            AT(real, scb, pbo)[ln.lane] = ssmb_delta_grads(at.t0, at.t1, H, ln.c, ln.bias, (real)0, (real)0,
                                                           AT(store_t, deb, deo), at.ddl, AT(store_t, ddeb, ddeo));
        }
}

/* Mamba-2 backward: item = (row r, group grp, block blk of `per` heads of the group); a head's P state
 * rows are walked one after the other, or with SSMB_ROWS_TOGETHER together chunk by chunk (each chunk's rows in
 * p order, so that the chunk's b, c and their partials stay in cache), so its dt gradient, d_b and d_c sum over
 * p in that order. Scratch as
 * selective_scan_backward's with heads for channels (with SSMB_ROWS_TOGETHER a workspace of P rows per item):
 * ddl [T][HD]; d_a's partials [R][HD][N] (summed over n too); d_d's and the dt bias's [R][HD]. */
KERNEL mamba2_backward(i64 R, i64 S, i64 T, i64 HD, i64 P, i64 N, i64 G, i64 blocks, i64 per,
                       GLOBAL uchar* xb, i64 xo, GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* ab, i64 ao,
                       GLOBAL uchar* bb, i64 bo, GLOBAL uchar* cb, i64 co, GLOBAL uchar* biasb, i64 biaso,
                       GLOBAL uchar* skb, i64 sko, GLOBAL uchar* zb, i64 zo, GLOBAL uchar* stb, i64 sto,
                       GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo, GLOBAL uchar* gb, i64 go,
                       GLOBAL uchar* dxb, i64 dxo, GLOBAL uchar* ddtb, i64 ddto, GLOBAL uchar* dzb, i64 dzo,
                       GLOBAL uchar* dstb, i64 dsto, GLOBAL uchar* scb, i64 wso, i64 ddlo, i64 dbo, i64 dco,
                       i64 pao, i64 pdo, i64 pbo, real lo, real hi, GLOBAL uchar* rsb, i64 rso, i64 RQ)
{
    const i64 item = GID(0);
    if (item >= R * G * blocks)
        return;
    const ssmb_item at = ssmb_item_of(item, blocks, per, G, HD, N, S, T, AT(int, cub, cuo), AT(int, slb, slo), scb, wso,
                                      ddlo, dbo, dco, 0, SSMB_ROWS_TOGETHER ? P : 1);
    for (i64 j = at.j0; j < at.j1; ++j) {
        const ssmb_lane ln = ssmb_lane_of(at, j, HD, N, biasb, biaso, skb, sko, scb, pao);
        ssmb_clear(ln.da, N);
        const ssmb_io io = ssmb_io_of(AT(param_t, ab, ao) + ln.c, ln, lo, hi, xb, xo, dtb, dto, bb, bo, cb, co, zb, zo,
                                      gb, go, dxb, dxo, dzb, dzo);
        ssmb_index ix;
        ix.xs = HD * P; ix.ds = HD; ix.dof = ln.c; ix.bs = G * N; ix.bo = at.grp * N; ix.an = 0;
        GLOBAL const state_t* h0 = AT(state_t, stb, sto) + (at.slot * HD + ln.c) * P * N;
        GLOBAL state_t* dstate = AT(state_t, dstb, dsto) + (at.slot * HD + ln.c) * P * N;
        real dd = (real)0;
#if SSMB_ROWS_TOGETHER
        for (i64 p = 0; p < P; ++p) {
            ix.xo = ln.c * P + p;
            ssmb_row_start(ix, io, at.t0, at.t1, N, h0 + p * N, dstate + p * N,
                           ssm_saved_of(rsb, rso, at.r, S, RQ, HD * P, ln.c * P + p, N),
                           ssmb_workspace_row(at.ws, p, S, N));
        }
        for (i64 k = (at.t1 - at.t0 + SSMB_Q - 1) / SSMB_Q - 1; k >= 0; --k)
            for (i64 p = 0; p < P; ++p) {
                ix.xo = ln.c * P + p;
                dd = ssmb_chunk(ix, io, k, at.t0, at.t1, N, ssmb_workspace_row(at.ws, p, S, N), at.ddl, at.db, at.dc,
                                ln.da, dd);
            }
        for (i64 p = 0; p < P; ++p)
            ssmb_row_end(N, dstate + p * N, ssmb_workspace_row(at.ws, p, S, N));
#else
        for (i64 p = 0; p < P; ++p) {
            ix.xo = ln.c * P + p;
            dd += ssmb_row(ix, io, at.t0, at.t1, N, h0 + p * N, dstate + p * N,
                           ssm_saved_of(rsb, rso, at.r, S, RQ, HD * P, ln.c * P + p, N), at.ws, at.ddl, at.db, at.dc,
                           ln.da);
        }
#endif
        AT(real, scb, pdo)[ln.lane] = dd;
        AT(real, scb, pbo)[ln.lane] = ssmb_delta_grads(at.t0, at.t1, HD, ln.c, ln.bias, lo, hi, AT(store_t, dtb, dto),
                                                       at.ddl, AT(store_t, ddtb, ddto));
    }
}

/* out[i] = sum over k < K, j < J of part[(k*M + i)*J + j], in that order, for i < M: the partials of
 * one gradient summed over items (rows, blocks) and, for mamba2's d_a, over n. Stored in the parameter
 * type when as_param (d_a, d_d, the ln.bias's gradient), else in the thunk's dtype (d_b, d_c). */
KERNEL ssm_backward_reduce(i64 M, i64 K, i64 J, GLOBAL uchar* pb, i64 po, GLOBAL uchar* ob, i64 oo, int as_param)
{
    const i64 i = GID(0);
    if (i >= M)
        return;
    GLOBAL const real* part = AT(real, pb, po);
    real sum = (real)0;
    for (i64 k = 0; k < K; ++k)
        for (i64 j = 0; j < J; ++j)
            sum += part[(k * M + i) * J + j];
    if (as_param)
        PSTORE(AT(param_t, ob, oo), i, sum);
    else
        STORE(AT(store_t, ob, oo), i, sum);
}

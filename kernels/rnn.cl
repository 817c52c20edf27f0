/* Recurrent family (ABI.md §3, and §8's fields): the input projection runs first as body.cl's gemm over
 * all timesteps (xw, compute type, bias folded in except GRU's b_hh); these kernels run the recurrence
 * (the cpu target's persistent kernel projects the input itself).
 * Per layer, the directions' blocks are consecutive: xw [dirs][B*S][G*H], w_hh [dirs][G*H][K],
 * b_hh [dirs][G*H], h [dirs][B][K], c [dirs][B][H], where K (the width of h) is lstm's proj_size P
 * with a projection and H otherwise.
 * The cell functions and the compile-time variants (RNN_GATES, RNN_ACT_*, RNN_<field>) are kernels/rnn_cell.cl's,
 * which comes first in the program. */

/* wT[dir][q][g][j] = W[dir][g*H+j][q] in the compute type (j padded to HP with zeros) for a weight of ng*H
 * rows of K (W_hh: ng = G, K = the width of h; W_ih: ng = G, K = the layer's input size; W_hr: ng = 1, H = P,
 * K = hidden), once per layer, so that the step kernels read contiguous runs of units. Rows are
 * ng*HP + RNN_WPAD reals apart: the pad keeps a run's successive rows off one cache set (a 4 KiB stride
 * aliases in L1). */
KERNEL rnn_w_t(int ng, i64 H, i64 HP, i64 K, GLOBAL uchar* wb, i64 wo, GLOBAL uchar* tb, i64 to)
{
    const i64 col = GID(0), dir = GID(2);
    if (col >= ng * HP)
        return;
    const i64 g = col / HP, j = col - g * HP;
    GLOBAL const uchar* w = AT(uchar, wb, wo);
    GLOBAL real* wt = AT(real, tb, to);
    for (i64 q = GID(1); q < K; q += GSIZE(1))  /* rows past grid y (capped at the gpu target) */
        wt[(dir * K + q) * (ng * HP + RNN_WPAD) + col] = j < H ? LOAD(w, (dir * ng * H + g * H + j) * K + q) : (real)0;
}

/* One unit's step (rnn_unit) for batch row b, unit j, from its gate pre-activations, and its stores: the cell
 * (or RNN_LBR0's z) at cst[b*H + j]; the value at aux[b*H + j], or at hout[b*K + j] and as the output element
 * (b*S + tt)*o_rs + o_col + j of out (o_real: out is scratch in the compute type, else arena storage); with
 * RNN_SAVE the step's record into the direction's saved forward sv, mk (rnn_save; B rows). */
INLINE_FN void rnn_unit_out(const real* xz, const real* hz, int phase, i64 b, i64 j, i64 tt, i64 S, i64 H, i64 K,
                            GLOBAL const uchar* peep, const rnn_params* p, GLOBAL const real* hin, GLOBAL real* hout,
                            GLOBAL real* cst, GLOBAL real* aux, GLOBAL uchar* out, int o_real, i64 o_col, i64 o_rs,
                            GLOBAL real* sv, GLOBAL uchar* mk, i64 B)
{
    real pp[3];
    rnn_peepholes(pp, peep, j, H);
    real c = cst[b * H + j];
    rnn_record rec;
    const real v = rnn_unit(xz, hz, RNN_GATES == 4 ? (real)0 : hin[b * K + j], &c, pp, p, phase, &rec);
    cst[b * H + j] = c;
#if RNN_SAVE
    rnn_save(sv, mk, &rec, phase, j < K ? hin[b * K + j] : (real)0, v, b, tt, B, S, H, K, j);
#endif
    if (rnn_to_aux(phase)) {
        aux[b * H + j] = v;
        return;
    }
    hout[b * K + j] = v;
    store_any(out, (b * S + tt) * o_rs + o_col + j, o_real, v);
}

/* The per-step kernel: h_out = cell(xw_t + v . W_hh^T (+ b_hh)) for one timestep, over
 * whT [dirs][K][G*HP + RNN_WPAD] (each gate's row padded to HP, a multiple of RNN_JB, with zeros), where the
 * summed vector v is h (hin), or r * h (aux) in phase 1 of RNN_LBR0. h ping-pongs between hin and hout; rows
 * whose steps have run out (RNN_LENS) are skipped, and since the rows are visited longest first
 * (ord, from rnn_order) whole blocks of them are. Both target shapes share the arguments. */

#ifdef RLX_TARGET_GPU
#if RNN_JB % RNN_GU != 0 || RNN_GK < RNN_RB
#error "rnn gpu tuning: RNN_JB must be a multiple of RNN_GU and RNN_GK at least RNN_RB"
#endif
/* gpu target: item (u, slice)'s share of unit j's recurrent sums for RNN_RB batch rows (rows[r]), gates
 * g0 .. g0+ng-1: acc[r*G + g] = sum over q = slice, slice + RNN_GK, ... < K of v[rows[r]][q] * wT[q][g*HP + j],
 * so a warp reads runs of RNN_GU consecutive whT reals (coalesced) and each weight serves RNN_RB rows. */
INLINE_FN void rnn_gpu_partial_sums(real* acc, const i64* rows, int slice, int g0, int ng, i64 j, i64 K, i64 HP,
                                    GLOBAL const real* wt, GLOBAL const real* v)
{
    PRAGMA_UNROLL
    for (int k = 0; k < RNN_RB * RNN_GATES; ++k)
        acc[k] = (real)0;
    for (i64 q = slice; q < K; q += RNN_GK) {
        GLOBAL const real* wq = wt + q * (RNN_GATES * HP + RNN_WPAD) + j;
        real w[RNN_GATES];
        PRAGMA_UNROLL
        for (int g = 0; g < RNN_GATES; ++g)
            w[g] = g >= g0 && g < g0 + ng ? wq[g * HP] : (real)0;
        PRAGMA_UNROLL
        for (int r = 0; r < RNN_RB; ++r) {
            const real hv = v[rows[r] * K + q];
            PRAGMA_UNROLL
            for (int g = 0; g < RNN_GATES; ++g)
                if (g >= g0 && g < g0 + ng)
                    acc[r * RNN_GATES + g] += hv * w[g];
        }
    }
}

#else
/* cpu target: the per-step kernel's register block by gate count, RNN_STEP_RB batch rows x RNN_STEP_JB
 * consecutive units per item (RNN_STEP_RB * G * RNN_STEP_JB sums: about 12 AVX2 vectors, like the gemm's
 * block). */
#if RNN_GATES == 4
#define RNN_STEP_RB RNN_RB_G4
#define RNN_STEP_JB RNN_JB_G4
#elif RNN_GATES == 3
#define RNN_STEP_RB RNN_RB_G3
#define RNN_STEP_JB RNN_JB_G3
#else
#define RNN_STEP_RB RNN_RB_G1
#define RNN_STEP_JB RNN_JB_G1
#endif
#if RNN_JB % RNN_STEP_JB != 0 || RNN_STEP_RB > RNN_RB_MAX
#error "rnn cpu tuning: RNN_JB must be a multiple of RNN_JB_G<gates> and RNN_RB_MAX at least RNN_RB_G<gates>"
#endif

/* cpu target: acc[(r*G + g)*RNN_JB + u] = (has_bias ? bias[g*H + j0+u] : 0) + sum_{q<K} v_r[q] wT[q][g*HP + j0+u]
 * for nr <= RNN_RB_MAX rows, gates g0 .. g0+ng-1 and nj <= RNN_JB units from j0, where
 * v_r[q] = v[rows[r]*v_rs + v_at + q] (scratch in the compute type, or arena storage: v_real). A rank-1 update
 * per q: a contiguous run of a staged transpose's row (rows wrow reals apart) shared by the nr rows, each row's
 * value broadcast. The loops run to the compile-time maxima with nr, g0, ng and nj as guards, constants at
 * every call: PoCL unrolls the loops before a call's constants reach them (bounded by nr and nj they stayed
 * loops: gru's prefill 1.45x, rnn's 1.9x slower), so literal trip counts unroll, the guards fold once
 * inlined, the sums stay in registers and the runs become vector loads and FMAs. */
INLINE_FN void rnn_rank1_sums(real* acc, int nr, int g0, int ng, int nj, i64 j0, i64 H, i64 HP, i64 wrow,
                              GLOBAL const uchar* bias, int has_bias, GLOBAL const real* wT, i64 K, GLOBAL const uchar* v,
                              const i64* rows, i64 v_rs, i64 v_at, int v_real)
{
    PRAGMA_UNROLL
    for (int r = 0; r < RNN_RB_MAX; ++r)
        PRAGMA_UNROLL
        for (int g = 0; g < RNN_GATES; ++g)
            PRAGMA_UNROLL
            for (int u = 0; u < RNN_JB; ++u)
                if (r < nr && g >= g0 && g < g0 + ng && u < nj)
                    acc[(r * RNN_GATES + g) * RNN_JB + u] = (has_bias && j0 + u < H) ? LOAD(bias, g * H + j0 + u) : (real)0;
    GLOBAL const real* wq = wT + j0;
    for (i64 q = 0; q < K; ++q) {
        real w[RNN_GATES * RNN_JB], vq[RNN_RB_MAX];
        PRAGMA_UNROLL
        for (int g = 0; g < RNN_GATES; ++g)
            PRAGMA_UNROLL
            for (int u = 0; u < RNN_JB; ++u)
                if (g >= g0 && g < g0 + ng && u < nj)
                    w[g * RNN_JB + u] = wq[g * HP + u];
        wq += wrow;
        PRAGMA_UNROLL
        for (int r = 0; r < RNN_RB_MAX; ++r)
            if (r < nr)
                vq[r] = load_any(v, rows[r] * v_rs + v_at + q, v_real);
        PRAGMA_UNROLL
        for (int r = 0; r < RNN_RB_MAX; ++r)
            PRAGMA_UNROLL
            for (int g = 0; g < RNN_GATES; ++g)
                PRAGMA_UNROLL
                for (int u = 0; u < RNN_JB; ++u)
                    if (r < nr && g >= g0 && g < g0 + ng && u < nj)
                        acc[(r * RNN_GATES + g) * RNN_JB + u] += vq[r] * w[g * RNN_JB + u];
    }
}

/* cpu target: m units from j0 of batch row b (the block's row r) at time tt, from their recurrent sums acc
 * (rnn_rank1_sums' layout) and xw, stored as rnn_unit_out stores them. Called with a literal m for a full
 * run of units, so its m cells are straight-line code that vectorizes across units. */
INLINE_FN void rnn_run(const real* acc, int r, int m, int phase, i64 b, i64 j0, i64 tt, i64 S, i64 H, i64 K,
                       GLOBAL const real* xw, GLOBAL const uchar* peep, const rnn_params* p, GLOBAL const real* hin,
                       GLOBAL real* hout, GLOBAL real* cst, GLOBAL real* aux, GLOBAL uchar* out, int o_real, i64 o_col,
                       i64 o_rs, GLOBAL real* sv, GLOBAL uchar* mk, i64 B)
{
    const int g0 = rnn_first_gate(phase), ng = rnn_gate_count(phase);
    GLOBAL const real* xr = xw + (b * S + tt) * RNN_GATES * H + j0;
    GLOBAL real* cr = cst + b * H + j0;
    real hv[RNN_JB];
#if RNN_SAVE /* the cells' records, a private array per field as hv: stores to sv in the cells' loop keep it scalar */
    real ry[RNN_GATES][RNN_JB], ru[RNN_GATES][RNN_JB], rc[4][RNN_JB];
    uchar rp[RNN_GATES][RNN_JB];
#endif
    for (int u = 0; u < m; ++u) {
        real xz[RNN_GATES], hz[RNN_GATES], pp[3];
        PRAGMA_UNROLL
        for (int g = 0; g < RNN_GATES; ++g) {
            xz[g] = xr[g * H + u];
            hz[g] = g >= g0 && g < g0 + ng ? acc[(r * RNN_GATES + g) * RNN_JB + u] : (real)0;
        }
        rnn_peepholes(pp, peep, j0 + u, H);
        real c = cr[u];
        rnn_record rec;
        hv[u] = rnn_unit(xz, hz, RNN_GATES == 4 ? (real)0 : hin[b * K + j0 + u], &c, pp, p, phase, &rec);
        cr[u] = c;
#if RNN_SAVE
        PRAGMA_UNROLL
        for (int g = 0; g < RNN_GATES; ++g) {
            ry[g][u] = rec.y[g];
            ru[g][u] = rec.u[g];
            rp[g][u] = rec.pass[g];
        }
        rc[0][u] = rec.c_prev;
        rc[1][u] = rec.c_new;
        rc[2][u] = rec.hc;
        rc[3][u] = rec.hn;
#endif
    }
#if RNN_SAVE
    for (int u = 0; u < m; ++u) {
        rnn_record rec;
        PRAGMA_UNROLL
        for (int g = 0; g < RNN_GATES; ++g) {
            rec.y[g] = ry[g][u];
            rec.u[g] = ru[g][u];
            rec.pass[g] = rp[g][u];
        }
        rec.c_prev = rc[0][u];
        rec.c_new = rc[1][u];
        rec.hc = rc[2][u];
        rec.hn = rc[3][u];
        rnn_save(sv, mk, &rec, phase, j0 + u < K ? hin[b * K + j0 + u] : (real)0, hv[u], b, tt, B, S, H, K, j0 + u);
    }
#endif
    GLOBAL real* vr = rnn_to_aux(phase) ? aux + b * H + j0 : hout + b * K + j0;
    PRAGMA_UNROLL /* over RNN_JB, not m: a loop of a run-time count cannot unroll (clang warns) */
    for (int u = 0; u < RNN_JB; ++u)
        if (u < m)
            vr[u] = hv[u];
    if (!rnn_to_aux(phase))
        for (int u = 0; u < m; ++u)
            store_any(out, (b * S + tt) * o_rs + o_col + j0 + u, o_real, hv[u]);
}

/* cpu target: the cells of the block's first n rows (rows[r]) and nj units from j0 < H at step t (rnn_run). */
INLINE_FN void rnn_cells(const real* acc, const i64* rows, int n, int nj, i64 j0, i64 t, int back, int phase, i64 S,
                         i64 H, i64 K, GLOBAL const int* lens, GLOBAL const real* xw, GLOBAL const uchar* peep,
                         const rnn_params* p, GLOBAL const real* hin, GLOBAL real* hout, GLOBAL real* cst,
                         GLOBAL real* aux, GLOBAL uchar* out, int o_real, i64 o_col, i64 o_rs, GLOBAL real* sv,
                         GLOBAL uchar* mk, i64 B)
{
    for (int r = 0; r < n; ++r) {
        const i64 b = rows[r], tt = rnn_time(t, back, rnn_len(lens, b, S));
        if (j0 + nj <= H)
            rnn_run(acc, r, nj, phase, b, j0, tt, S, H, K, xw, peep, p, hin, hout, cst, aux, out, o_real, o_col, o_rs,
                    sv, mk, B);
        else
            rnn_run(acc, r, (int)(H - j0), phase, b, j0, tt, S, H, K, xw, peep, p, hin, hout, cst, aux, out, o_real,
                    o_col, o_rs, sv, mk, B);
    }
}
#endif

/* rnn_step: one timestep t of both directions. phase (RNN_LBR0 only): 0 sums r, z over h and stores z (cst)
 * and r * h (aux); 1 sums n over r * h and finishes the step. aux also receives lstm's o * h(c) with RNN_PROJ
 * (rnn_proj then makes h and the output). ord: the rows longest first (RNN_LENS). The last arguments, shared
 * with rnn_persist: seq_lens (int32 [B], arena; RNN_LENS), the layer-direction's peepholes (RNN_PEEP), clip
 * (RNN_CLIP), and alpha, beta of the activation slots f, g, h of direction 0, then of direction 1. */
KERNEL rnn_step(i64 B, i64 S, i64 H, i64 K, i64 t, int reverse, int phase,
                GLOBAL uchar* xwb, i64 xwo, GLOBAL uchar* wtb, i64 wto, GLOBAL uchar* bhb, i64 bho, int has_bhh,
                GLOBAL uchar* hib, i64 hio, GLOBAL uchar* hob, i64 hoo, GLOBAL uchar* cb, i64 co, GLOBAL uchar* ab, i64 ao,
                GLOBAL uchar* ob, i64 oo, int o_real, i64 o_rs, GLOBAL uchar* rb_, i64 ro, GLOBAL uchar* svb, i64 svo,
                GLOBAL uchar* mkb, i64 mko, GLOBAL uchar* lb, i64 lo, GLOBAL uchar* pb, i64 po,
                real clip, real a_f0, real b_f0, real a_g0, real b_g0, real a_h0, real b_h0,
                real a_f1, real b_f1, real a_g1, real b_g1, real a_h1, real b_h1)
{
#ifdef RLX_TARGET_GPU
    LOCAL real part[RNN_GK][RNN_RB][RNN_GATES][RNN_GU];
    const int u = (int)LID(0), slice = (int)LID(1);
    const i64 j = GROUP(0) * RNN_GU + u;  /* j < HP: whT's zero padding covers j >= H */
#else
    const i64 b0 = GID(1) * RNN_STEP_RB, j0 = GID(0) * RNN_STEP_JB;
    if (b0 >= B || j0 >= H)
        return;
#endif
    const i64 dir = GROUP(2), HP = (H + RNN_JB - 1) / RNN_JB * RNN_JB;
    GLOBAL const real* xw = AT(real, xwb, xwo + dir * B * S * RNN_GATES * H * (i64)sizeof(real));
    GLOBAL const real* wt = AT(real, wtb, wto + dir * (RNN_GATES * HP + RNN_WPAD) * K * (i64)sizeof(real));
    GLOBAL const uchar* bhh = AT(uchar, bhb, bho + dir * RNN_GATES * H * (i64)sizeof(store_t));
    GLOBAL const real* hin = AT(real, hib, hio + dir * B * K * (i64)sizeof(real));
    GLOBAL real* hout = AT(real, hob, hoo + dir * B * K * (i64)sizeof(real));
    GLOBAL real* cst = AT(real, cb, co + dir * B * H * (i64)sizeof(real));
    GLOBAL real* aux = AT(real, ab, ao + dir * B * H * (i64)sizeof(real));
    GLOBAL uchar* out = AT(uchar, ob, oo);
    GLOBAL const int* lens = AT(int, lb, lo);
    GLOBAL const int* ord = AT(int, rb_, ro);
    GLOBAL const uchar* peep = AT(uchar, pb, po + dir * 3 * H * (i64)sizeof(store_t));
    GLOBAL real* sv = AT(real, svb, svo) + dir * rnn_saved_block(B * S, H, K);
    GLOBAL uchar* mk = AT(uchar, mkb, mko) + dir * B * S * RNN_GATES * H;
    const rnn_params p = rnn_params_of((int)dir, clip, a_f0, b_f0, a_g0, b_g0, a_h0, b_h0, a_f1, b_f1, a_g1, b_g1, a_h1, b_h1);
    const int back = dir || reverse, g0 = rnn_first_gate(phase), ng = rnn_gate_count(phase);
    GLOBAL const real* v = rnn_sums_aux(phase) ? (GLOBAL const real*)aux : hin;  /* the summed vector, rows of K */
#ifdef RLX_TARGET_GPU
    /* gpu target: a work-group of RNN_GU consecutive units (LID 0) x RNN_GK slices of the reduction
     * (LID 1) for RNN_RB batch rows; the slices' partial sums meet in LOCAL memory, where item (u, r)
     * finishes row r's cell. Row blocks past grid y are strided over by whole work-groups (barriers
     * stay uniform). */
    for (i64 rb = GROUP(1); rb < (B + RNN_RB - 1) / RNN_RB; rb += GSIZE(1) / RNN_GK) {
        i64 rows[RNN_RB];
        const int n = rnn_rows(rows, RNN_RB, rb * RNN_RB, B, t, lens, ord);
        if (n == 0)
            break;  /* the rows run longest first: every later block has finished too (the same for the group) */
        real acc[RNN_RB * RNN_GATES];
        rnn_gpu_partial_sums(acc, rows, slice, g0, ng, j, K, HP, wt, v);
        PRAGMA_UNROLL
        for (int r = 0; r < RNN_RB; ++r)
            PRAGMA_UNROLL
            for (int g = 0; g < RNN_GATES; ++g)
                part[slice][r][g][u] = acc[r * RNN_GATES + g];
        BARRIER();
        if (slice < n && j < H) {
            const i64 b = rnn_row(rb * RNN_RB + slice, ord);  /* rows[slice], by a constant index */
            real xz[RNN_GATES], hz[RNN_GATES];
            PRAGMA_UNROLL
            for (int g = 0; g < RNN_GATES; ++g) {
                real sum = has_bhh ? LOAD(bhh, g * H + j) : (real)0;
                for (int k = 0; k < RNN_GK; ++k)
                    sum += part[k][slice][g][u];
                hz[g] = g >= g0 && g < g0 + ng ? sum : (real)0;
            }
            rnn_input_gates(xz, xw, b * S + rnn_time(t, back, rnn_len(lens, b, S)), j, H);
            rnn_unit_out(xz, hz, phase, b, j, rnn_time(t, back, rnn_len(lens, b, S)), S, H, K, peep, &p, hin, hout,
                         cst, aux, out, o_real, dir * K, o_rs, sv, mk, B);
        }
        BARRIER();  /* part is reused by the next row block */
    }
#else
    /* cpu target: item GID(0) takes RNN_STEP_JB units from j0 for RNN_STEP_RB batch rows from b0 */
    i64 rows[RNN_STEP_RB];
    const int n = rnn_rows(rows, RNN_STEP_RB, b0, B, t, lens, ord);
    if (n == 0)
        return;
    real acc[RNN_STEP_RB * RNN_GATES * RNN_JB];
    rnn_rank1_sums(acc, RNN_STEP_RB, g0, ng, RNN_STEP_JB, j0, H, HP, RNN_GATES * HP + RNN_WPAD, bhh, has_bhh, wt, K,
                   (GLOBAL const uchar*)v, rows, K, 0, 1);
    rnn_cells(acc, rows, n, RNN_STEP_JB, j0, t, back, phase, S, H, K, lens, xw, peep, &p, hin, hout, cst, aux, out,
              o_real, dir * K, o_rs, sv, mk, B);
#endif
}

#if RNN_PROJ
/* lstm's projection of step t (RNN_PROJ): h[b][p] = sum_j m[b][j] W_hr[p][j], m = o * h(c) (aux, rows of H), over
 * whrT [dirs][H][PP + RNN_WPAD] (rnn_w_t of one gate); into hout and the output element. Rows whose steps have
 * run out are left alone. gpu target: item (p, row, dir), a warp reading runs of whrT; cpu target: item
 * (RNN_JB_G1 values of p, RNN_RB_G1 rows in the step kernels' order, dir), rnn_rank1_sums' register block. */
KERNEL rnn_proj(i64 B, i64 S, i64 H, i64 P, i64 t, int reverse, GLOBAL uchar* mb, i64 mo, GLOBAL uchar* wb, i64 wo,
                GLOBAL uchar* hob, i64 hoo, GLOBAL uchar* ob, i64 oo, int o_real, i64 o_rs, GLOBAL uchar* rb_, i64 ro,
                GLOBAL uchar* lb, i64 lo)
{
    const i64 dir = GROUP(2), PP = (P + RNN_JB - 1) / RNN_JB * RNN_JB;
    GLOBAL const int* lens = AT(int, lb, lo);
    GLOBAL const real* m = AT(real, mb, mo + dir * B * H * (i64)sizeof(real));
    GLOBAL const real* w = AT(real, wb, wo + dir * (PP + RNN_WPAD) * H * (i64)sizeof(real));
    GLOBAL real* hout = AT(real, hob, hoo + dir * B * P * (i64)sizeof(real));
    GLOBAL uchar* out = AT(uchar, ob, oo);
#ifdef RLX_TARGET_GPU
    const i64 p = GID(0);
    if (p >= P)
        return;
    for (i64 b = GID(1); b < B; b += GSIZE(1)) {  /* rows past grid y (capped at the gpu target) */
        const i64 len = rnn_len(lens, b, S);
        if (len <= t)
            continue;
        real s = (real)0;
        for (i64 j = 0; j < H; ++j)
            s += m[b * H + j] * w[j * (PP + RNN_WPAD) + p];
        hout[b * P + p] = s;
        store_any(out, (b * S + rnn_time(t, dir || reverse, len)) * o_rs + dir * P + p, o_real, s);
    }
#else
    const i64 p0 = GID(0) * RNN_JB_G1, b0 = GID(1) * RNN_RB_G1;
    if (p0 >= P || b0 >= B)
        return;
    i64 rows[RNN_RB_G1];
    const int n = rnn_rows(rows, RNN_RB_G1, b0, B, t, lens, AT(int, rb_, ro));
    real acc[RNN_RB_MAX * RNN_GATES * RNN_JB];
    rnn_rank1_sums(acc, RNN_RB_G1, 0, 1, RNN_JB_G1, p0, P, PP, PP + RNN_WPAD, mb, 0, w, H, (GLOBAL const uchar*)m, rows,
                   H, 0, 1);
    for (int r = 0; r < n; ++r) {
        const i64 b = rows[r], tt = rnn_time(t, dir || reverse, rnn_len(lens, b, S));
        for (int u = 0; u < RNN_JB_G1 && p0 + u < P; ++u) {
            hout[b * P + p0 + u] = acc[r * RNN_GATES * RNN_JB + u];
            store_any(out, (b * S + tt) * o_rs + dir * P + p0 + u, o_real, acc[r * RNN_GATES * RNN_JB + u]);
        }
    }
#endif
}
#endif

#if RNN_LENS
/* The rows in order of their steps, longest first, ties by row (a counting sort by one item: O(B + S));
 * cnt is S + 1 ints of scratch. */
KERNEL rnn_order(i64 B, i64 S, GLOBAL uchar* lb, i64 lo, GLOBAL uchar* ob, i64 oo, GLOBAL uchar* cb, i64 co)
{
    if (GID(0) != 0)
        return;
    GLOBAL const int* lens = AT(int, lb, lo);
    GLOBAL int* ord = AT(int, ob, oo);
    GLOBAL int* cnt = AT(int, cb, co);
    for (i64 l = 0; l <= S; ++l)
        cnt[l] = 0;
    for (i64 b = 0; b < B; ++b)
        cnt[lens[b]] += 1;
    int at = 0;
    for (i64 l = S; l >= 0; --l) {  /* cnt[l] becomes the first position of length l */
        const int c = cnt[l];
        cnt[l] = at;
        at += c;
    }
    for (i64 b = 0; b < B; ++b)
        ord[cnt[lens[b]]++] = (int)b;
}

/* Zeros in a layer's saved forward (ABI.md §9.1; its first layer-direction block svb, mask mkb) at the steps past
 * each row's length, which no step writes: the ABI leaves them undefined, and zeros keep a reader that sums over
 * every step (the host's) from meeting stale NaNs there. Item (column, row, direction). */
KERNEL rnn_saved_pad(i64 B, i64 S, i64 H, i64 K, GLOBAL uchar* svb, i64 svo, GLOBAL uchar* mkb, i64 mko, GLOBAL uchar* lb,
                     i64 lo)
{
    const i64 c = GID(0), dir = GID(2), N = B * S, GH = RNN_GATES * H;
    if (c >= GH)
        return;
    GLOBAL const int* lens = AT(int, lb, lo);
    GLOBAL real* sv = AT(real, svb, svo) + dir * rnn_saved_block(N, H, K);
    GLOBAL uchar* mk = AT(uchar, mkb, mko) + dir * N * GH;
    for (i64 b = GID(1); b < B; b += GSIZE(1))
        for (i64 t = lens[b]; t < S; ++t) {
            for (int a = RNN_SV_Y; rnn_saved_at(a, N, H, K) < rnn_saved_block(N, H, K); ++a) {
                const i64 width = (rnn_saved_at(a + 1, N, H, K) - rnn_saved_at(a, N, H, K)) / N;
                if (c < width)
                    sv[rnn_saved_at(a, N, H, K) + (t * B + b) * width + c] = (real)0;
            }
            mk[(t * B + b) * GH + c] = 0;
        }
}

/* Zeros of a layer's output (rows of W = o_rs) at the steps past each row's length. */
KERNEL rnn_pad(i64 B, i64 S, i64 W, GLOBAL uchar* ob, i64 oo, int o_real, GLOBAL uchar* lb, i64 lo)
{
    const i64 col = GID(0);
    if (col >= W)
        return;
    GLOBAL const int* lens = AT(int, lb, lo);
    for (i64 b = GID(2); b < B; b += GSIZE(2))
        for (i64 t = GID(1) + lens[b]; t < S; t += GSIZE(1))
            store_any(AT(uchar, ob, oo), (b * S + t) * W + col, o_real, (real)0);
}
#endif

/* Initial state of one layer: h0 (nh values) and c0 (nc) slices (storage) into scratch (compute type), or zeros. */
KERNEL rnn_state_in(int carry, i64 nh, i64 nc, GLOBAL uchar* h0b, i64 h0o, GLOBAL uchar* c0b, i64 c0o,
                    GLOBAL uchar* hb, i64 ho, GLOBAL uchar* cb, i64 co)
{
    rnn_state_into(GID(0), carry, nh, nc, AT(uchar, h0b, h0o), AT(uchar, c0b, c0o), AT(real, hb, ho), AT(real, cb, co));
}

/* Final state of one layer back into h0/c0 in place: a row's h is in hb1 after an odd number of steps (its
 * length with RNN_LENS, else S), else in hb0. */
KERNEL rnn_state_out(i64 nh, i64 nc, i64 B, i64 S, i64 K, GLOBAL uchar* hb0, i64 ho0, GLOBAL uchar* hb1, i64 ho1,
                     GLOBAL uchar* cb, i64 co, GLOBAL uchar* h0b, i64 h0o, GLOBAL uchar* c0b, i64 c0o,
                     GLOBAL uchar* lb, i64 lo)
{
    const i64 i = GID(0);
    if (i < nh) {
        const i64 steps = rnn_len(AT(int, lb, lo), (i / K) % B, S);
        STORE(AT(uchar, h0b, h0o), i, (steps % 2 ? AT(real, hb1, ho1) : AT(real, hb0, ho0))[i]);
    }
    if (RNN_HAS_CELL && i < nc)
        STORE(AT(uchar, c0b, c0o), i, AT(real, cb, co)[i]);
}

/* Rows of w reals (compute type) from the batch-major order [B][S] to the time-major [S][B] (to_time), or back,
 * for `batch` blocks s_bs and d_bs reals apart; zeros at the steps past a row's length (RNN_LENS): a layer's
 * output into the saved forward (ABI.md §9.1), and the saved forward's arrays into the backward's batch-major
 * operands (where the saved forward holds no defined value). Item (column, row, block). */
KERNEL rnn_reorder(i64 B, i64 S, i64 w, int to_time, i64 batch, GLOBAL uchar* sb, i64 so, i64 s_bs, GLOBAL uchar* db,
                   i64 dbo, i64 d_bs, GLOBAL uchar* lb, i64 lo)
{
    const i64 c = GID(0);
    if (c >= w)
        return;
    GLOBAL const real* src = AT(real, sb, so);
    GLOBAL real* dst = AT(real, db, dbo);
    for (i64 z = GID(2); z < batch; z += GSIZE(2))
        for (i64 b = GID(1); b < B; b += GSIZE(1)) {
            const i64 len = rnn_len(AT(int, lb, lo), b, S);
            for (i64 t = 0; t < S; ++t) {
                const i64 bm = (b * S + t) * w + c, tm = (t * B + b) * w + c;
                dst[z * d_bs + (to_time ? tm : bm)] = t < len ? src[z * s_bs + (to_time ? bm : tm)] : (real)0;
            }
        }
}

/* The whole sequence of one layer in one launch; state moves in from / out to h0, c0 when carrying. */
#ifdef RLX_TARGET_GPU
#if !RNN_PROJ && !RNN_LBR0 /* fields that need every unit of a step before the next phase: per step only */
/* gpu target: one work-group of H items per (batch row, direction) keeps h in local memory; item j
 * computes unit j's hz[g] = b_hh[g*H + j] + sum_q W_hh[g*H + j][q] h[q] straight from W_hh. */
KERNEL rnn_persist(i64 B, i64 S, i64 H, int carry, int reverse,
                   GLOBAL uchar* xwb, i64 xwo, GLOBAL uchar* whb, i64 who, GLOBAL uchar* bhb, i64 bho, int has_bhh,
                   GLOBAL uchar* h0b, i64 h0o, GLOBAL uchar* c0b, i64 c0o,
                   GLOBAL uchar* ob, i64 oo, int o_real, i64 o_rs, GLOBAL uchar* svb, i64 svo, GLOBAL uchar* mkb, i64 mko,
                   GLOBAL uchar* lb, i64 lo, GLOBAL uchar* pb, i64 po,
                real clip, real a_f0, real b_f0, real a_g0, real b_g0, real a_h0, real b_h0,
                real a_f1, real b_f1, real a_g1, real b_g1, real a_h1, real b_h1)
{
    const i64 j = LID(0), b = GROUP(1), dir = GROUP(2);
    GLOBAL const real* xw = AT(real, xwb, xwo + dir * B * S * RNN_GATES * H * (i64)sizeof(real));
    GLOBAL const uchar* whh = AT(uchar, whb, who + dir * RNN_GATES * H * H * (i64)sizeof(store_t));
    GLOBAL const uchar* bhh = AT(uchar, bhb, bho + dir * RNN_GATES * H * (i64)sizeof(store_t));
    GLOBAL uchar* h0 = AT(uchar, h0b, h0o + (dir * B + b) * H * (i64)sizeof(store_t));
    GLOBAL uchar* c0 = AT(uchar, c0b, c0o + (dir * B + b) * H * (i64)sizeof(store_t));
    GLOBAL uchar* out = AT(uchar, ob, oo);
    GLOBAL const uchar* peep = AT(uchar, pb, po + dir * 3 * H * (i64)sizeof(store_t));
    GLOBAL real* sv = AT(real, svb, svo) + dir * rnn_saved_block(B * S, H, H);
    GLOBAL uchar* mk = AT(uchar, mkb, mko) + dir * B * S * RNN_GATES * H;
    const rnn_params p = rnn_params_of((int)dir, clip, a_f0, b_f0, a_g0, b_g0, a_h0, b_h0, a_f1, b_f1, a_g1, b_g1, a_h1, b_h1);
    const i64 steps = rnn_len(AT(int, lb, lo), b, S);
    LOCAL real hs[RNN_PERSIST_MAX];
    real h = carry ? LOAD(h0, j) : (real)0;
    real c = (carry && RNN_HAS_CELL) ? LOAD(c0, j) : (real)0;
    real pp[3];
    rnn_peepholes(pp, peep, j, H);
    hs[j] = h;
    BARRIER();
    for (i64 t = 0; t < steps; ++t) {  /* steps is the same for the whole group */
        const i64 tt = rnn_time(t, dir || reverse, steps);
        real xz[RNN_GATES], hz[RNN_GATES];
        rnn_input_gates(xz, xw, b * S + tt, j, H);
        for (int g = 0; g < RNN_GATES; ++g) {
            GLOBAL const uchar* wrow = whh + ((i64)g * H + j) * H * (i64)sizeof(store_t);
            real s = has_bhh ? LOAD(bhh, g * H + j) : (real)0;
            for (i64 q = 0; q < H; ++q)
                s += LOAD(wrow, q) * hs[q];
            hz[g] = s;
        }
        rnn_record rec;
#if RNN_SAVE
        const real h_prev = h;
#endif
        h = rnn_unit(xz, hz, h, &c, pp, &p, 0, &rec);
#if RNN_SAVE
        rnn_save(sv, mk, &rec, 0, h_prev, h, b, tt, B, S, H, H, j);
#endif
        BARRIER();
        hs[j] = h;
        store_any(out, (b * S + tt) * o_rs + dir * H + j, o_real, h);
        BARRIER();
    }
    if (carry) {
        STORE(h0, j, h);
        if (RNN_HAS_CELL)
            STORE(c0, j, c);
    }
}
#endif
#else
/* cpu target: one work-item (a work-group of one) per (batch row, direction) runs every step of that row,
 * the input projection included: per step and run of RNN_JB units, xw of the run (bias + x . W_ih^T over
 * wiT [dirs][I][G*HP + RNN_WPAD], staged like W_hh^T by rnn_w_t) then the recurrence, h ping-ponging
 * between the row's h in hb0 and hb1 and c in cst (scratch, compute type); RNN_LBR0 makes a second pass of
 * the runs per step (n over r * h), RNN_PROJ a pass over runs of P (h = W_hr m over whrT [dirs][H][PP +
 * RNN_WPAD]). So a layer is one launch and a decode step needs no gemm. A single item needs no barrier, which
 * keeps PoCL's code register-blocked (measured: a work-group of items over the units with a barrier per step
 * ran 1.3-2x slower), and the rows, which share nothing, run on as many cores as there are. Arguments as
 * rnn_step's, without the step index, plus carry, h0, c0, the input x (arena storage or compute-type scratch:
 * x_real; rows of I), wiT and the input bias, and whrT. */
KERNEL rnn_persist(i64 B, i64 S, i64 H, i64 K, int carry, int reverse,
                   GLOBAL uchar* xwb, i64 xwo, GLOBAL uchar* wtb, i64 wto, GLOBAL uchar* bhb, i64 bho, int has_bhh,
                   GLOBAL uchar* h0b, i64 h0o, GLOBAL uchar* c0b, i64 c0o,
                   GLOBAL uchar* hb0, i64 ho0, GLOBAL uchar* hb1, i64 ho1, GLOBAL uchar* cb, i64 co, GLOBAL uchar* ab, i64 ao,
                   i64 I, GLOBAL uchar* xb, i64 xo, int x_real, GLOBAL uchar* wib, i64 wio,
                   GLOBAL uchar* bib, i64 bio, GLOBAL uchar* wrb, i64 wro,
                   GLOBAL uchar* ob, i64 oo, int o_real, i64 o_rs, GLOBAL uchar* svb, i64 svo, GLOBAL uchar* mkb, i64 mko,
                   GLOBAL uchar* lb, i64 lo, GLOBAL uchar* pb, i64 po,
                real clip, real a_f0, real b_f0, real a_g0, real b_g0, real a_h0, real b_h0,
                real a_f1, real b_f1, real a_g1, real b_g1, real a_h1, real b_h1)
{
    const i64 b0 = GROUP(1), dir = GROUP(2), HP = (H + RNN_JB - 1) / RNN_JB * RNN_JB;
    const i64 rows[1] = {b0};
    GLOBAL real* xw = AT(real, xwb, xwo + dir * B * S * RNN_GATES * H * (i64)sizeof(real)); /* written, then read */
    GLOBAL const real* wt = AT(real, wtb, wto + dir * (RNN_GATES * HP + RNN_WPAD) * K * (i64)sizeof(real));
    GLOBAL const uchar* bhh = AT(uchar, bhb, bho + dir * RNN_GATES * H * (i64)sizeof(store_t));
    GLOBAL uchar* h0 = AT(uchar, h0b, h0o + dir * B * K * (i64)sizeof(store_t));
    GLOBAL uchar* c0 = AT(uchar, c0b, c0o + dir * B * H * (i64)sizeof(store_t));
    GLOBAL real* hs0 = AT(real, hb0, ho0 + dir * B * K * (i64)sizeof(real));
    GLOBAL real* hs1 = AT(real, hb1, ho1 + dir * B * K * (i64)sizeof(real));
    GLOBAL real* cst = AT(real, cb, co + dir * B * H * (i64)sizeof(real));
    GLOBAL real* aux = AT(real, ab, ao + dir * B * H * (i64)sizeof(real));
    GLOBAL uchar* out = AT(uchar, ob, oo);
    GLOBAL const uchar* x = AT(uchar, xb, xo);
    GLOBAL const real* wi = AT(real, wib, wio + dir * (RNN_GATES * HP + RNN_WPAD) * I * (i64)sizeof(real));
    GLOBAL const uchar* bias = AT(uchar, bib, bio + dir * RNN_GATES * H * (i64)sizeof(store_t));
    GLOBAL const int* lens = AT(int, lb, lo);
    GLOBAL const uchar* peep = AT(uchar, pb, po + dir * 3 * H * (i64)sizeof(store_t));
    GLOBAL real* sv = AT(real, svb, svo) + dir * rnn_saved_block(B * S, H, K);
    GLOBAL uchar* mk = AT(uchar, mkb, mko) + dir * B * S * RNN_GATES * H;
    const rnn_params p = rnn_params_of((int)dir, clip, a_f0, b_f0, a_g0, b_g0, a_h0, b_h0, a_f1, b_f1, a_g1, b_g1, a_h1, b_h1);
    const i64 steps = rnn_len(lens, b0, S);
    const int back = dir || reverse;
    for (i64 i = b0 * K; i < (b0 + 1) * K; ++i)
        hs0[i] = carry ? LOAD(h0, i) : (real)0;
    for (i64 i = b0 * H; i < (b0 + 1) * H; ++i)
        cst[i] = carry && RNN_HAS_CELL ? LOAD(c0, i) : (real)0;
    for (i64 t = 0; t < steps; ++t) {
        const i64 tt = rnn_time(t, back, steps);
        GLOBAL const real* hin = t % 2 ? hs1 : hs0;
        GLOBAL real* hout = t % 2 ? hs0 : hs1;
        for (int phase = 0; phase <= RNN_LBR0; ++phase) {
            const int g0 = rnn_first_gate(phase), ng = rnn_gate_count(phase);
            GLOBAL const uchar* v = (GLOBAL const uchar*)(rnn_sums_aux(phase) ? (GLOBAL const real*)aux : hin);
            for (i64 j0 = 0; j0 < H; j0 += RNN_JB) {
                real acc[RNN_GATES * RNN_JB];
                if (phase == 0) {
                    rnn_rank1_sums(acc, 1, 0, RNN_GATES, RNN_JB, j0, H, HP, RNN_GATES * HP + RNN_WPAD, bias, 1, wi, I, x,
                                   rows, S * I, tt * I, x_real);
                    for (int g = 0; g < RNN_GATES; ++g)
                        for (int u = 0; u < RNN_JB && j0 + u < H; ++u)
                            xw[(b0 * S + tt) * RNN_GATES * H + g * H + j0 + u] = acc[g * RNN_JB + u];
                }
                rnn_rank1_sums(acc, 1, g0, ng, RNN_JB, j0, H, HP, RNN_GATES * HP + RNN_WPAD, bhh, has_bhh, wt, K, v, rows,
                               K, 0, 1);
                rnn_cells(acc, rows, 1, RNN_JB, j0, t, back, phase, S, H, K, lens, xw, peep, &p, hin, hout, cst, aux, out,
                          o_real, dir * K, o_rs, sv, mk, B);
            }
        }
#if RNN_PROJ
        const i64 PP = (K + RNN_JB - 1) / RNN_JB * RNN_JB;
        GLOBAL const real* whr = AT(real, wrb, wro + dir * (PP + RNN_WPAD) * H * (i64)sizeof(real));
        for (i64 p0 = 0; p0 < K; p0 += RNN_JB) {
            real acc[RNN_GATES * RNN_JB];
            rnn_rank1_sums(acc, 1, 0, 1, RNN_JB, p0, K, PP, PP + RNN_WPAD, bias, 0, whr, H, (GLOBAL const uchar*)aux,
                           rows, H, 0, 1);
            for (int u = 0; u < RNN_JB && p0 + u < K; ++u) {
                hout[b0 * K + p0 + u] = acc[u];
                store_any(out, (b0 * S + tt) * o_rs + dir * K + p0 + u, o_real, acc[u]);
            }
        }
#endif
    }
    if (carry) {
        for (i64 i = b0 * K; i < (b0 + 1) * K; ++i)
            STORE(h0, i, steps % 2 ? hs1[i] : hs0[i]);
        if (RNN_HAS_CELL)
            for (i64 i = b0 * H; i < (b0 + 1) * H; ++i)
                STORE(c0, i, cst[i]);
    }
}
#endif

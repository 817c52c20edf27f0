/* Backward of the recurrent family (ABI.md §9 for lstm, gru, rnn), after kernels/rnn_cell.cl in its program:
 * the forward's compile-time variants (RNN_GATES, RNN_ACT_*, RNN_LENS, RNN_CLIP, RNN_PEEP, RNN_IFG, RNN_PROJ,
 * RNN_LBR0) and cell functions (activations, clip, seq_lens, peepholes), so the forward it recomputes applies
 * the forward's own activations and clamps.
 *
 * Per layer, bottom up, the forward runs again a step at a time and keeps what the reverse pass reads (all
 * scratch in the compute type, row = b*S + tt as the forward's xw, every per-direction tensor [D][B*S][width]):
 * u (the gate pre-activations, written over the input projection xw they start from), hp (the h entering each
 * step, width K), lstm's cp / cn (the cell entering and leaving each step) and raw (o * h(c) before a
 * projection), gru's hn (W_hn h + b_hn, or r * h without linear_before_reset), and the layer's output o
 * [B*S][D*K] (the input of the layer above). Then, top layer first, the reverse walk: a step computes the
 * gradients of the gate pre-activations, dz [B*S][D*G*H] (gru's hidden side apart: dzh), and from them the
 * gradient of the state entering the step (dh, dc per [D][B][width]); every weight, bias and input gradient is
 * then a sum over the whole sequence (body.cl's gemm, rnnb_colsum). The reverse walk of a layer is one launch,
 * rnnb_reverse_walk, or (rnn_kernel "step") a launch per step. Each step's recurrent product of the forward (and
 * of the per-step reverse) is one launch over compact per-step operands [D][B][width] that the step kernels write
 * beside the kept rows: the forward's h (hs) into the sums rec = h W_hh^T + b_hh [D][B][G*H] that the next step
 * reads, the reverse's dzh (dzc) into dh = dzc W_hh. Every sum runs in a fixed order on one work-item: no
 * atomics, the same bytes on every run. */

/* The derivative of activation `code` at the (clipped) pre-activation v whose value is y (ABI.md §9: at a kink,
 * the branch the forward takes). */
INLINE_FN real rnnb_slope(int code, real v, real y, real a, real b)
{
    switch (code) {
    case RNN_ACT_SIGMOID: return y * ((real)1 - y);
    case RNN_ACT_TANH: return (real)1 - y * y;
    case RNN_ACT_RELU: return v > (real)0 ? (real)1 : (real)0;
    case RNN_ACT_AFFINE: return a;
    case RNN_ACT_LEAKY_RELU: return v >= (real)0 ? (real)1 : a;
    case RNN_ACT_THRESHOLDED_RELU: return v > a ? (real)1 : (real)0;
    case RNN_ACT_SCALED_TANH: {
        const real th = rnn_tanh(b * v);
        return a * b * ((real)1 - th * th);
    }
    case RNN_ACT_HARD_SIGMOID: {
        const real s = a * v + b;
        return s >= (real)0 && s <= (real)1 ? a : (real)0;
    }
    case RNN_ACT_ELU: return v >= (real)0 ? (real)1 : y + a;
    case RNN_ACT_SOFTSIGN: {
        const real d = (real)1 + (v < (real)0 ? -v : v);
        return (real)1 / (d * d);
    }
    case RNN_ACT_SOFTPLUS:
    default: return rnn_sigmoid(v);
    }
}

/* Slot `slot`'s derivative (rnn_slot's selection of the direction's activation). */
INLINE_FN real rnnb_slot_slope(int code0, int code1, int slot, real v, real y, const rnn_params* p)
{
    const real a = p->ab[2 * slot], b = p->ab[2 * slot + 1];
    return (code0 == code1 || !p->dir) ? rnnb_slope(code0, v, y, a, b) : rnnb_slope(code1, v, y, a, b);
}

/* A gate of activation slot `slot` from its raw pre-activation u: *y its value, returned the gradient factor
 * that turns the value's gradient into the pre-activation's (the slope, 0 where clip clamped u). */
INLINE_FN real rnnb_gate(int slot, real u, real* y, const rnn_params* p)
{
    const real v = rnn_clip(u, p);
    real pass = (real)1;
#if RNN_CLIP
    pass = (u < -p->clip || u > p->clip) ? (real)0 : (real)1; /* torch.clamp: the bounds pass the gradient */
#endif
    if (slot == 0) {
        *y = rnn_f(v, p);
        return pass * rnnb_slot_slope(RNN_ACT_F0, RNN_ACT_F1, 0, v, *y, p);
    }
    *y = rnn_g(v, p);
    return pass * rnnb_slot_slope(RNN_ACT_G0, RNN_ACT_G1, 1, v, *y, p);
}

/* Gate g's value (*y) and the factor turning its gradient into its pre-activation's (slot `slot`), of the step
 * whose kept row is u (the pre-activations the backward's forward kept: rnnb_gate) or, with RNN_SAVED, element
 * e = at*G*H + g*H + j of the layer-direction's saved forward sv (N = S*B rows): its y, u and the clip's mask mk,
 * u and the mask read only where the forward wrote them (RNN_KEEPS_U, RNN_CLIP; a slope of sigmoid or tanh reads
 * only the value). */
INLINE_FN real rnnb_kept_gate(int slot, int g, GLOBAL const real* u, GLOBAL const real* sv, GLOBAL const uchar* mk,
                              i64 N, i64 H, i64 K, i64 at, i64 j, real* y, const rnn_params* p)
{
#if RNN_SAVED
    const i64 e = at * RNN_GATES * H + g * H + j;
    *y = sv[e];
    const real v = RNN_KEEPS_U ? sv[rnn_saved_at(RNN_SV_U, N, H, K) + e] : (real)0;
    real s = slot == 0 ? rnnb_slot_slope(RNN_ACT_F0, RNN_ACT_F1, 0, v, *y, p)
                       : rnnb_slot_slope(RNN_ACT_G0, RNN_ACT_G1, 1, v, *y, p);
#if RNN_CLIP
    s = mk[e] ? s : (real)0;
#endif
    return s;
#else
    return rnnb_gate(slot, u[g * H + j], y, p);
#endif
}

/* Element j of a kept per-step array of width `width`: row `row` of the backward's own (kept), or, with
 * RNN_SAVED, array `a` (RNN_SV_*) of the saved forward sv at time-major row `at`. */
INLINE_FN real rnnb_kept(GLOBAL const real* kept, i64 row, GLOBAL const real* sv, int a, i64 at, i64 N, i64 H, i64 K,
                         i64 width, i64 j)
{
#if RNN_SAVED
    return sv[rnn_saved_at(a, N, H, K) + at * width + j];
#else
    return kept[row * width + j];
#endif
}

/* sum_q w[q] * v[q]: a row of a weight in arena storage against a vector in the compute type. */
INLINE_FN real rnnb_dot(GLOBAL const uchar* w, GLOBAL const real* v, i64 n)
{
    real s = (real)0;
    for (i64 q = 0; q < n; ++q)
        s += LOAD(w, q) * v[q];
    return s;
}

/* Row b's step t: its time tt (through *tt) and the row of its successor in the walk (-1 past the last). */
INLINE_FN i64 rnnb_next_row(i64 b, i64 t, i64 len, int back, i64 S, i64* tt)
{
    *tt = rnn_time(t, back, len);
    return t + 1 < len ? b * S + rnn_time(t + 1, back, len) : -1;
}

/* The row (b * S + time) that reverse step t of batch row b visits; -1 where row b takes no step t. */
INLINE_FN i64 rnnb_reverse_row(GLOBAL const int* lens, i64 b, i64 S, i64 t, int back)
{
    const i64 len = rnn_len(lens, b, S);
    return t < len ? b * S + rnn_time(len - 1 - t, back, len) : -1;
}

/* n reals of scratch set to zero (the tensors whose padding steps, past seq_lens, no step writes). */
KERNEL rnnb_zero(i64 n, GLOBAL uchar* zb, i64 zo)
{
    GLOBAL real* z = AT(real, zb, zo);
    for (i64 i = GID(0); i < n; i += GSIZE(0))
        z[i] = (real)0;
}

#ifdef RLX_TARGET_GPU
/* gpu target (the cpu target runs body.cl's gemm): a step's recurrent product of every batch row,
 * d[z][r][c] = bias[z][c] (has_bias) + sum_q a[z][r][q] b[z][q][c] for r < m, c < n, q < k: the forward's rec = h W_hh^T + b_hh (b: W_hh^T staged), the reverse's dh = dzc W_hh
 * (b: W_hh in arena storage, b_real 0). Item (column c, block of RNN_RB rows, z): one pass over b's column,
 * each weight serving the block's rows, consecutive items reading consecutive reals of b's rows; a and d
 * compute-type scratch (rows of a_rs, d_rs; batches a_bs, b_bs, d_bs apart), bias arena storage. */
KERNEL rnnb_step_product(i64 m, i64 n, i64 k, GLOBAL uchar* ab, i64 ao, i64 a_bs, i64 a_rs, GLOBAL uchar* bb, i64 bo,
                         int b_real, i64 b_bs, i64 b_rs, GLOBAL uchar* cb, i64 co, int has_bias, i64 c_bs,
                         GLOBAL uchar* db, i64 dbo, i64 d_bs, i64 d_rs)
{
    const i64 c = GID(0), r0 = GID(1) * RNN_RB, z = GID(2);
    if (c >= n || r0 >= m)
        return;
    GLOBAL const real* a = AT(real, ab, ao) + z * a_bs + r0 * a_rs;
    GLOBAL const uchar* b = AT(uchar, bb, bo);
    GLOBAL real* d = AT(real, db, dbo) + z * d_bs + r0 * d_rs;
    const real bias = has_bias ? LOAD(AT(uchar, cb, co), z * c_bs + c) : (real)0;
    real acc[RNN_RB];
    PRAGMA_UNROLL
    for (int r = 0; r < RNN_RB; ++r)
        acc[r] = bias;
    for (i64 q = 0; q < k; ++q) {
        const real w = load_any(b, z * b_bs + q * b_rs + c, b_real);
        PRAGMA_UNROLL
        for (int r = 0; r < RNN_RB; ++r)
            if (r0 + r < m)
                acc[r] += a[r * a_rs + q] * w;
    }
    PRAGMA_UNROLL
    for (int r = 0; r < RNN_RB; ++r)
        if (r0 + r < m)
            d[r * d_rs + c] = acc[r];
}
#endif

/* The state entering each row's first step into hp (and cp) and, for every row, h into the compact hs that the
 * first step's recurrent gemm reads: h0/c0 of the layer with carry, else zeros. */
KERNEL rnnb_forward_init(i64 B, i64 S, i64 H, i64 K, int carry, int reverse, GLOBAL uchar* h0b, i64 h0o,
                         GLOBAL uchar* c0b, i64 c0o, GLOBAL uchar* hpb, i64 hpo, GLOBAL uchar* cpb, i64 cpo,
                         GLOBAL uchar* hsb, i64 hso, GLOBAL uchar* lb, i64 lo)
{
    const i64 i = GID(0), dir = GID(2);
    GLOBAL const int* lens = AT(int, lb, lo);
    if (i >= (H > K ? H : K))
        return;
    for (i64 b = GID(1); b < B; b += GSIZE(1)) {
        const i64 len = rnn_len(lens, b, S), at = dir * B + b;
        const real h = carry && i < K ? LOAD(AT(uchar, h0b, h0o), at * K + i) : (real)0;
        if (i < K)
            AT(real, hsb, hso)[at * K + i] = h;
        if (len == 0)
            continue;
        const i64 row = b * S + rnn_time(0, dir || reverse, len);
        if (i < K)
            AT(real, hpb, hpo)[(dir * B * S + row) * K + i] = h;
        if (RNN_HAS_CELL && i < H)
            AT(real, cpb, cpo)[(dir * B * S + row) * H + i] = carry ? LOAD(AT(uchar, c0b, c0o), at * H + i) : (real)0;
    }
}

/* One forward step t of every row and both directions, item (unit j, row, direction), keeping what the reverse
 * pass reads: u over xw in place, cp / cn / raw (lstm), hn (gru), the new h into hp at the row's next step, into
 * the compact hs [D][B][K] (the next step's gemm operand) and into the layer output o (has_out; rows of o_rs =
 * D*K). The recurrent sums come from the step's gemm: rec [D][B][G*H] = h W_hh^T + b_hh. With RNN_PROJ the new h
 * is rnnb_forward_proj's; with RNN_LBR0 phase 0 makes r, z and r * h (hn, and compact in rh [D][B][H], the
 * operand of the gemm that sums n's block of rec), phase 1 n and h. The last arguments are rnn_step's (seq_lens,
 * the layer's peepholes, clip, alpha and beta per slot and direction). */
KERNEL rnnb_forward_step(i64 B, i64 S, i64 H, i64 K, i64 t, int reverse, int phase,
                         GLOBAL uchar* ub, i64 uo, GLOBAL uchar* rcb, i64 rco, GLOBAL uchar* hsb, i64 hso,
                         GLOBAL uchar* rhb, i64 rho, GLOBAL uchar* hpb, i64 hpo, GLOBAL uchar* cpb, i64 cpo, GLOBAL uchar* cnb, i64 cno,
                         GLOBAL uchar* hnb, i64 hno, GLOBAL uchar* rwb, i64 rwo, GLOBAL uchar* ob, i64 oo, int has_out, i64 o_rs,
                         GLOBAL uchar* lb, i64 lo, GLOBAL uchar* pb, i64 po,
                         real clip, real a_f0, real b_f0, real a_g0, real b_g0, real a_h0, real b_h0,
                         real a_f1, real b_f1, real a_g1, real b_g1, real a_h1, real b_h1)
{
    const i64 j = GID(0), dir = GID(2), GH = RNN_GATES * H, N = B * S;
    if (j >= H)
        return;
    GLOBAL real* u_all = AT(real, ub, uo) + dir * N * GH;
    GLOBAL const real* rec_all = AT(real, rcb, rco) + dir * B * GH;
    GLOBAL real* hs = AT(real, hsb, hso) + dir * B * K;
    GLOBAL real* rh = AT(real, rhb, rho) + dir * B * H;
    GLOBAL real* hp = AT(real, hpb, hpo) + dir * N * K;
    GLOBAL real* cp = AT(real, cpb, cpo) + dir * N * H;
    GLOBAL real* cn = AT(real, cnb, cno) + dir * N * H;
    GLOBAL real* hn = AT(real, hnb, hno) + dir * N * H;
    GLOBAL real* raw = AT(real, rwb, rwo) + dir * N * H;
    GLOBAL real* o = AT(real, ob, oo);
    GLOBAL const int* lens = AT(int, lb, lo);
    GLOBAL const uchar* peep = AT(uchar, pb, po + dir * 3 * H * (i64)sizeof(store_t));
    const rnn_params p = rnn_params_of((int)dir, clip, a_f0, b_f0, a_g0, b_g0, a_h0, b_h0, a_f1, b_f1, a_g1, b_g1, a_h1, b_h1);
    const int back = dir || reverse;
    for (i64 b = GID(1); b < B; b += GSIZE(1)) {
        const i64 len = rnn_len(lens, b, S);
        if (t >= len)
            continue;
        i64 tt;
        const i64 next = rnnb_next_row(b, t, len, back, S, &tt), row = b * S + tt;
        GLOBAL real* u = u_all + row * GH;
        GLOBAL const real* rec = rec_all + b * GH;
        real hv;
#if RNN_GATES == 4
        real pp[3];
        rnn_peepholes(pp, peep, j, H);
        const real c = cp[row * H + j];
        real z[4];
        for (int g = 0; g < 4; ++g)
            z[g] = rec[g * H + j] + u[g * H + j];
#if RNN_PEEP
        z[0] += pp[0] * c;
        z[1] += pp[2] * c;
#endif
        real gi, gf, gg, go;
        rnnb_gate(0, z[0], &gi, &p);
#if RNN_IFG
        gf = (real)1 - gi;
#else
        rnnb_gate(0, z[1], &gf, &p);
#endif
        rnnb_gate(1, z[2], &gg, &p);
        const real c_new = gf * c + gi * gg;
#if RNN_PEEP
        z[3] += pp[1] * c_new;
#endif
        rnnb_gate(0, z[3], &go, &p);
        for (int g = 0; g < 4; ++g)
            u[g * H + j] = z[g];
        cn[row * H + j] = c_new;
        if (next >= 0)
            cp[next * H + j] = c_new;
        hv = go * rnn_h(c_new, &p);
#if RNN_PROJ
        raw[row * H + j] = hv;
        continue; /* rnnb_forward_proj makes h */
#endif
#elif RNN_GATES == 3
        const real hj = hp[row * K + j];
#if RNN_LBR0
        if (phase == 0) {
            real gr;
            for (int g = 0; g < 2; ++g)
                u[g * H + j] += rec[g * H + j];
            rnnb_gate(0, u[j], &gr, &p);
            hn[row * H + j] = rh[b * H + j] = gr * hj; /* W_hn's operand r * h: phase 1 needs every unit's */
            continue;
        }
        u[2 * H + j] += rec[2 * H + j];
#else
        const real zr = u[j] + rec[j], zz = u[H + j] + rec[H + j], hq = rec[2 * H + j];
        real gr;
        rnnb_gate(0, zr, &gr, &p);
        hn[row * H + j] = hq;
        u[j] = zr;
        u[H + j] = zz;
        u[2 * H + j] += gr * hq;
#endif
        real gz, gn;
        rnnb_gate(0, u[H + j], &gz, &p);
        rnnb_gate(1, u[2 * H + j], &gn, &p);
        hv = ((real)1 - gz) * gn + gz * hj;
#else
        u[j] += rec[j];
        rnnb_gate(0, u[j], &hv, &p);
#endif
        hs[b * K + j] = hv;
        if (next >= 0)
            hp[next * K + j] = hv;
        if (has_out)
            o[row * o_rs + dir * K + j] = hv;
    }
}

#if RNN_PROJ
/* lstm's projection of forward step t: h[p] = sum_j W_hr[p][j] raw[j], into hp at the row's next step, the
 * compact hs and the layer output o; item (p, row, direction), w_hr the layer's (arena storage, [D][P][H]). */
KERNEL rnnb_forward_proj(i64 B, i64 S, i64 H, i64 P, i64 t, int reverse, GLOBAL uchar* rwb, i64 rwo,
                         GLOBAL uchar* wrb, i64 wro, GLOBAL uchar* hpb, i64 hpo, GLOBAL uchar* hsb, i64 hso,
                         GLOBAL uchar* ob, i64 oo, int has_out, i64 o_rs, GLOBAL uchar* lb, i64 lo)
{
    const i64 q = GID(0), dir = GID(2), N = B * S;
    if (q >= P)
        return;
    GLOBAL const real* raw = AT(real, rwb, rwo) + dir * N * H;
    GLOBAL const uchar* wr = AT(uchar, wrb, wro + (dir * P + q) * H * (i64)sizeof(store_t));
    GLOBAL real* hp = AT(real, hpb, hpo) + dir * N * P;
    GLOBAL const int* lens = AT(int, lb, lo);
    for (i64 b = GID(1); b < B; b += GSIZE(1)) {
        const i64 len = rnn_len(lens, b, S);
        if (t >= len)
            continue;
        i64 tt;
        const i64 next = rnnb_next_row(b, t, len, dir || reverse, S, &tt), row = b * S + tt;
        const real hv = rnnb_dot(wr, raw + row * H, H);
        AT(real, hsb, hso)[(dir * B + b) * P + q] = hv;
        if (next >= 0)
            hp[next * P + q] = hv;
        if (has_out)
            AT(real, ob, oo)[row * o_rs + dir * P + q] = hv;
    }
}
#endif

/* The reverse walk's state gradients of a layer, [D][B][width]: the final state's (d_h0, d_c0 of the layer, arena
 * storage) with carry, else zeros; gru's direct part of dh (nd reals) zeros. */
KERNEL rnnb_backward_init(i64 nh, i64 nc, i64 nd, int carry, GLOBAL uchar* h0b, i64 h0o, GLOBAL uchar* c0b, i64 c0o,
                          GLOBAL uchar* dhb, i64 dho, GLOBAL uchar* dcb, i64 dco, GLOBAL uchar* dsb, i64 dso)
{
    /* nc is 0 but for lstm, nd but for gru */
    rnn_state_into(GID(0), carry, nh, nc, AT(uchar, h0b, h0o), AT(uchar, c0b, c0o), AT(real, dhb, dho),
                   AT(real, dcb, dco));
    if (GID(0) < nd)
        AT(real, dsb, dso)[GID(0)] = (real)0;
}

/* The initial state's gradients of a layer, after its reverse walk, into d_h0 / d_c0 in place: dh (plus gru's
 * direct part, nd reals), dc. A row that took no step (seq_lens 0) keeps its d_h0: the walk's last gemm wrote its
 * dh from a dzc it never set. */
KERNEL rnnb_backward_out(i64 nh, i64 nc, i64 nd, i64 B, i64 S, i64 K, GLOBAL uchar* dhb, i64 dho, GLOBAL uchar* dcb,
                         i64 dco, GLOBAL uchar* dsb, i64 dso, GLOBAL uchar* h0b, i64 h0o, GLOBAL uchar* c0b, i64 c0o,
                         GLOBAL uchar* lb, i64 lo)
{
    const i64 i = GID(0);
    if (i < nh && rnn_len(AT(int, lb, lo), i / K % B, S) > 0)
        STORE(AT(uchar, h0b, h0o), i, AT(real, dhb, dho)[i] + (i < nd ? AT(real, dsb, dso)[i] : (real)0));
    if (i < nc)
        STORE(AT(uchar, c0b, c0o), i, AT(real, dcb, dco)[i]);
}

/* A layer's reverse walk as its kernels see it, direction dir's blocks rebased: what the pre-activations'
 * gradients read and write (rnnb_backward_cell's arguments, which rnnb_walk_of takes in the same order), and the
 * walk's shape. dh holds every direction (rnnb_dh_in indexes it). */
typedef struct {
    GLOBAL const uchar* dy;
    GLOBAL real* dh;
    GLOBAL real* dc;
    GLOBAL real* draw;
    GLOBAL real* direct;
    GLOBAL const real* u;
    GLOBAL const real* hp;
    GLOBAL const real* cp;
    GLOBAL const real* cn;
    GLOBAL const real* hn;
    GLOBAL const uchar* whh;
    GLOBAL real* dz;
    GLOBAL real* dzh;
    GLOBAL real* dzc;
    GLOBAL const real* sv;
    GLOBAL const uchar* mk;
    GLOBAL const int* lens;
    GLOBAL const uchar* peep;
    i64 B, S, H, K, dir, dy_rs, dz_rs;
    int dy_real, back;
    rnn_params p;
} rnnb_walk;

INLINE_FN rnnb_walk rnnb_walk_of(i64 B, i64 S, i64 H, i64 K, i64 dir, int reverse, GLOBAL uchar* yb, i64 yo,
                                 int dy_real, i64 dy_rs, GLOBAL uchar* dhb, i64 dho, GLOBAL uchar* dcb, i64 dco,
                                 GLOBAL uchar* drb, i64 dro, GLOBAL uchar* dsb, i64 dso, GLOBAL uchar* ub, i64 uo,
                                 GLOBAL uchar* hpb, i64 hpo, GLOBAL uchar* cpb, i64 cpo, GLOBAL uchar* cnb, i64 cno,
                                 GLOBAL uchar* hnb, i64 hno, GLOBAL uchar* whb, i64 who, GLOBAL uchar* dzb, i64 dzo,
                                 GLOBAL uchar* dhzb, i64 dhzo, i64 dz_rs, GLOBAL uchar* dzcb, i64 dzco,
                                 GLOBAL uchar* svb, i64 svo, GLOBAL uchar* mkb, i64 mko, GLOBAL uchar* lb, i64 lo,
                                 GLOBAL uchar* pb, i64 po, const rnn_params* p)
{
    const i64 GH = RNN_GATES * H, N = B * S;
    rnnb_walk w; /* the fields rnnb_proj_grad reads */
    w.dy = AT(uchar, yb, yo);
    w.dh = AT(real, dhb, dho);
    w.dc = AT(real, dcb, dco) + dir * B * H;
    w.draw = AT(real, drb, dro) + dir * B * H;
    w.direct = AT(real, dsb, dso) + dir * B * H;
    w.u = AT(real, ub, uo) + dir * N * GH;
    w.hp = AT(real, hpb, hpo) + dir * N * K;
    w.cp = AT(real, cpb, cpo) + dir * N * H;
    w.cn = AT(real, cnb, cno) + dir * N * H;
    w.hn = AT(real, hnb, hno) + dir * N * H;
    w.whh = AT(uchar, whb, who + dir * GH * K * (i64)sizeof(store_t));
    w.dz = AT(real, dzb, dzo) + dir * GH;
    w.dzh = AT(real, dhzb, dhzo) + dir * GH;
    w.dzc = AT(real, dzcb, dzco) + dir * B * GH;
    w.sv = AT(real, svb, svo) + dir * rnn_saved_block(N, H, K);
    w.mk = AT(uchar, mkb, mko) + dir * N * GH;
    w.lens = AT(int, lb, lo);
    w.peep = AT(uchar, pb, po + dir * 3 * H * (i64)sizeof(store_t));
    w.B = B;
    w.S = S;
    w.H = H;
    w.K = K;
    w.dir = dir;
    w.dy_rs = dy_rs;
    w.dz_rs = dz_rs;
    w.dy_real = dy_real;
    w.back = dir || reverse;
    w.p = *p;
    return w;
}

/* The gradient of the h a step outputs, dh_in = dh + dy (dy: the layer output's gradient, arena storage or
 * compute-type scratch: dy_real; rows of dy_rs), for unit j of batch row b at row `row`. */
INLINE_FN real rnnb_dh_in(const rnnb_walk* w, i64 b, i64 row, i64 j)
{
    return w->dh[(w->dir * w->B + b) * w->K + j] + load_any(w->dy, row * w->dy_rs + w->dir * w->K + j, w->dy_real);
}

#if RNN_PROJ
/* lstm's projection in reverse, for unit j of batch row b at row `row`: dh_in of unit j < P (= K) into dhin (for
 * d_w_hr), and draw[j] = sum_p dh_in[p] W_hr[p][j], the gradient of o * h(c), for j < H; wr the direction's
 * W_hr (arena storage, [P][H]), dhin its [N][P]. */
INLINE_FN void rnnb_proj_grad(const rnnb_walk* w, GLOBAL const uchar* wr, GLOBAL real* dhin, i64 b, i64 j, i64 row)
{
    const i64 P = w->K, H = w->H;
    if (j < P)
        dhin[row * P + j] = rnnb_dh_in(w, b, row, j);
    if (j < H) {
        real s = (real)0;
        for (i64 q = 0; q < P; ++q)
            s += rnnb_dh_in(w, b, row, q) * LOAD(wr, q * H + j);
        w->draw[b * H + j] = s;
    }
}

/* lstm's projection in reverse at step t: item (unit, row, direction) runs rnnb_proj_grad; w_hr the layer's
 * ([D][P][H]), dhin [D][N][P]. */
KERNEL rnnb_backward_proj(i64 B, i64 S, i64 H, i64 P, i64 t, int reverse, GLOBAL uchar* yb, i64 yo, int dy_real,
                          i64 dy_rs, GLOBAL uchar* dhb, i64 dho, GLOBAL uchar* wrb, i64 wro, GLOBAL uchar* dib, i64 dio,
                          GLOBAL uchar* drb, i64 dro, GLOBAL uchar* lb, i64 lo)
{
    const i64 j = GID(0), dir = GID(2);
    if (j >= (H > P ? H : P))
        return;
    rnnb_walk w; /* the fields rnnb_proj_grad reads */
    w.dy = AT(uchar, yb, yo);
    w.dh = AT(real, dhb, dho);
    w.draw = AT(real, drb, dro) + dir * B * H;
    w.B = B;
    w.H = H;
    w.K = P;
    w.dir = dir;
    w.dy_rs = dy_rs;
    w.dy_real = dy_real;
    GLOBAL const uchar* wr = AT(uchar, wrb, wro + dir * P * H * (i64)sizeof(store_t));
    GLOBAL real* dhin = AT(real, dib, dio) + dir * B * S * P;
    for (i64 b = GID(1); b < B; b += GSIZE(1)) {
        const i64 row = rnnb_reverse_row(AT(int, lb, lo), b, S, t, dir || reverse);
        if (row >= 0)
            rnnb_proj_grad(&w, wr, dhin, b, j, row);
    }
}
#endif

/* Unit j of batch row b at row `row`, one reverse step (of phase `phase`): from the kept forward (u, hp, cp, cn,
 * hn) and the gradient of the step's h (dh_in: the previous step's dh, gru's direct part and dy; lstm with
 * RNN_PROJ: draw, the gradient of o * h(c)), the gate pre-activations' gradients into dz (input side) and dzh
 * (gru's hidden side; rows of dz_rs = D*G*H, direction dir's block at dir*G*H), the hidden side also compact into
 * dzc [D][B][G*H] (the operand of dh = dzc W_hh), lstm's cell gradient in dc (in place), and gru's direct part of
 * the entering h's gradient (dh_in * z, and W_hn's through r * h without linear_before_reset) in direct. RNN_LBR0
 * takes two phases: 0 every unit but r's gradient, 1 r's, from dq = W_hn^T dz_n (phase 0 of every unit of the
 * row first). With RNN_SAVED the kept forward is the saved forward's (sv: the layer-direction's block, mk: its
 * clip mask; kernels/rnn_cell.cl's layout) instead. */
INLINE_FN void rnnb_cell_grad(const rnnb_walk* w, i64 b, i64 j, i64 row, int phase)
{
    const i64 B = w->B, S = w->S, H = w->H, K = w->K, N = B * S, GH = RNN_GATES * H;
    const i64 at = (row - b * S) * B + b; /* the saved forward's row: time-major */
    GLOBAL const real* u = w->u + row * GH;
    GLOBAL const real* sv = w->sv;
    GLOBAL const uchar* mk = w->mk;
    GLOBAL real* dz = w->dz + row * w->dz_rs;
    GLOBAL real* dzh = w->dzh + row * w->dz_rs;
    GLOBAL real* dzc = w->dzc + b * GH;
    const rnn_params* p = &w->p;
#if RNN_GATES == 4
    real pp[3];
    rnn_peepholes(pp, w->peep, j, H);
    const real dhj = RNN_PROJ ? w->draw[b * H + j] : rnnb_dh_in(w, b, row, j);
    real gi, gf, gg, go;
    const real si = rnnb_kept_gate(0, 0, u, sv, mk, N, H, K, at, j, &gi, p);
#if RNN_IFG
    gf = (real)1 - gi;
#else
    const real sf = rnnb_kept_gate(0, 1, u, sv, mk, N, H, K, at, j, &gf, p);
#endif
    const real sg = rnnb_kept_gate(1, 2, u, sv, mk, N, H, K, at, j, &gg, p);
    const real so = rnnb_kept_gate(0, 3, u, sv, mk, N, H, K, at, j, &go, p);
    const real c_prev = rnnb_kept(w->cp, row, sv, RNN_SV_CP, at, N, H, K, H, j);
#if RNN_SAVED && !RNN_KEEPS_CN
    const real c_new = (real)0; /* not saved: h is tanh, whose slope reads only its value */
#else
    const real c_new = rnnb_kept(w->cn, row, sv, RNN_SV_CN, at, N, H, K, H, j);
#endif
    const real hc = RNN_SAVED ? rnnb_kept(w->cn, row, sv, RNN_SV_HC, at, N, H, K, H, j) : rnn_h(c_new, p);
    const real dzo = dhj * hc * so;
    real dcn = dhj * go * rnnb_slot_slope(RNN_ACT_H0, RNN_ACT_H1, 2, c_new, hc, p) + w->dc[b * H + j];
#if RNN_PEEP
    dcn += dzo * pp[1];
#endif
    real dgi = dcn * gg;
    const real dgf = dcn * c_prev;
#if RNN_IFG
    dgi -= dgf; /* f = 1 - i: z_f reaches nothing, its gradient is 0 (not 0 times a NaN) */
    const real dzf = (real)0;
#else
    const real dzf = dgf * sf;
#endif
    const real dzi = dgi * si, dzg = dcn * gi * sg;
    real dc_prev = dcn * gf;
#if RNN_PEEP
    dc_prev += dzi * pp[0] + dzf * pp[2];
#endif
    dz[j] = dzc[j] = dzi;
    dz[H + j] = dzc[H + j] = dzf;
    dz[2 * H + j] = dzc[2 * H + j] = dzg;
    dz[3 * H + j] = dzc[3 * H + j] = dzo;
    w->dc[b * H + j] = dc_prev;
#elif RNN_GATES == 3
    real gr, gz, gn;
    GLOBAL real* direct = w->direct + b * H;
    const real sr = rnnb_kept_gate(0, 0, u, sv, mk, N, H, K, at, j, &gr, p);
    const real h_prev = rnnb_kept(w->hp, row, sv, RNN_SV_HP, at, N, H, K, K, j);
    if (RNN_LBR0 && phase == 1) { /* r's gradient through W_hn (r * h): dq = sum_i dz_n[i] W_hn[i][j] */
        real dq = (real)0;
        for (i64 i = 0; i < H; ++i)
            dq += dz[2 * H + i] * LOAD(w->whh, (2 * H + i) * K + j);
        dz[j] = dzh[j] = dzc[j] = dq * h_prev * sr;
        direct[j] += dq * gr;
        return;
    }
    const real dhj = rnnb_dh_in(w, b, row, j) + direct[j];
    const real sz = rnnb_kept_gate(0, 1, u, sv, mk, N, H, K, at, j, &gz, p);
    const real sn = rnnb_kept_gate(1, 2, u, sv, mk, N, H, K, at, j, &gn, p);
    const real dpn = dhj * ((real)1 - gz) * sn;
    dz[H + j] = dzh[H + j] = dzc[H + j] = dhj * (h_prev - gn) * sz;
    dz[2 * H + j] = dpn;
    direct[j] = dhj * gz;
#if RNN_LBR0
    dzh[2 * H + j] = dpn;
#else
    const real hq = rnnb_kept(w->hn, row, sv, RNN_SV_HN, at, N, H, K, H, j); /* W_hn h + b_hn, which the reset scales */
    dzh[2 * H + j] = dzc[2 * H + j] = dpn * gr;
    dz[j] = dzh[j] = dzc[j] = dpn * hq * sr;
#endif
#else
    real y;
    const real s = rnnb_kept_gate(0, 0, u, sv, mk, N, H, K, at, j, &y, p);
    dz[j] = dzc[j] = rnnb_dh_in(w, b, row, j) * s;
#endif
}


/* One reverse step of every row and both directions, item (unit j, row, direction): the walk's step t from its
 * end (the forward's step len-1-t), rnnb_cell_grad of phase `phase`. Arguments past the step as rnnb_walk_of's,
 * then rnnb_forward_step's. */
KERNEL rnnb_backward_cell(i64 B, i64 S, i64 H, i64 K, i64 t, int reverse, int phase, GLOBAL uchar* yb, i64 yo,
                          int dy_real, i64 dy_rs, GLOBAL uchar* dhb, i64 dho, GLOBAL uchar* dcb, i64 dco,
                          GLOBAL uchar* drb, i64 dro, GLOBAL uchar* dsb, i64 dso, GLOBAL uchar* ub, i64 uo,
                          GLOBAL uchar* hpb, i64 hpo, GLOBAL uchar* cpb, i64 cpo, GLOBAL uchar* cnb, i64 cno,
                          GLOBAL uchar* hnb, i64 hno, GLOBAL uchar* whb, i64 who, GLOBAL uchar* dzb, i64 dzo,
                          GLOBAL uchar* dhzb, i64 dhzo, i64 dz_rs, GLOBAL uchar* dzcb, i64 dzco, GLOBAL uchar* svb, i64 svo,
                          GLOBAL uchar* mkb, i64 mko, GLOBAL uchar* lb, i64 lo, GLOBAL uchar* pb, i64 po,
                          real clip, real a_f0, real b_f0, real a_g0, real b_g0, real a_h0, real b_h0,
                          real a_f1, real b_f1, real a_g1, real b_g1, real a_h1, real b_h1)
{
    const i64 j = GID(0), dir = GID(2);
    if (j >= H)
        return;
    const rnn_params p = rnn_params_of((int)dir, clip, a_f0, b_f0, a_g0, b_g0, a_h0, b_h0, a_f1, b_f1, a_g1, b_g1, a_h1, b_h1);
    const rnnb_walk w = rnnb_walk_of(B, S, H, K, dir, reverse, yb, yo, dy_real, dy_rs, dhb, dho, dcb, dco, drb, dro,
                                     dsb, dso, ub, uo, hpb, hpo, cpb, cpo, cnb, cno, hnb, hno, whb, who, dzb, dzo, dhzb,
                                     dhzo, dz_rs, dzcb, dzco, svb, svo, mkb, mko, lb, lo, pb, po, &p);
    for (i64 b = GID(1); b < B; b += GSIZE(1)) {
        const i64 row = rnnb_reverse_row(w.lens, b, S, t, w.back);
        if (row >= 0)
            rnnb_cell_grad(&w, b, j, row, phase);
    }
}

/* Whether batch row b (< B) takes reverse step t. */
INLINE_FN int rnnb_steps(const rnnb_walk* w, i64 b, i64 t)
{
    return rnnb_reverse_row(w->lens, b, w->S, t, w->back) >= 0;
}

/* The persistent reverse walk: a layer's every reverse step, one launch, a work-group per block of RNNB_ROWS batch
 * rows (r0 on) and direction. Rows share nothing within a step but W_hh, so no group waits for another: a step
 * runs lstm's projection (rnnb_proj_grad), the cells' phases (rnnb_cell_grad) and dh = dzc W_hh of the block's
 * rows that take it (over the first nq = G*H reals of dzc, 2*H with RNN_LBR0, whose n goes through direct), each
 * weight read once for the block's rows. Every sum runs in a fixed order: the same bytes on every run. Arguments
 * as rnnb_backward_cell's without the step and phase, plus W_hr (wrb: the layer's [D][P][H]) and dhin (dib:
 * [D][N][P]) with RNN_PROJ. */
#ifdef RLX_TARGET_GPU
/* gpu target: step t's projection (RNN_PROJ) and cells of the block's rows from r0, the items over the units
 * of each row, a barrier after each phase (RNN_LBR0's phase 1 reads every unit's dz_n). */
INLINE_FN void rnnb_group_cells_barrier(const rnnb_walk* w, GLOBAL const uchar* wr, GLOBAL real* dhin, i64 r0,
                                        i64 t)
{
    const i64 lane = LID(0), B = w->B, H = w->H;
#if RNN_PROJ
    for (i64 b = r0; b < r0 + RNNB_ROWS && b < B; ++b) {
        const i64 row = rnnb_reverse_row(w->lens, b, w->S, t, w->back);
        for (i64 j = lane; row >= 0 && j < (H > w->K ? H : w->K); j += RNNB_LANES)
            rnnb_proj_grad(w, wr, dhin, b, j, row);
    }
    BARRIER();
#endif
    for (int phase = 0; phase <= RNN_LBR0; ++phase) {
        for (i64 b = r0; b < r0 + RNNB_ROWS && b < B; ++b) {
            const i64 row = rnnb_reverse_row(w->lens, b, w->S, t, w->back);
            for (i64 j = lane; row >= 0 && j < H; j += RNNB_LANES)
                rnnb_cell_grad(w, b, j, row, phase);
        }
        BARRIER();
    }
}

/* gpu target: dh of the block's rows that take step t, an item a column k (consecutive items reading consecutive
 * reals of W_hh's rows) and the block's rows' sums, with dzc staged RNNB_TQ terms at a time in LOCAL memory. */
INLINE_FN void rnnb_tiled_product_barrier(const rnnb_walk* w, LOCAL_PTR real* tile, i64 r0, i64 t, i64 nq)
{
    const i64 B = w->B, K = w->K, GH = RNN_GATES * w->H, lane = LID(0);
    for (i64 k0 = 0; k0 < K; k0 += RNNB_LANES) {
        const i64 k = k0 + lane;
        real acc[RNNB_ROWS];
        PRAGMA_UNROLL
        for (int r = 0; r < RNNB_ROWS; ++r)
            acc[r] = (real)0;
        for (i64 q0 = 0; q0 < nq; q0 += RNNB_TQ) {
            for (int r = 0; r < RNNB_ROWS; ++r)
                for (i64 q = lane; q < RNNB_TQ; q += RNNB_LANES)
                    tile[r * RNNB_TQ + q] = r0 + r < B && q0 + q < nq ? w->dzc[(r0 + r) * GH + q0 + q] : (real)0;
            BARRIER();
            const i64 m = nq - q0 < RNNB_TQ ? nq - q0 : RNNB_TQ;
            if (k < K)
                for (i64 q = 0; q < m; ++q) {
                    const real wv = LOAD(w->whh, (q0 + q) * K + k);
                    PRAGMA_UNROLL
                    for (int r = 0; r < RNNB_ROWS; ++r)
                        acc[r] += tile[r * RNNB_TQ + q] * wv;
                }
            BARRIER();
        }
        PRAGMA_UNROLL
        for (int r = 0; r < RNNB_ROWS; ++r)
            if (k < K && r0 + r < B && rnnb_steps(w, r0 + r, t))
                w->dh[(w->dir * B + r0 + r) * K + k] = acc[r];
    }
}

#else
/* cpu target: step t's projection (RNN_PROJ) and cells of the block's nr rows from r0, a row at a time. */
INLINE_FN void rnnb_item_cells(const rnnb_walk* w, GLOBAL const uchar* wr, GLOBAL real* dhin, i64 r0, int nr, i64 t)
{
    const i64 H = w->H;
    for (i64 b = r0; b < r0 + nr; ++b) {
        const i64 row = rnnb_reverse_row(w->lens, b, w->S, t, w->back);
        if (row < 0)
            continue;
#if RNN_PROJ
        for (i64 j = 0; j < (H > w->K ? H : w->K); ++j)
            rnnb_proj_grad(w, wr, dhin, b, j, row);
#endif
        for (int phase = 0; phase <= RNN_LBR0; ++phase)
            for (i64 j = 0; j < H; ++j)
                rnnb_cell_grad(w, b, j, row, phase);
    }
}

/* cpu target: the block's rows' sums of dh = dzc W_hh for nj <= RNNB_JB columns from k0 (rows r0 .. r0+nr-1,
 * nr <= RNNB_ROWS): a rank-1 update per term q, a run of W_hh's row q shared by the rows. The loops run to the
 * compile-time maxima with nr and nj as guards, constants at each call once inlined (kernels/rnn.cl's
 * rnn_rank1_sums says why), so the sums stay in registers and the runs become vector loads and FMAs. */
INLINE_FN void rnnb_block_sums(real* acc, int nr, int nj, GLOBAL const real* dzc, i64 gh, GLOBAL const uchar* whh,
                               i64 K, i64 k0, i64 nq)
{
    PRAGMA_UNROLL
    for (int i = 0; i < RNNB_ROWS * RNNB_JB; ++i)
        acc[i] = (real)0;
    for (i64 q = 0; q < nq; ++q) {
        real wq[RNNB_JB], v[RNNB_ROWS];
        PRAGMA_UNROLL
        for (int u = 0; u < RNNB_JB; ++u)
            wq[u] = u < nj ? LOAD(whh, q * K + k0 + u) : (real)0;
        PRAGMA_UNROLL
        for (int r = 0; r < RNNB_ROWS; ++r)
            v[r] = r < nr ? dzc[r * gh + q] : (real)0;
        PRAGMA_UNROLL
        for (int r = 0; r < RNNB_ROWS; ++r)
            PRAGMA_UNROLL
            for (int u = 0; u < RNNB_JB; ++u)
                acc[r * RNNB_JB + u] += v[r] * wq[u];
    }
}

/* cpu target: dh of the block's rows r0 .. r0+nr-1 that take step t, by runs of RNNB_JB columns. */
INLINE_FN void rnnb_block_product(const rnnb_walk* w, i64 r0, int nr, i64 t, i64 nq)
{
    const i64 K = w->K, GH = RNN_GATES * w->H;
    GLOBAL real* dh = w->dh + (w->dir * w->B + r0) * K;
    for (i64 k0 = 0; k0 < K; k0 += RNNB_JB) {
        real acc[RNNB_ROWS * RNNB_JB];
        const int nj = K - k0 < RNNB_JB ? (int)(K - k0) : RNNB_JB;
        if (nj == RNNB_JB && nr == RNNB_ROWS)
            rnnb_block_sums(acc, RNNB_ROWS, RNNB_JB, w->dzc + r0 * GH, GH, w->whh, K, k0, nq);
        else
            rnnb_block_sums(acc, nr, nj, w->dzc + r0 * GH, GH, w->whh, K, k0, nq);
        for (int r = 0; r < nr; ++r)
            if (rnnb_steps(w, r0 + r, t))
                for (int u = 0; u < nj; ++u)
                    dh[r * K + k0 + u] = acc[r * RNNB_JB + u];
    }
}

#endif

/* gpu target: RNNB_LANES items (rnnb_group_cells_barrier, rnnb_tiled_product_barrier); cpu target: one work-item
 * (a work-group of one) runs the block's rows, no barrier, the sums register-blocked (rnnb_item_cells, rnnb_block_product;
 * kernels/rnn.cl's persistent kernel measured a group of items with a barrier per step 1.3-2x slower). */
KERNEL rnnb_reverse_walk(i64 B, i64 S, i64 H, i64 K, int reverse, GLOBAL uchar* yb, i64 yo, int dy_real, i64 dy_rs,
                         GLOBAL uchar* dhb, i64 dho, GLOBAL uchar* dcb, i64 dco, GLOBAL uchar* drb, i64 dro,
                         GLOBAL uchar* dsb, i64 dso, GLOBAL uchar* ub, i64 uo, GLOBAL uchar* hpb, i64 hpo,
                         GLOBAL uchar* cpb, i64 cpo, GLOBAL uchar* cnb, i64 cno, GLOBAL uchar* hnb, i64 hno,
                         GLOBAL uchar* whb, i64 who, GLOBAL uchar* dzb, i64 dzo, GLOBAL uchar* dhzb, i64 dhzo, i64 dz_rs,
                         GLOBAL uchar* dzcb, i64 dzco, GLOBAL uchar* svb, i64 svo, GLOBAL uchar* mkb, i64 mko,
                         GLOBAL uchar* lb, i64 lo, GLOBAL uchar* pb, i64 po, GLOBAL uchar* wrb, i64 wro,
                         GLOBAL uchar* dib, i64 dio, real clip, real a_f0, real b_f0, real a_g0, real b_g0, real a_h0,
                         real b_h0, real a_f1, real b_f1, real a_g1, real b_g1, real a_h1, real b_h1)
{
#ifdef RLX_TARGET_GPU
    LOCAL real tile[RNNB_ROWS * RNNB_TQ];
#endif
    /* the grid holds ceil(B / RNNB_ROWS) groups of rows: every group has a row */
    const i64 r0 = GROUP(1) * RNNB_ROWS, dir = GROUP(2), nq = RNN_LBR0 ? 2 * H : RNN_GATES * H;
    const rnn_params p = rnn_params_of((int)dir, clip, a_f0, b_f0, a_g0, b_g0, a_h0, b_h0, a_f1, b_f1, a_g1, b_g1, a_h1, b_h1);
    const rnnb_walk w = rnnb_walk_of(B, S, H, K, dir, reverse, yb, yo, dy_real, dy_rs, dhb, dho, dcb, dco, drb, dro,
                                     dsb, dso, ub, uo, hpb, hpo, cpb, cpo, cnb, cno, hnb, hno, whb, who, dzb, dzo, dhzb,
                                     dhzo, dz_rs, dzcb, dzco, svb, svo, mkb, mko, lb, lo, pb, po, &p);
    GLOBAL const uchar* wr = AT(uchar, wrb, wro + dir * K * H * (i64)sizeof(store_t)); /* read with RNN_PROJ */
    GLOBAL real* dhin = AT(real, dib, dio) + dir * B * S * K;
    for (i64 t = 0; t < S; ++t) {
#ifdef RLX_TARGET_GPU
        rnnb_group_cells_barrier(&w, wr, dhin, r0, t);
        rnnb_tiled_product_barrier(&w, tile, r0, t, nq);
        BARRIER(); /* dh is the next step's */
#else
        const int nr = B - r0 < RNNB_ROWS ? (int)(B - r0) : RNNB_ROWS;
        rnnb_item_cells(&w, wr, dhin, r0, nr, t);
        rnnb_block_product(&w, r0, nr, t, nq);
#endif
    }
}

/* out[z][c] = sum over rows r (in order) of a[z][r][c] (times m[z][r][c] with has_m), into arena storage:
 * the bias and peephole gradients, sums over the whole sequence. a, m: compute-type scratch at element
 * strides (batch, row; columns contiguous). */
KERNEL rnnb_colsum(i64 rows, i64 cols, i64 batch, GLOBAL uchar* ab, i64 ao, i64 a_bs, i64 a_rs, GLOBAL uchar* mb,
                   i64 mo, i64 m_bs, i64 m_rs, int has_m, GLOBAL uchar* ob, i64 oo, i64 o_bs)
{
    const i64 c = GID(0);
    if (c >= cols)
        return;
    GLOBAL const real* a = AT(real, ab, ao);
    GLOBAL const real* m = AT(real, mb, mo);
    for (i64 z = GID(2); z < batch; z += GSIZE(2)) {
        real s = (real)0;
        for (i64 r = 0; r < rows; ++r)
            s += a[z * a_bs + r * a_rs + c] * (has_m ? m[z * m_bs + r * m_rs + c] : (real)1);
        STORE(AT(uchar, ob, oo), z * o_bs + c, s);
    }
}

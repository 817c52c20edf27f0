/* causal_conv1d and its backward (ABI.md §10, with §8's packed sequences, carried state and slots): the
 * depthwise causal convolution of width W (2..8) before every Mamba / Gated DeltaNet scan, one text for
 * every target.
 *
 * Tokens are numbered flat: b * S + t, or with varlen the one batch row's tokens, in which row r (a packed
 * sequence) holds cu[r] .. cu[r+1]-1. Per row and channel d the inputs are extended on the left by W-1
 * values, the row's state entry (oldest first; entry slots[r] with slots) or zeros: e. Then
 * y[t] = bias[d] + sum_w weight[d,w] * e[t+w], silu'd, and with carry the last W-1 values of e are the row's
 * final state.
 *
 * Work-item (d, c) owns channel d of the tokens of chunk c, [c*T, (c+1)*T) (T >= 1, a launch argument),
 * walking them in order with the last W values of e in registers; a chunk crosses sequence boundaries as
 * the tokens do. The decode step (S = 1, carried state) is the same kernel: one launch straight on the pool.
 * The state entries are read in place and written in place, so exactly one work-item may touch an entry:
 * the first W-1 tokens of a sequence always go to the item holding its first token (conv_boundary), the only
 * one whose window reaches into the state, and that item writes the final state too, reading the row's last
 * W-1 values of e (x, or state values for a row shorter than W-1) before it writes (the item holding the last
 * token of a longer row would race with the reader).
 *
 * Runtime flags (uniform over the launch): carry (state present), varlen (cu_seqlens), slotted
 * (state_slots), state_real (the state stored in the compute type: f32 state of a 16-bit thunk; else in the
 * thunk's dtype), has_bias, silu. Private windows are CONV_WIDTH_MAX long and aligned at their newest end
 * (index CONV_WIDTH_MAX-1 is the current token), so every index is a constant once the loops unroll; the
 * slots below the width's are never summed (a select, not a zero weight: 0 * NaN is NaN). */
#define CONV_WIDTH_MAX 8

/* One row: its tokens first .. end-1 and its state entry. */
typedef struct {
    i64 first, end, entry;
} conv_row;

/* The int32 tensor at byte offset o of b (cu_seqlens, state_slots), or null where its field is absent. */
DEVICE_FN GLOBAL const int* conv_ints(int present, GLOBAL uchar* b, i64 o) { return present ? AT(int, b, o) : 0; }

/* The row of token tok < total: tok / S, or with varlen (cu non-null) the largest r with cu[r] <= tok,
 * which is non-empty. */
DEVICE_FN i64 conv_row_of(i64 tok, i64 R, i64 S, GLOBAL const int* cu)
{
    if (!cu)
        return tok / S;
    i64 lo = 0, hi = R; /* cu[lo] <= tok < cu[hi] */
    while (hi - lo > 1) {
        const i64 mid = (lo + hi) / 2;
        if ((i64)cu[mid] <= tok)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

DEVICE_FN conv_row conv_row_at(i64 r, i64 S, GLOBAL const int* cu, GLOBAL const int* slots)
{
    conv_row row;
    row.first = cu ? (i64)cu[r] : r * S;
    row.end = cu ? (i64)cu[r + 1] : row.first + S;
    row.entry = slots ? (i64)slots[r] : r;
    return row;
}

/* Where the work at chunk boundary b starts: b, unless b lies strictly inside the first W-1 tokens of a
 * sequence; those then stay with the chunk holding the sequence's first token. */
DEVICE_FN i64 conv_boundary(i64 b, i64 total, i64 R, i64 S, i64 W, GLOBAL const int* cu)
{
    if (b >= total)
        return total;
    const conv_row row = conv_row_at(conv_row_of(b, R, S, cu), S, cu, 0);
    const i64 head = row.first + W - 1 < row.end ? row.first + W - 1 : row.end;
    return b > row.first && b < head ? head : b;
}

/* e at token p of `row` (p >= row.first - (W-1)): x, or before the row's first token its state entry
 * (zero without carry). */
DEVICE_FN real conv_input(GLOBAL const store_t* x, GLOBAL const uchar* st, conv_row row, i64 p, i64 d, i64 D,
                          i64 W, int carry, int state_real)
{
    if (p >= row.first)
        return LOAD(x, p * D + d);
    return carry ? load_any(st, (row.entry * D + d) * (W - 1) + p - row.first + W - 1, state_real) : (real)0;
}

/* weight[d, :] aligned at the newest end: taps[CONV_WIDTH_MAX-1-k] = weight[d, W-1-k]; 0 below. */
DEVICE_FN void conv_taps(GLOBAL const store_t* weight, i64 d, i64 W, real* taps)
{
    PRAGMA_UNROLL
    for (int j = 0; j < CONV_WIDTH_MAX; ++j)
        taps[j] = j >= CONV_WIDTH_MAX - W ? LOAD(weight, d * W + j - (CONV_WIDTH_MAX - W)) : (real)0;
}

/* bias + sum of the taps times the window (both aligned at the newest end), over the W newest slots. */
DEVICE_FN real conv_dot(const real* taps, const real* win, i64 W, real bias)
{
    real acc = bias;
    PRAGMA_UNROLL
    for (int j = 0; j < CONV_WIDTH_MAX; ++j)
        acc += j >= CONV_WIDTH_MAX - W ? taps[j] * win[j] : (real)0;
    return acc;
}

DEVICE_FN real conv_silu(real u) { return u / ((real)1 + exp(-u)); }

/* d silu / du times g, at the pre-activation u: g * s * (1 + u * (1 - s)), s = sigmoid(u). */
DEVICE_FN real conv_silu_back(real u, real g)
{
    const real s = (real)1 / ((real)1 + exp(-u));
    return g * s * ((real)1 + u * ((real)1 - s));
}

/* dst of the tokens of chunk c (every target); with carry the final state of each row ending in it. */
KERNEL causal_conv1d(i64 R, i64 S, i64 D, i64 W, i64 T, int carry, int varlen, int slotted, int state_real,
                     int has_bias, int silu, GLOBAL uchar* xb, i64 xo, GLOBAL uchar* wb, i64 wo, GLOBAL uchar* biasb,
                     i64 biaso, GLOBAL uchar* stb, i64 sto, GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo,
                     GLOBAL uchar* db, i64 dof)
{
    const i64 d = GID(0), c = GID(1), total = varlen ? S : R * S;
    if (d >= D || c * T >= total)
        return;
    GLOBAL const int *cu = conv_ints(varlen, cub, cuo), *slots = conv_ints(slotted, slb, slo);
    GLOBAL const store_t* x = AT(store_t, xb, xo);
    GLOBAL uchar* st = AT(uchar, stb, sto);
    GLOBAL store_t* dst = AT(store_t, db, dof);
    real taps[CONV_WIDTH_MAX], win[CONV_WIDTH_MAX];
    conv_taps(AT(store_t, wb, wo), d, W, taps);
    const real bias = has_bias ? LOAD(AT(store_t, biasb, biaso), d) : (real)0;
    const i64 last = (c + 1) * T < total ? (c + 1) * T : total;
    i64 tok = conv_boundary(c * T, total, R, S, W, cu);
    const i64 stop = conv_boundary(last, total, R, S, W, cu);
    while (tok < stop) {
        const conv_row row = conv_row_at(conv_row_of(tok, R, S, cu), S, cu, slots);
        const i64 hi = row.end < stop ? row.end : stop;
        /* the item holding the row's first token is the only one reading its state entry: it alone writes the
         * final state too (the last W-1 values of e, read before anything is written) */
        const int owner = carry && tok == row.first;
        real fin[CONV_WIDTH_MAX];
        PRAGMA_UNROLL
        for (int j = 0; j < CONV_WIDTH_MAX; ++j) { /* e(tok - W + 1) .. e(tok - 1) at slots M-W+1 .. M-1 */
            win[j] = j > CONV_WIDTH_MAX - W ? conv_input(x, st, row, tok - (CONV_WIDTH_MAX - j), d, D, W, carry,
                                                         state_real) : (real)0;
            fin[j] = owner && j > CONV_WIDTH_MAX - W ? conv_input(x, st, row, row.end - (CONV_WIDTH_MAX - j), d, D, W,
                                                                  carry, state_real) : (real)0;
        }
        for (; tok < hi; ++tok) {
            PRAGMA_UNROLL
            for (int j = 0; j < CONV_WIDTH_MAX - 1; ++j)
                win[j] = win[j + 1];
            win[CONV_WIDTH_MAX - 1] = LOAD(x, tok * D + d);
            const real y = conv_dot(taps, win, W, bias);
            STORE(dst, tok * D + d, silu ? conv_silu(y) : y);
        }
        if (owner) { /* the last W-1 values of e, oldest first */
            PRAGMA_UNROLL
            for (int j = 0; j < CONV_WIDTH_MAX; ++j)
                if (j > CONV_WIDTH_MAX - W)
                    store_any(st, (row.entry * D + d) * (W - 1) + j - (CONV_WIDTH_MAX - W + 1), state_real, fin[j]);
        }
    }
}

/* The backward's g = d_dst * act'(pre) at token t of `row`, its window win (newest at the end). */
DEVICE_FN real conv_grad(const real* taps, const real* win, i64 W, real bias, int silu, real dy)
{
    return silu ? conv_silu_back(conv_dot(taps, win, W, bias), dy) : dy;
}

/* d_x of the tokens of chunk c (every target), and the chunk's sums of d_weight's and d_bias's terms into
 * part [chunks, D, W+1] (compute type, scratch): part[c, d, w] = sum_t g[t] e[t+w], part[c, d, W] = sum_t g[t],
 * over the chunk's tokens in descending order. d_x[t] = sum_k weight[W-1-k] g[t+k] (tokens t+k of t's
 * sequence), plus, with carry, d_state (the final state's gradient) at the sequence's last W-1 tokens. Each
 * sequence piece is walked from W-1 tokens past its end (their g only) down to its first token, the window
 * of e and the g of the W-1 tokens after t in registers. Reads d_state, writes none of it. */
KERNEL causal_conv1d_backward_dx(i64 R, i64 S, i64 D, i64 W, i64 T, int carry, int varlen, int slotted,
                                 int state_real, int has_bias, int silu, GLOBAL uchar* xb, i64 xo, GLOBAL uchar* wb,
                                 i64 wo, GLOBAL uchar* biasb, i64 biaso, GLOBAL uchar* stb, i64 sto, GLOBAL uchar* cub,
                                 i64 cuo, GLOBAL uchar* slb, i64 slo, GLOBAL uchar* ddb, i64 ddo, GLOBAL uchar* dsb,
                                 i64 dso, GLOBAL uchar* dxb, i64 dxo, GLOBAL uchar* pb, i64 po)
{
    const i64 d = GID(0), c = GID(1), total = varlen ? S : R * S;
    if (d >= D || c * T >= total)
        return;
    GLOBAL const int *cu = conv_ints(varlen, cub, cuo), *slots = conv_ints(slotted, slb, slo);
    GLOBAL const store_t* x = AT(store_t, xb, xo);
    GLOBAL const store_t* dy = AT(store_t, ddb, ddo);
    GLOBAL const uchar* st = AT(uchar, stb, sto);
    GLOBAL const uchar* ds = AT(uchar, dsb, dso);
    GLOBAL store_t* dx = AT(store_t, dxb, dxo);
    real taps[CONV_WIDTH_MAX], win[CONV_WIDTH_MAX], ahead[CONV_WIDTH_MAX], sums[CONV_WIDTH_MAX];
    conv_taps(AT(store_t, wb, wo), d, W, taps);
    const real bias = has_bias ? LOAD(AT(store_t, biasb, biaso), d) : (real)0;
    real sum_g = (real)0;
    PRAGMA_UNROLL
    for (int j = 0; j < CONV_WIDTH_MAX; ++j)
        sums[j] = (real)0;
    const i64 stop = (c + 1) * T < total ? (c + 1) * T : total;
    for (i64 lo = c * T; lo < stop;) {
        const conv_row row = conv_row_at(conv_row_of(lo, R, S, cu), S, cu, slots);
        const i64 hi = row.end < stop ? row.end : stop, top = hi + W - 1 < row.end ? hi + W - 1 : row.end;
        PRAGMA_UNROLL
        for (int j = 0; j < CONV_WIDTH_MAX; ++j) { /* e(top - W + 1) .. e(top - 1) at slots M-W .. M-2 */
            win[j] = j >= CONV_WIDTH_MAX - W && j < CONV_WIDTH_MAX - 1
                ? conv_input(x, st, row, top - (CONV_WIDTH_MAX - 1 - j), d, D, W, carry, state_real) : (real)0;
            ahead[j] = (real)0;
        }
        for (i64 t = top - 1; t >= lo; --t) {
            const real fresh = conv_input(x, st, row, t - W + 1, d, D, W, carry, state_real);
            PRAGMA_UNROLL
            for (int j = CONV_WIDTH_MAX - 1; j > 0; --j) {
                win[j] = j == CONV_WIDTH_MAX - W ? fresh : win[j - 1];
                ahead[j] = ahead[j - 1];
            }
            if (CONV_WIDTH_MAX == W)
                win[0] = fresh;
            const real g = conv_grad(taps, win, W, bias, silu, LOAD(dy, t * D + d));
            ahead[0] = g; /* ahead[k] = g[t + k] */
            if (t >= hi)
                continue;
            real acc = carry && t >= row.end - (W - 1)
                ? load_any(ds, (row.entry * D + d) * (W - 1) + t - row.end + W - 1, state_real) : (real)0;
            PRAGMA_UNROLL
            for (int k = 0; k < CONV_WIDTH_MAX; ++k)
                acc += k < W && t + k < row.end ? taps[CONV_WIDTH_MAX - 1 - k] * ahead[k] : (real)0;
            STORE(dx, t * D + d, acc);
            PRAGMA_UNROLL
            for (int j = 0; j < CONV_WIDTH_MAX; ++j)
                sums[j] += j >= CONV_WIDTH_MAX - W ? g * win[j] : (real)0;
            sum_g += g;
        }
        lo = hi;
    }
    GLOBAL real* part = AT(real, pb, po) + (c * D + d) * (W + 1);
    PRAGMA_UNROLL
    for (int j = 0; j < CONV_WIDTH_MAX; ++j)
        if (j >= CONV_WIDTH_MAX - W)
            part[j - (CONV_WIDTH_MAX - W)] = sums[j];
    part[W] = sum_g;
}

/* d_weight[d, :] and d_bias[d] (with has_bias): the chunks' sums (causal_conv1d_backward_dx's part) added in
 * chunk order, one work-item per channel: the same bytes on every run. */
KERNEL causal_conv1d_backward_weight(i64 D, i64 W, i64 chunks, int has_bias, GLOBAL uchar* pb, i64 po,
                                     GLOBAL uchar* dwb, i64 dwo, GLOBAL uchar* dbb, i64 dbo)
{
    const i64 d = GID(0);
    if (d >= D)
        return;
    GLOBAL const real* part = AT(real, pb, po);
    for (i64 w = 0; w <= W; ++w) {
        real acc = (real)0;
        for (i64 c = 0; c < chunks; ++c)
            acc += part[(c * D + d) * (W + 1) + w];
        if (w < W)
            STORE(AT(store_t, dwb, dwo), d * W + w, acc);
        else if (has_bias)
            STORE(AT(store_t, dbb, dbo), d, acc);
    }
}

/* Launched with carry only, after causal_conv1d_backward_dx: the initial state's gradient of row r, channel d, over its
 * final state's gradient in place (d_state, entry slots[r] with slots). Position k < W-1 of e gets
 * sum_{w <= k} weight[w] g[k-w] over the row's first tokens, plus d_state[k - L] where the row's L tokens
 * are fewer than W-1 (the final state then still holds initial values). An empty row leaves its entry as it
 * is (its gradient passes through). */
KERNEL causal_conv1d_backward_state(i64 R, i64 S, i64 D, i64 W, int varlen, int slotted, int state_real,
                                    int has_bias, int silu, GLOBAL uchar* xb, i64 xo, GLOBAL uchar* wb, i64 wo,
                                    GLOBAL uchar* biasb, i64 biaso, GLOBAL uchar* stb, i64 sto, GLOBAL uchar* cub,
                                    i64 cuo, GLOBAL uchar* slb, i64 slo, GLOBAL uchar* ddb, i64 ddo,
                                    GLOBAL uchar* dsb, i64 dso)
{
    const i64 d = GID(0), r = GID(1);
    if (d >= D || r >= R)
        return;
    const conv_row row = conv_row_at(r, S, conv_ints(varlen, cub, cuo), conv_ints(slotted, slb, slo));
    const i64 length = row.end - row.first;
    if (length == 0)
        return;
    GLOBAL const store_t* x = AT(store_t, xb, xo);
    GLOBAL const store_t* dy = AT(store_t, ddb, ddo);
    GLOBAL const uchar* st = AT(uchar, stb, sto);
    GLOBAL uchar* ds = AT(uchar, dsb, dso);
    GLOBAL const store_t* weight = AT(store_t, wb, wo);
    real taps[CONV_WIDTH_MAX], first[CONV_WIDTH_MAX], win[CONV_WIDTH_MAX], g[CONV_WIDTH_MAX], out[CONV_WIDTH_MAX];
    conv_taps(weight, d, W, taps);
    PRAGMA_UNROLL
    for (int w = 0; w < CONV_WIDTH_MAX; ++w) /* weight[d, :] oldest first, as e's positions meet it */
        first[w] = w < W ? LOAD(weight, d * W + w) : (real)0;
    const real bias = has_bias ? LOAD(AT(store_t, biasb, biaso), d) : (real)0;
    PRAGMA_UNROLL
    for (int k = 0; k < CONV_WIDTH_MAX - 1; ++k) { /* g of the row's first min(L, W-1) tokens */
        g[k] = (real)0;
        if (k < W - 1 && k < length) {
            const i64 tok = row.first + k;
            PRAGMA_UNROLL
            for (int j = 0; j < CONV_WIDTH_MAX; ++j)
                win[j] = j >= CONV_WIDTH_MAX - W
                    ? conv_input(x, st, row, tok - (CONV_WIDTH_MAX - 1 - j), d, D, W, 1, state_real) : (real)0;
            g[k] = conv_grad(taps, win, W, bias, silu, LOAD(dy, tok * D + d));
        }
    }
    const i64 base = (row.entry * D + d) * (W - 1);
    PRAGMA_UNROLL
    for (int k = 0; k < CONV_WIDTH_MAX - 1; ++k) {
        out[k] = k < W - 1 && k >= length ? load_any(ds, base + k - length, state_real) : (real)0;
        PRAGMA_UNROLL
        for (int i = 0; i <= k; ++i) /* token i of the row meets tap w = k - i */
            out[k] += k < W - 1 && i < length ? first[k - i] * g[i] : (real)0;
    }
    PRAGMA_UNROLL
    for (int k = 0; k < CONV_WIDTH_MAX - 1; ++k)
        if (k < W - 1)
            store_any(ds, base + k, state_real, out[k]);
}

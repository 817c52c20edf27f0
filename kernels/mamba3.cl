/* mamba3 (ABI.md §11): Mamba-3 SISO, the trapezoidal, rotary-state SSM, as a step recurrence over the tokens of
 * each (sequence, head), one text for every target.
 *
 * Per token t of a row (a batch row, or one cu_seqlens sequence) and head h, group g = h / (H/G), with the
 * carried (theta, S, kbar, vbar): lambda = sigmoid(trap), alpha = exp(adt), beta = (1 - lambda)*dt*alpha,
 * gamma = lambda*dt; theta[i] += pi*tanh(angles[i])*dt (i < A); qr, kr = q[g] + q_bias[h], k[g] + k_bias[h]
 * with each adjacent pair i < A turned by theta[i]; S[p,n] = alpha*S[p,n] + beta*vbar[p]*kbar[n] +
 * gamma*v[p]*kr[n]; y[p] = sum_n S[p,n]*qr[n] (+ d[h]*v[p], then * silu(z[p])); kbar = kr, vbar = v.
 *
 * The angle is kept reduced to [0, 2pi) after every step (only its cos and sin enter), so the f32 sine and
 * cosine below need no long-argument reduction (CUDA's sinf would bring a stack frame for it), and the
 * written angle is the reduced one, theta - 2pi*floor(theta/2pi) as §11 writes it.
 *
 * Runtime flags (uniform over a launch, the planner's: launches/mamba3.py): has_q_bias, has_k_bias, has_d,
 * has_z, carry (the four state tensors present, read as each row's initial state and written with its final
 * one), varlen (cu_seqlens), slotted (state_slots: row r uses entry slots[r] of all four), dt_real and
 * param_real (adt dt trap angles / q_bias k_bias d stored in the compute type: f32 beside a 16-bit thunk;
 * else in the thunk's dtype). The state tensors are always in the compute type (state_dtype f32, or f64 for
 * an f64 thunk; a wider one runs on the host). An empty sequence leaves its entries as they are.
 *
 * cpu (PoCL): one work-item per M3_PB state rows of one (row, head), each turning q and k itself; the items of
 * a (row, head) share one work-group, whose barrier orders every item's read of the initial angle and key
 * before the first item writes the final ones. gpu: kernels mamba3_lanes and mamba3_lanes_final, below. */

#define M3_PI ((real)3.14159265358979323846)
#define M3_TWO_PI ((real)6.28318530717958647692)

/* Every tensor of the op and its flags, as the kernels find them in their arguments. */
typedef struct {
    GLOBAL const store_t* q;
    GLOBAL const store_t* k;
    GLOBAL const store_t* v;
    GLOBAL const store_t* z;
    GLOBAL store_t* dst;
    GLOBAL const uchar* adt;
    GLOBAL const uchar* dt;
    GLOBAL const uchar* trap;
    GLOBAL const uchar* angles;
    GLOBAL const uchar* q_bias;
    GLOBAL const uchar* k_bias;
    GLOBAL const uchar* d;
    GLOBAL real* angle_state;
    GLOBAL real* state;
    GLOBAL real* k_state;
    GLOBAL real* v_state;
    GLOBAL const int* cu;
    GLOBAL const int* slots;
    i64 H, P, N, A, G;
    int has_q_bias, has_k_bias, has_d, has_z, carry, dt_real, param_real;
} m3_io;

/* One row of one head: its tokens first .. end-1, its entry of the state tensors, its group of q and k. */
typedef struct {
    i64 first, end, entry, h, g;
} m3_row;

/* The coefficients of one token: alpha, beta, gamma, and its dt (the angle's step). */
typedef struct {
    real alpha, beta, gamma, dt;
} m3_coeffs;

/* One adjacent pair of the turned, biased q and k. */
typedef struct {
    real q0, q1, k0, k1;
} m3_pair;

/* cos and sin of one angle. */
typedef struct {
    real c, s;
} m3_turn;

/* floor(x). f32: in plain arithmetic below 2^23 (above it every f32 is an integer; NaN goes there too), where the
 * library's is an opaque call on PoCL (as rlx_exp's floor is). */
INLINE_FN real m3_floor(real x)
{
    if (sizeof(real) != 4)
        return floor(x);
    const float f = (float)x, t = (float)(int)(fabs(f) < 8388608.0f ? f : 0.0f);
    return (real)(fabs(f) < 8388608.0f ? (t > f ? t - 1.0f : t) : f);
}

INLINE_FN real m3_wrap(real theta) { return theta - M3_TWO_PI * m3_floor(theta / M3_TWO_PI); }

/* tanh(x) = 1 - 2/(1 + exp(2x)) through the fast exp (absolute error ~1e-7 in f32: the angle's step is absolute);
 * +-1 where that exp clamps or overflows, NaN carried. */
INLINE_FN real m3_tanh(real x) { return (real)1 - (real)2 / ((real)1 + rlx_exp((real)2 * x)); }

/* cos and sin of theta in [0, 2pi] (or NaN, carried). f64 (any non-f32 compute type): the library's. f32: Cephes'
 * sinf/cosf in plain arithmetic (octant by floor, a three-part Cody-Waite reduction to [-pi/4, pi/4], degree-7 and
 * -8 polynomials; ~1 ulp): no stack on CUDA and inlined and vectorized on PoCL. The octant is a float, so a NaN
 * stays in float arithmetic. */
INLINE_FN m3_turn m3_sincos(real theta)
{
    m3_turn out;
    if (sizeof(real) != 4) {
        out.c = cos(theta);
        out.s = sin(theta);
        return out;
    }
    const float x = (float)theta;
    float j = (float)m3_floor(x * 1.27323954473516268615f); /* 4/pi */
    j += j - 2.0f * (float)m3_floor(j * 0.5f);                /* odd octants round up: x = j*pi/4 + r */
    const float r = ((x - j * 0.78515625f) - j * 2.4187564849853515625e-4f) - j * 3.77489497744594108e-8f;
    const float z = r * r;
    const float sr = r + r * z * ((-1.9515295891E-4f * z + 8.3321608736E-3f) * z - 1.6666654611E-1f);
    const float cr = 1.0f - 0.5f * z + z * z * ((2.443315711809948E-5f * z - 1.388731625493765E-3f) * z
                                                  + 4.166664568298827E-2f);
    const float quadrant = j * 0.5f - 4.0f * (float)m3_floor(j * 0.125f); /* x = quadrant*pi/2 + r, quadrant 0..3 */
    out.s = (real)(quadrant == 0.0f ? sr : quadrant == 1.0f ? cr : quadrant == 2.0f ? -sr : -cr);
    out.c = (real)(quadrant == 0.0f ? cr : quadrant == 1.0f ? -sr : quadrant == 2.0f ? -cr : sr);
    return out;
}

/* An m3_io is built by groups of the kernels' arguments, so that a kernel takes only the groups it reads
 * (mamba3_backward's kernels: launches/mamba3.py): m3_io_base, then the m3_with_* of each group; a tensor
 * of no group given stays null, its flag off. */

/* The sizes, the carry and element-type flags, and each token's step dt (every kernel reads it). */
INLINE_FN m3_io m3_io_base(i64 H, i64 P, i64 N, i64 A, i64 G, int carry, int dt_real, int param_real,
                           GLOBAL uchar* dtb, i64 dto)
{
    m3_io io = {0};
    io.H = H;
    io.P = P;
    io.N = N;
    io.A = A;
    io.G = G;
    io.carry = carry;
    io.dt_real = dt_real;
    io.param_real = param_real;
    io.dt = AT(uchar, dtb, dto);
    return io;
}

/* q and k, and their biases (has_q_bias, has_k_bias): what the turning of a pair reads beside the angle. */
INLINE_FN m3_io m3_with_qk(m3_io io, int has_q_bias, int has_k_bias, GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb,
                           i64 ko, GLOBAL uchar* qbb, i64 qbo, GLOBAL uchar* kbb, i64 kbo)
{
    io.has_q_bias = has_q_bias;
    io.has_k_bias = has_k_bias;
    io.q = AT(store_t, qb, qo);
    io.k = AT(store_t, kb, ko);
    io.q_bias = AT(uchar, qbb, qbo);
    io.k_bias = AT(uchar, kbb, kbo);
    return io;
}

/* adt and trap, which with dt give a token's coefficients (m3_coeffs_at). */
INLINE_FN m3_io m3_with_coeffs(m3_io io, GLOBAL uchar* adtb, i64 adto, GLOBAL uchar* trb, i64 tro)
{
    io.adt = AT(uchar, adtb, adto);
    io.trap = AT(uchar, trb, tro);
    return io;
}

/* v, and what finishes y: d (has_d) and the gate z (has_z). */
INLINE_FN m3_io m3_with_values(m3_io io, int has_d, int has_z, GLOBAL uchar* vb, i64 vo, GLOBAL uchar* zb, i64 zo,
                               GLOBAL uchar* skb, i64 sko)
{
    io.has_d = has_d;
    io.has_z = has_z;
    io.v = AT(store_t, vb, vo);
    io.z = AT(store_t, zb, zo);
    io.d = AT(uchar, skb, sko);
    return io;
}

/* The carried S, k-bar and v-bar (with carry). */
INLINE_FN m3_io m3_with_state(m3_io io, GLOBAL uchar* stb, i64 sto, GLOBAL uchar* ksb, i64 kso, GLOBAL uchar* vsb,
                              i64 vso)
{
    io.state = AT(real, stb, sto);
    io.k_state = AT(real, ksb, kso);
    io.v_state = AT(real, vsb, vso);
    return io;
}

/* Where the rows are: cu_seqlens (varlen) and state_slots (slotted). */
INLINE_FN m3_io m3_with_rows(m3_io io, int varlen, GLOBAL uchar* cub, i64 cuo, int slotted, GLOBAL uchar* slb, i64 slo)
{
    io.cu = varlen ? AT(int, cub, cuo) : 0;
    io.slots = slotted ? AT(int, slb, slo) : 0;
    return io;
}

/* Every group: the forward's arguments. */
INLINE_FN m3_io m3_io_of(i64 H, i64 P, i64 N, i64 A, i64 G, int has_q_bias, int has_k_bias, int has_d, int has_z,
                         int carry, int varlen, int slotted, int dt_real, int param_real,
                         GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo,
                         GLOBAL uchar* zb, i64 zo, GLOBAL uchar* db, i64 dof, GLOBAL uchar* adtb, i64 adto,
                         GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* trb, i64 tro, GLOBAL uchar* anb, i64 ano,
                         GLOBAL uchar* qbb, i64 qbo, GLOBAL uchar* kbb, i64 kbo, GLOBAL uchar* skb, i64 sko,
                         GLOBAL uchar* asb, i64 aso, GLOBAL uchar* stb, i64 sto, GLOBAL uchar* ksb, i64 kso,
                         GLOBAL uchar* vsb, i64 vso, GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo)
{
    m3_io io = m3_io_base(H, P, N, A, G, carry, dt_real, param_real, dtb, dto);
    io = m3_with_qk(io, has_q_bias, has_k_bias, qb, qo, kb, ko, qbb, qbo, kbb, kbo);
    io = m3_with_coeffs(io, adtb, adto, trb, tro);
    io = m3_with_values(io, has_d, has_z, vb, vo, zb, zo, skb, sko);
    io = m3_with_state(io, stb, sto, ksb, kso, vsb, vso);
    io = m3_with_rows(io, varlen, cub, cuo, slotted, slb, slo);
    io.angles = AT(uchar, anb, ano);
    io.angle_state = AT(real, asb, aso);
    io.dst = AT(store_t, db, dof);
    return io;
}

DEVICE_FN m3_row m3_row_of(m3_io io, i64 r, i64 h, i64 S)
{
    m3_row row;
    row.first = io.cu ? (i64)io.cu[r] : r * S;
    row.end = io.cu ? (i64)io.cu[r + 1] : row.first + S;
    row.entry = io.slots ? (i64)io.slots[r] : r;
    row.h = h;
    row.g = h / (io.H / io.G);
    return row;
}

INLINE_FN m3_coeffs m3_coeffs_at(m3_io io, i64 tok, i64 h)
{
    const i64 at = tok * io.H + h;
    const real dt = load_any(io.dt, at, io.dt_real), lambda = (real)1 / ((real)1 + rlx_exp(-load_any(io.trap, at, io.dt_real)));
    m3_coeffs out;
    out.alpha = rlx_exp(load_any(io.adt, at, io.dt_real));
    out.beta = ((real)1 - lambda) * dt * out.alpha;
    out.gamma = lambda * dt;
    out.dt = dt;
    return out;
}

/* The angle i of head h after token tok (dt its step), reduced to [0, 2pi). */
INLINE_FN real m3_advance(m3_io io, real theta, i64 tok, i64 h, i64 i, real dt)
{
    return m3_wrap(theta + M3_PI * m3_tanh(load_any(io.angles, (tok * io.H + h) * io.A + i, io.dt_real)) * dt);
}

/* Pair i (values 2i, 2i+1) of token tok's q and k of `row`, biased, and turned by the angle whose cos and sin are
 * `t` when i < A (a select: a pair past 2A keeps its values exactly, an Inf or NaN in one of them unspread). */
INLINE_FN m3_pair m3_pair_at(m3_io io, m3_row row, i64 tok, i64 i, m3_turn t)
{
    const i64 at = (tok * io.G + row.g) * io.N + 2 * i, bias_at = row.h * io.N + 2 * i;
    real q0 = LOAD(io.q, at), q1 = LOAD(io.q, at + 1), k0 = LOAD(io.k, at), k1 = LOAD(io.k, at + 1);
    if (io.has_q_bias) {
        q0 += load_any(io.q_bias, bias_at, io.param_real);
        q1 += load_any(io.q_bias, bias_at + 1, io.param_real);
    }
    if (io.has_k_bias) {
        k0 += load_any(io.k_bias, bias_at, io.param_real);
        k1 += load_any(io.k_bias, bias_at + 1, io.param_real);
    }
    const int turned = i < io.A;
    m3_pair out;
    out.q0 = turned ? q0 * t.c - q1 * t.s : q0;
    out.q1 = turned ? q0 * t.s + q1 * t.c : q1;
    out.k0 = turned ? k0 * t.c - k1 * t.s : k0;
    out.k1 = turned ? k0 * t.s + k1 * t.c : k1;
    return out;
}

/* y as §11 step 5 finishes it at element `at` of v, z and dst: plus d[h]*v, then times silu(z); stored. */
INLINE_FN void m3_store(m3_io io, i64 at, i64 h, real y, real v)
{
    if (io.has_d)
        y += load_any(io.d, h, io.param_real) * v;
    if (io.has_z) {
        const real z = LOAD(io.z, at);
        y *= z / ((real)1 + rlx_exp(-z));
    }
    STORE(io.dst, at, y);
}

#ifdef RLX_TARGET_CPU
/* The initial state of the item's rows p0 .. p0+np-1 (zero without carry): s[n*M3_PB + c] = S[p0+c, n], vbar. */
INLINE_FN void m3_load_rows(m3_io io, m3_row row, i64 p0, int np, real* s, real* vbar)
{
    const i64 base = (row.entry * io.H + row.h) * io.P + p0;
    for (i64 n = 0; n < io.N; ++n)
        PRAGMA_UNROLL
        for (int c = 0; c < M3_PB; ++c)
            s[n * M3_PB + c] = io.carry && c < np ? io.state[(base + c) * io.N + n] : (real)0;
    PRAGMA_UNROLL
    for (int c = 0; c < M3_PB; ++c)
        vbar[c] = io.carry && c < np ? io.v_state[base + c] : (real)0;
}

/* One token of the item's rows: S updated in place, y stored, vbar = v (kr, qr: this token's turned k and q;
 * kbar: the previous token's). */
INLINE_FN void m3_rows_step(m3_io io, m3_row row, i64 tok, i64 p0, int np, m3_coeffs cf, const real* qr,
                            const real* kr, const real* kbar, real* s, real* vbar)
{
    const i64 at = (tok * io.H + row.h) * io.P + p0;
    real xv[M3_PB], bv[M3_PB], gv[M3_PB], y0[M3_PB], y1[M3_PB];
    PRAGMA_UNROLL
    for (int c = 0; c < M3_PB; ++c) {
        xv[c] = c < np ? LOAD(io.v, at + c) : (real)0;
        bv[c] = cf.beta * vbar[c];
        gv[c] = cf.gamma * xv[c];
        y0[c] = y1[c] = (real)0;
    }
    for (i64 n = 0; n < io.N; ++n) {
        const real kb = kbar[n], kn = kr[n];
        PRAGMA_UNROLL
        for (int c = 0; c < M3_PB; ++c)
            s[n * M3_PB + c] = cf.alpha * s[n * M3_PB + c] + bv[c] * kb + gv[c] * kn;
    }
    for (i64 n = 0; n < io.N; n += 2) { /* N is even: two partial sums, not one serial chain */
        const real q0 = qr[n], q1 = qr[n + 1];
        PRAGMA_UNROLL
        for (int c = 0; c < M3_PB; ++c) {
            y0[c] += s[n * M3_PB + c] * q0;
            y1[c] += s[(n + 1) * M3_PB + c] * q1;
        }
    }
    for (int c = 0; c < np; ++c) {
        m3_store(io, at + c, row.h, y0[c] + y1[c], xv[c]);
        vbar[c] = xv[c];
    }
}

/* Token tok's turned q and k (qr, kr: N values) with the angles advanced by its step dt (theta: A values). The
 * angles first, in a loop of their own: it vectorizes. */
INLINE_FN void m3_turn_token(m3_io io, m3_row row, i64 tok, real dt, real* theta, real* qr, real* kr)
{
    real cs[STATE_MAX / 2], sn[STATE_MAX / 2];
    for (i64 i = 0; i < io.A; ++i) {
        theta[i] = m3_advance(io, theta[i], tok, row.h, i, dt);
        const m3_turn t = m3_sincos(theta[i]);
        cs[i] = t.c;
        sn[i] = t.s;
    }
    for (i64 i = io.A; i < io.N / 2; ++i) { /* unturned (m3_pair_at selects the raw values there) */
        cs[i] = (real)1;
        sn[i] = (real)0;
    }
    for (i64 i = 0; i < io.N / 2; ++i) {
        m3_turn t;
        t.c = cs[i];
        t.s = sn[i];
        const m3_pair pr = m3_pair_at(io, row, tok, i, t);
        qr[2 * i] = pr.q0;
        qr[2 * i + 1] = pr.q1;
        kr[2 * i] = pr.k0;
        kr[2 * i + 1] = pr.k1;
    }
}

/* Every token of `row` for the item's rows p0 .. p0+np-1 (np >= 1); theta and kbar (the angle and the previous
 * token's turned key, A and N values) carried in place. */
INLINE_FN void m3_walk(m3_io io, m3_row row, i64 p0, int np, real* theta, real* kbar, real* s, real* vbar)
{
    real qr[STATE_MAX], kr[STATE_MAX];
    for (i64 tok = row.first; tok < row.end; ++tok) {
        const m3_coeffs cf = m3_coeffs_at(io, tok, row.h);
        m3_turn_token(io, row, tok, cf.dt, theta, qr, kr);
        m3_rows_step(io, row, tok, p0, np, cf, qr, kr, kbar, s, vbar);
        for (i64 n = 0; n < io.N; ++n)
            kbar[n] = kr[n];
    }
}

/* A row of one token (decode) for the item's rows: each state row updated where it lies in `state` (the item's
 * own rows: read and written by it alone), y stored, v_state = v; theta and kbar as m3_walk leaves them. No
 * private copy of the state: its transposed load and store cost more than the step itself. */
INLINE_FN void m3_one_token(m3_io io, m3_row row, i64 p0, int np, real* theta, real* kbar)
{
    real qr[STATE_MAX], kr[STATE_MAX];
    const i64 tok = row.first, at = (tok * io.H + row.h) * io.P + p0, base = (row.entry * io.H + row.h) * io.P + p0;
    const m3_coeffs cf = m3_coeffs_at(io, tok, row.h);
    m3_turn_token(io, row, tok, cf.dt, theta, qr, kr);
    for (int c = 0; c < np; ++c) {
        GLOBAL real* st = io.state + (base + c) * io.N;
        const real xv = LOAD(io.v, at + c), gv = cf.gamma * xv;
        const real bv = cf.beta * (io.carry ? io.v_state[base + c] : (real)0);
        real y0 = (real)0, y1 = (real)0;
        for (i64 n = 0; n < io.N; n += 2) { /* N is even: two partial sums */
            const real s0 = cf.alpha * (io.carry ? st[n] : (real)0) + bv * kbar[n] + gv * kr[n];
            const real s1 = cf.alpha * (io.carry ? st[n + 1] : (real)0) + bv * kbar[n + 1] + gv * kr[n + 1];
            y0 += s0 * qr[n];
            y1 += s1 * qr[n + 1];
            if (io.carry) {
                st[n] = s0;
                st[n + 1] = s1;
            }
        }
        m3_store(io, at + c, row.h, y0 + y1, xv);
        if (io.carry)
            io.v_state[base + c] = xv;
    }
    for (i64 n = 0; n < io.N; ++n)
        kbar[n] = kr[n];
}

/* dst of rows p0 = GID(0)*M3_PB .. +M3_PB of head GID(1) of row GID(2); with carry their final state, and
 * (item 0) the final angle and key, after the work-group's barrier. */
KERNEL mamba3(i64 R, i64 S, i64 H, i64 P, i64 N, i64 A, i64 G, int has_q_bias, int has_k_bias, int has_d,
              int has_z, int carry, int varlen, int slotted, int dt_real, int param_real,
              GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo, GLOBAL uchar* zb, i64 zo,
              GLOBAL uchar* db, i64 dof, GLOBAL uchar* adtb, i64 adto, GLOBAL uchar* dtb, i64 dto,
              GLOBAL uchar* trb, i64 tro, GLOBAL uchar* anb, i64 ano, GLOBAL uchar* qbb, i64 qbo,
              GLOBAL uchar* kbb, i64 kbo, GLOBAL uchar* skb, i64 sko, GLOBAL uchar* asb, i64 aso,
              GLOBAL uchar* stb, i64 sto, GLOBAL uchar* ksb, i64 kso, GLOBAL uchar* vsb, i64 vso,
              GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo)
{
    const i64 p0 = GID(0) * M3_PB, h = GID(1), r = GID(2);
    const m3_io io = m3_io_of(
        H, P, N, A, G, has_q_bias, has_k_bias, has_d, has_z, carry, varlen, slotted, dt_real, param_real,
        qb, qo, kb, ko, vb, vo, zb, zo, db, dof, adtb, adto, dtb, dto, trb, tro, anb, ano, qbb, qbo, kbb,
        kbo, skb, sko, asb, aso, stb, sto, ksb, kso, vsb, vso, cub, cuo, slb, slo);
    const m3_row row = m3_row_of(io, r, h, S);
    /* rows of this item; none for an empty sequence (the whole group's: its entries stay as they are), whose
     * items still meet the barrier */
    const int np = p0 >= P || row.first == row.end ? 0 : P - p0 < M3_PB ? (int)(P - p0) : M3_PB;
    const i64 head = row.entry * H + h;
    const int one = row.end - row.first == 1; /* decode: the state rows updated where they lie */
    real s[STATE_MAX * M3_PB], vbar[M3_PB], theta[STATE_MAX / 2], kbar[STATE_MAX];
    if (np > 0) {
        for (i64 i = 0; i < A; ++i)
            theta[i] = carry ? m3_wrap(io.angle_state[head * A + i]) : (real)0;
        for (i64 n = 0; n < N; ++n)
            kbar[n] = carry ? io.k_state[head * N + n] : (real)0;
        if (one) {
            m3_one_token(io, row, p0, np, theta, kbar);
        } else {
            m3_load_rows(io, row, p0, np, s, vbar);
            m3_walk(io, row, p0, np, theta, kbar, s, vbar);
        }
    }
    BARRIER(); /* every item of the (row, head) has read the initial angle and key */
    if (!carry || np == 0)
        return;
    for (int c = 0; c < np && !one; ++c) {
        for (i64 n = 0; n < N; ++n)
            io.state[(head * P + p0 + c) * N + n] = s[n * M3_PB + c];
        io.v_state[head * P + p0 + c] = vbar[c];
    }
    if (p0 == 0) {
        for (i64 i = 0; i < A; ++i)
            io.angle_state[head * A + i] = theta[i];
        for (i64 n = 0; n < N; ++n)
            io.k_state[head * N + n] = kbar[n];
    }
}
#endif

#if defined(RLX_TARGET_GPU) && defined(SSM_N) /* a gpu program variant: SSM_N, SSM_L from its launch */
/* gpu: `blocks` work-groups per (row, head). A state row S[p, :] is spread over SSM_L lanes, SSM_W values each in
 * registers (lane nl holds n = w*SSM_L + nl), and the group's LSIZE/SSM_L rows walk the sequence together; a
 * group walks it again for each further block of rows it holds (the angles and keys recomputed: cheap beside the
 * state). With blocks = 1 (decode, short sequences) one group alone reads and writes the head's angle and key
 * entries, so a decode step is one launch; with blocks > 1 (prefill: more groups) every group only reads them
 * and mamba3_lanes_final writes them after.
 * Per token the lanes first turn q and k cooperatively into LOCAL memory (lane l owns pairs l, l + LSIZE, ...
 * and their angles, kept in LOCAL), a barrier, then each lane updates its state values and its partial sum of y,
 * a barrier, then the row's first lane sums and stores. kr is double-buffered by token parity: the other buffer
 * is the previous token's key (kbar; the initial one for the row's first token). Bounded to groups of at most SSM_WG
 * lanes, 6 per SM: 76-80 registers on sm_90 without a spill (108-114 unbounded). */
#define SSM_W (SSM_N / SSM_L)

/* One block of rows walking every token of `row`, this lane's row p (every lane of the group calls it: it meets two
 * barriers per token): the rows' outputs, and with carry their final state. theta starts from theta0 (the lane's
 * own pairs: no barrier needed) and ends as the final angle, kr's buffer of the last token as the final key. */
INLINE_FN void m3_lanes_block_barrier(m3_io io, m3_row row, i64 p, int nl, int first, int lane, LOCAL_PTR real* qr,
                                      LOCAL_PTR real* kr, LOCAL_PTR const real* kbar0, LOCAL_PTR real* theta,
                                      LOCAL_PTR const real* theta0, LOCAL_PTR real* part)
{
    const i64 lanes = LSIZE(0), head = row.entry * io.H + row.h;
    const int live = p < io.P;
    GLOBAL real* st = io.state + (head * io.P + (live ? p : 0)) * io.N;
    real s[SSM_W];
    PRAGMA_UNROLL
    for (int w = 0; w < SSM_W; ++w)
        s[w] = io.carry && live && w * SSM_L + nl < io.N ? st[w * SSM_L + nl] : (real)0;
    real vbar = io.carry && live ? io.v_state[head * io.P + p] : (real)0;
    for (i64 i = lane; i < io.N / 2; i += lanes)
        theta[i] = theta0[i];
    for (i64 tok = row.first; tok < row.end; ++tok) {
        const int cur = (int)((tok - row.first) & 1);
        const m3_coeffs cf = m3_coeffs_at(io, tok, row.h);
        for (i64 i = lane; i < io.N / 2; i += lanes) {
            if (i < io.A)
                theta[i] = m3_advance(io, theta[i], tok, row.h, i, cf.dt);
            const m3_pair pr = m3_pair_at(io, row, tok, i, m3_sincos(i < io.A ? theta[i] : (real)0));
            qr[2 * i] = pr.q0;
            qr[2 * i + 1] = pr.q1;
            kr[cur * SSM_N + 2 * i] = pr.k0;
            kr[cur * SSM_N + 2 * i + 1] = pr.k1;
        }
        BARRIER();
        LOCAL_PTR const real* kbar = tok == row.first ? kbar0 : kr + (1 - cur) * SSM_N;
        const i64 at = (tok * io.H + row.h) * io.P + p;
        const real xv = live ? LOAD(io.v, at) : (real)0, bv = cf.beta * vbar, gv = cf.gamma * xv;
        real y = (real)0;
        PRAGMA_UNROLL
        for (int w = 0; w < SSM_W; ++w) {
            const int n = w * SSM_L + nl;
            if (n < io.N) {
                s[w] = cf.alpha * s[w] + bv * kbar[n] + gv * kr[cur * SSM_N + n];
                y += s[w] * qr[n];
            }
        }
        part[lane] = y;
        BARRIER();
        if (live && nl == 0)
            m3_store(io, at, row.h, ssm_row_sum(part, first), xv);
        vbar = xv;
    }
    if (io.carry && live && row.end > row.first) {
        PRAGMA_UNROLL
        for (int w = 0; w < SSM_W; ++w)
            if (w * SSM_L + nl < io.N)
                st[w * SSM_L + nl] = s[w];
        if (nl == 0)
            io.v_state[head * io.P + p] = vbar;
    }
}

KERNEL_BOUNDED(SSM_WG, 6) mamba3_lanes(i64 R, i64 S, i64 H, i64 P, i64 N, i64 A, i64 G, i64 blocks, int has_q_bias,
                    int has_k_bias, int has_d, int has_z, int carry, int varlen, int slotted, int dt_real, int param_real,
                    GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo, GLOBAL uchar* zb,
                    i64 zo, GLOBAL uchar* db, i64 dof, GLOBAL uchar* adtb, i64 adto, GLOBAL uchar* dtb, i64 dto,
                    GLOBAL uchar* trb, i64 tro, GLOBAL uchar* anb, i64 ano, GLOBAL uchar* qbb, i64 qbo,
                    GLOBAL uchar* kbb, i64 kbo, GLOBAL uchar* skb, i64 sko, GLOBAL uchar* asb, i64 aso,
                    GLOBAL uchar* stb, i64 sto, GLOBAL uchar* ksb, i64 kso, GLOBAL uchar* vsb, i64 vso,
                    GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo)
{
    LOCAL real qr[SSM_N], kr[2 * SSM_N], kbar0[SSM_N], theta[SSM_N / 2], theta0[SSM_N / 2], part[SSM_WG];
    /* remainders as x - q*d, not %: LLVM turns a div/rem pair into a `freeze`, which Oclgrind rejects */
    const int lane = (int)LID(0), k = lane / SSM_L, nl = lane - k * SSM_L, first = k * SSM_L;
    const i64 lanes = LSIZE(0), rows = lanes / SSM_L, rh = GROUP(0) / blocks, block = GROUP(0) - rh * blocks;
    const i64 r = rh / H, h = rh - r * H;
    const m3_io io = m3_io_of(
        H, P, N, A, G, has_q_bias, has_k_bias, has_d, has_z, carry, varlen, slotted, dt_real, param_real,
        qb, qo, kb, ko, vb, vo, zb, zo, db, dof, adtb, adto, dtb, dto, trb, tro, anb, ano, qbb, qbo, kbb,
        kbo, skb, sko, asb, aso, stb, sto, ksb, kso, vsb, vso, cub, cuo, slb, slo);
    const m3_row row = m3_row_of(io, r, h, S);
    const i64 head = row.entry * H + h;
    for (i64 i = lane; i < N / 2; i += lanes) { /* this lane's pairs: the initial angle and key */
        theta0[i] = carry && i < A ? m3_wrap(io.angle_state[head * A + i]) : (real)0;
        kbar0[2 * i] = carry ? io.k_state[head * N + 2 * i] : (real)0;
        kbar0[2 * i + 1] = carry ? io.k_state[head * N + 2 * i + 1] : (real)0;
    }
    for (i64 p0 = block * rows; p0 < P; p0 += rows * blocks)
        m3_lanes_block_barrier(io, row, p0 + k, nl, first, lane, qr, kr, kbar0, theta, theta0, part);
    /* an empty sequence leaves its entries as they are; split heads leave theirs to mamba3_lanes_final */
    if (!carry || row.first == row.end || blocks > 1)
        return;
    const int last = (int)((row.end - 1 - row.first) & 1);
    for (i64 i = lane; i < N / 2; i += lanes) { /* the lane's own pairs: no barrier needed */
        if (i < A)
            io.angle_state[head * A + i] = theta[i];
        io.k_state[head * N + 2 * i] = kr[last * SSM_N + 2 * i];
        io.k_state[head * N + 2 * i + 1] = kr[last * SSM_N + 2 * i + 1];
    }
}

/* After mamba3_lanes split a head's rows over `blocks` > 1 groups (prefill): the final angle and key of each
 * (row, head), one work-item per pair i, its angle walked over the row's tokens as the groups walked it (the
 * groups read the initial entries; only this later launch writes them). */
KERNEL mamba3_lanes_final(i64 R, i64 S, i64 H, i64 P, i64 N, i64 A, i64 G, i64 blocks, int has_q_bias,
                          int has_k_bias, int has_d, int has_z, int carry, int varlen, int slotted, int dt_real,
                          int param_real, GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo,
                          GLOBAL uchar* zb, i64 zo, GLOBAL uchar* db, i64 dof, GLOBAL uchar* adtb, i64 adto,
                          GLOBAL uchar* dtb, i64 dto, GLOBAL uchar* trb, i64 tro, GLOBAL uchar* anb, i64 ano,
                          GLOBAL uchar* qbb, i64 qbo, GLOBAL uchar* kbb, i64 kbo, GLOBAL uchar* skb, i64 sko,
                          GLOBAL uchar* asb, i64 aso, GLOBAL uchar* stb, i64 sto, GLOBAL uchar* ksb, i64 kso,
                          GLOBAL uchar* vsb, i64 vso, GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo)
{
    const i64 pairs = N / 2, rh = GID(0) / pairs, i = GID(0) - rh * pairs, r = rh / H, h = rh - r * H;
    if (rh >= R * H || !carry)
        return;
    const m3_io io = m3_io_of(
        H, P, N, A, G, has_q_bias, has_k_bias, has_d, has_z, carry, varlen, slotted, dt_real, param_real,
        qb, qo, kb, ko, vb, vo, zb, zo, db, dof, adtb, adto, dtb, dto, trb, tro, anb, ano, qbb, qbo, kbb,
        kbo, skb, sko, asb, aso, stb, sto, ksb, kso, vsb, vso, cub, cuo, slb, slo);
    const m3_row row = m3_row_of(io, r, h, S);
    if (row.first == row.end)
        return;
    const i64 head = row.entry * H + h;
    real theta = (real)0;
    if (i < A) {
        theta = m3_wrap(io.angle_state[head * A + i]);
        for (i64 tok = row.first; tok < row.end; ++tok)
            theta = m3_advance(io, theta, tok, h, i, load_any(io.dt, tok * H + h, dt_real));
        io.angle_state[head * A + i] = theta;
    }
    const m3_pair pr = m3_pair_at(io, row, row.end - 1, i, m3_sincos(theta));
    io.k_state[head * N + 2 * i] = pr.k0;
    io.k_state[head * N + 2 * i + 1] = pr.k1;
}
#endif

#ifndef SSM_N /* every cpu program, and the gpu program without a state-size variant: the chunked prefill */
/* The chunked prefill (§11's informative note), chunks of M3C_Q tokens of one row, four launches
 * (launches/mamba3.py) over scratch in the compute type (m3c_scratch):
 *   mamba3_chunk_turn   the angle walked over each row's tokens as the step kernels walk it, each token's turned,
 *                       biased q~ and k~ into the chunk slots; with carry the final angle and key written (the
 *                       initial key kept in scratch for the state pass first);
 *   mamba3_chunk_state  each chunk's own final state from zero, sum_s exp(c[last] - c[s]) w[s] v[s] (x) k~[s], and
 *                       its decay exp(c[last]), with c[t] = sum_{r<=t} adt[r] within the chunk and the trapezoid's
 *                       weight w[s] = gamma[s] + beta'[s+1] (beta' = (1 - lambda)*dt of the row's next token, 0
 *                       past its last): the beta term token s+1 adds, folded into token s's key;
 *   mamba3_state_pass   per state element of a row, in chunk order: each chunk's own state replaced by the state
 *                       entering it, from S0 = S_init + beta'[first]*vbar (x) kbar (zero without carry); with carry
 *                       the final one written, exactly S after the last token (its beta' is 0);
 *   mamba3_chunk_scan   y[t] = exp(c[t]) q~[t].S_in + sum_{s<t} exp(c[t] - c[s]) w[s] (q~[t].k~[s]) v[s]
 *                       + gamma[t] (q~[t].k~[t]) v[t], then d and z; with carry the row's last chunk writes v_state.
 * Chunks are laid per row (a batch row, or one cu_seqlens sequence, whose first token starts a chunk): a head has K
 * chunk slots, row r's from m3c_row_slot(r), the last one partial; a slot no row uses has no steps and its
 * work-group walks empty loops to every barrier. Sums over s <= t are loops bounded by t or selects, never products
 * with a zero mask, so a NaN at token t reaches only tokens >= t: within its chunk through c and the bound, beyond
 * it through the state. An empty sequence has no chunk, and its entries are left as they are.
 * cpu: an item walks what PoCL vectorizes, inner loops over contiguous values (k~ and the states kept transposed
 * in scratch for them); gpu: the products as work-group tiles in LOCAL memory. */

/* One chunk slot: its row, first token, steps (0: a slot no row uses) and the end of its row. */
typedef struct {
    i64 row, first, steps, end;
} m3c_chunk;

/* The scratch of the chunked prefill: q~ [H][K][M3C_Q][N] and k~ (a [M3C_Q x N] block per (head, slot),
 * m3c_key_at), each chunk's state (its own, then the one entering it; an [N x m3c_rows(P)] block per (head, slot),
 * m3c_state_at) and decay [H][K], each row's initial key [R][H][N] (with carry). */
typedef struct {
    GLOBAL real* q;
    GLOBAL real* k;
    GLOBAL real* states;
    GLOBAL real* decay;
    GLOBAL real* kbar;
} m3c_scratch;

/* State rows P rounded up to whole tiles of M3C_PT: a cpu item's tile loads stay inside its (head, slot)'s block. */
INLINE_FN i64 m3c_rows(i64 P) { return (P + M3C_PT - 1) / M3C_PT * M3C_PT; }

/* k~ of step s, column n within its slot's block; the state element (p, n) within its slot's block. The cpu target
 * keeps both transposed ([n][s], [n][p]: its items' inner loops run over s and p), the gpu target row-major
 * (coalesced across lanes of adjacent n). */
INLINE_FN i64 m3c_key_at(i64 s, i64 n, i64 N)
{
#ifdef RLX_TARGET_CPU
    return n * M3C_Q + s;
#else
    return s * N + n;
#endif
}

INLINE_FN i64 m3c_state_at(i64 p, i64 n, i64 P, i64 N)
{
#ifdef RLX_TARGET_CPU
    return n * m3c_rows(P) + p;
#else
    return p * N + n;
#endif
}

INLINE_FN m3c_scratch m3c_scratch_of(GLOBAL uchar* sb, i64 so, i64 H, i64 P, i64 N, i64 K)
{
    m3c_scratch out;
    out.q = AT(real, sb, so);
    out.k = out.q + H * K * M3C_Q * N;
    out.states = out.k + H * K * M3C_Q * N;
    out.decay = out.states + H * K * m3c_rows(P) * N;
    out.kbar = out.decay + H * K;
    return out;
}

/* The chunks of a row of `tokens` tokens. */
INLINE_FN i64 m3c_chunks(i64 tokens) { return (tokens + M3C_Q - 1) / M3C_Q; }

/* The first chunk slot of row r: r * chunks of S, or with cu_seqlens the chunks of the rows before it. */
INLINE_FN i64 m3c_row_slot(m3_io io, i64 r, i64 S)
{
    if (!io.cu)
        return r * m3c_chunks(S);
    i64 k = 0;
    for (i64 j = 0; j < r; ++j)
        k += m3c_chunks((i64)io.cu[j + 1] - (i64)io.cu[j]);
    return k;
}

/* Chunk slot k of a head (of R rows). */
INLINE_FN m3c_chunk m3c_chunk_at(m3_io io, i64 k, i64 R, i64 S)
{
    m3c_chunk out;
    out.row = out.first = out.steps = out.end = 0;
    i64 at = 0, r = 0;
    if (io.cu) {
        for (; r < R && k >= at + m3c_chunks((i64)io.cu[r + 1] - (i64)io.cu[r]); ++r)
            at += m3c_chunks((i64)io.cu[r + 1] - (i64)io.cu[r]);
        if (r == R)
            return out;
        out.first = (i64)io.cu[r] + (k - at) * M3C_Q;
        out.end = (i64)io.cu[r + 1];
    } else {
        r = k / m3c_chunks(S);
        out.first = r * S + (k - r * m3c_chunks(S)) * M3C_Q;
        out.end = (r + 1) * S;
    }
    out.row = r;
    out.steps = out.end - out.first < M3C_Q ? out.end - out.first : M3C_Q;
    return out;
}

/* beta' = (1 - lambda)*dt of token tok at head h: the trapezoid's share the token gives the previous one's value. */
INLINE_FN real m3c_bprime(m3_io io, i64 tok, i64 h)
{
    const i64 at = tok * io.H + h;
    const real lambda = (real)1 / ((real)1 + rlx_exp(-load_any(io.trap, at, io.dt_real)));
    return ((real)1 - lambda) * load_any(io.dt, at, io.dt_real);
}

/* What the work-group of mamba3_chunk_state / mamba3_chunk_scan owns: chunk slot `slot` (head * K + chunk) and the
 * rows p0 .. p0+M3C_PT-1 of P (np of them inside P). */
typedef struct {
    i64 slot, h, p0;
    int np;
    m3c_chunk chunk;
} m3c_tile;

INLINE_FN m3c_tile m3c_tile_of(m3_io io, i64 group, i64 R, i64 S, i64 K)
{
    const i64 ptiles = (io.P + M3C_PT - 1) / M3C_PT;
    m3c_tile out;
    out.slot = group / ptiles;
    out.p0 = (group - out.slot * ptiles) * M3C_PT;
    out.np = io.P - out.p0 < M3C_PT ? (int)(io.P - out.p0) : M3C_PT;
    out.h = out.slot / K;
    out.chunk = m3c_chunk_at(io, out.slot - out.h * K, R, S);
    return out;
}

/* The values of a chunk in LOCAL memory (xs, xw), an operand of the chunk products: the compute type on the
 * portable path; with a launch's RLX_MMA (CUDA only) the tensor cores' operand type (kernels_cuda/prelude.cuh),
 * rounded once as staged: a 16-bit thunk's v is exact there, the weighted values of mamba3_chunk_state round to it
 * (as do q~, k~, the entering state and the weighted, decayed q~.k~^T entries below the diagonal tiles: as
 * mamba_ssm's and fla's chunk kernels round them to the input type). */
#ifdef RLX_MMA
#if M3C_PT != 16 || M3C_Q % 16 != 0 || M3C_LANES < 128
#error "the MMA variant of mamba3's chunk products tiles 16x16: M3C_PT = 16, M3C_Q % 16 = 0, 4 warps at least"
#endif
typedef mma_t m3c_op_t;
#define M3C_OP(v) TO_MMA(v)
#define M3C_VAL(v) FROM_MMA(v)
#define M3C_LOCAL MMA_LOCAL
#else
typedef real m3c_op_t;
#define M3C_OP(v) (v)
#define M3C_VAL(v) (v)
#define M3C_LOCAL LOCAL
#endif

/* The decay from token s of a chunk to token t >= s, exp(sum of adt over (s, t]) from the chunk's sums (cum, rs:
 * m3c_stage_barrier), or from the chunk's start to t (s = -1): exactly 0 past a reset in (s, t] (an adt of -inf,
 * alpha = 0, after which the sums restart), where the difference of the sums would be NaN. */
INLINE_FN real m3c_decay(LOCAL_PTR const real* cum, LOCAL_PTR const int* rs, int t, int s)
{
    return rs[t] > s ? (real)0 : rlx_exp(s < 0 ? cum[t] : cum[t] - cum[s]);
}

/* The tile's coefficients and values in LOCAL: gam[s] = gamma, wgt[s] = gamma + beta' of the row's next token (0
 * past its end), cum[s] = the sum of adt up to s within the chunk and rs[s] the last reset up to s (lane 0's serial
 * sums; m3c_decay); xs[s][p] = v[s][p0+p] (0 past P and past the steps). When `weighted`, wgt[s] is then times
 * the decay from s to the chunk's last token and xs[s][p] times wgt[s] (the value's weight in the chunk's own final
 * state).
 * Every lane calls it: it meets three barriers, the last once every array is complete. */
INLINE_FN void m3c_stage_barrier(m3_io io, m3c_tile tile, int lane, int weighted, LOCAL_PTR real* cum,
                                 LOCAL_PTR int* rs, LOCAL_PTR real* wgt, LOCAL_PTR real* gam, LOCAL_PTR m3c_op_t* xs)
{
    const m3c_chunk ch = tile.chunk;
    const int steps = (int)ch.steps;
    for (int s = lane; s < steps; s += M3C_LANES) {
        const i64 tok = ch.first + s;
        gam[s] = m3_coeffs_at(io, tok, tile.h).gamma;
        wgt[s] = gam[s] + (tok + 1 < ch.end ? m3c_bprime(io, tok + 1, tile.h) : (real)0);
        cum[s] = load_any(io.adt, tok * io.H + tile.h, io.dt_real);
    }
    BARRIER();
    if (lane == 0) {
        real acc = (real)0;
        int reset = -1;
        for (int s = 0; s < steps; ++s) {
            const int forget = isinf(cum[s]) && cum[s] < (real)0; /* alpha = 0: the sums restart at s */
            acc = forget ? (real)0 : acc + cum[s];
            reset = forget ? s : reset;
            cum[s] = acc;
            rs[s] = reset;
        }
        for (int s = 0; s < steps && weighted; ++s)
            wgt[s] *= m3c_decay(cum, rs, steps - 1, s);
    }
    BARRIER();
    for (int e = lane; e < M3C_Q * M3C_PT; e += M3C_LANES) { /* zero past the chunk's steps, which MMA tiles cover */
        const int s = e / M3C_PT, p = e - s * M3C_PT, in = s < steps && p < tile.np;
        const real v = in ? LOAD(io.v, ((ch.first + s) * io.H + tile.h) * io.P + tile.p0 + p) : (real)0;
        xs[e] = M3C_OP(weighted && in ? wgt[s] * v : v);
    }
    BARRIER();
}

/* The row's last chunk (with carry): its last value is the row's final vbar, v_state's rows p0 .. p0+np-1. */
INLINE_FN void m3c_store_vbar(m3_io io, m3c_tile tile, int lane, LOCAL_PTR const m3c_op_t* xs)
{
    const int steps = (int)tile.chunk.steps;
    if (!io.carry || steps == 0 || tile.chunk.first + steps != tile.chunk.end)
        return;
    const i64 entry = io.slots ? (i64)io.slots[tile.chunk.row] : tile.chunk.row;
    for (int p = lane; p < tile.np; p += M3C_LANES)
        io.v_state[(entry * io.H + tile.h) * io.P + tile.p0 + p] = M3C_VAL(xs[(steps - 1) * M3C_PT + p]);
}

#ifdef RLX_TARGET_CPU
/* cpu: an item per (row, head) walks the row's tokens, each turned as the step kernel turns it (m3_turn_token: its
 * angle loop vectorizes), q~ stored row-major, k~ transposed. */
KERNEL mamba3_chunk_turn(i64 R, i64 S, i64 H, i64 P, i64 N, i64 A, i64 G, i64 K, int has_q_bias, int has_k_bias,
                         int has_d, int has_z, int carry, int varlen, int slotted, int dt_real, int param_real,
                         GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo, GLOBAL uchar* zb,
                         i64 zo, GLOBAL uchar* db, i64 dof, GLOBAL uchar* adtb, i64 adto, GLOBAL uchar* dtb, i64 dto,
                         GLOBAL uchar* trb, i64 tro, GLOBAL uchar* anb, i64 ano, GLOBAL uchar* qbb, i64 qbo,
                         GLOBAL uchar* kbb, i64 kbo, GLOBAL uchar* skb, i64 sko, GLOBAL uchar* asb, i64 aso,
                         GLOBAL uchar* stb, i64 sto, GLOBAL uchar* ksb, i64 kso, GLOBAL uchar* vsb, i64 vso,
                         GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo, GLOBAL uchar* sb, i64 so)
{
    const i64 rh = GID(0), r = rh / H, h = rh - r * H;
    if (rh >= R * H)
        return;
    const m3_io io = m3_io_of(
        H, P, N, A, G, has_q_bias, has_k_bias, has_d, has_z, carry, varlen, slotted, dt_real, param_real,
        qb, qo, kb, ko, vb, vo, zb, zo, db, dof, adtb, adto, dtb, dto, trb, tro, anb, ano, qbb, qbo, kbb,
        kbo, skb, sko, asb, aso, stb, sto, ksb, kso, vsb, vso, cub, cuo, slb, slo);
    const m3_row row = m3_row_of(io, r, h, S);
    const m3c_scratch sc = m3c_scratch_of(sb, so, H, P, N, K);
    const i64 head = row.entry * H + h, k0 = h * K + m3c_row_slot(io, r, S);
    real theta[STATE_MAX / 2], qr[STATE_MAX], kr[STATE_MAX];
    for (i64 i = 0; i < A; ++i)
        theta[i] = carry ? m3_wrap(io.angle_state[head * A + i]) : (real)0;
    for (i64 n = 0; n < N; ++n) {
        kr[n] = (real)0;
        if (carry)
            sc.kbar[rh * N + n] = io.k_state[head * N + n];
    }
    for (i64 tok = row.first; tok < row.end; ++tok) {
        const i64 j = tok - row.first, c = j / M3C_Q, s = j - c * M3C_Q;
        m3_turn_token(io, row, tok, load_any(io.dt, tok * H + h, dt_real), theta, qr, kr);
        GLOBAL real* qd = sc.q + ((k0 + c) * M3C_Q + s) * N;
        GLOBAL real* kd = sc.k + (k0 + c) * M3C_Q * N;
        for (i64 n = 0; n < N; ++n) {
            qd[n] = qr[n];
            kd[m3c_key_at(s, n, N)] = kr[n];
        }
    }
    /* the steps past the row's end in its last chunk: zero keys, which the scan's items multiply (and never use) */
    const i64 len = row.end - row.first;
    for (i64 j = len; j < m3c_chunks(len) * M3C_Q; ++j)
        for (i64 n = 0; n < N; ++n)
            sc.k[(k0 + j / M3C_Q) * M3C_Q * N + m3c_key_at(j - j / M3C_Q * M3C_Q, n, N)] = (real)0;
    if (carry && row.end > row.first) {
        for (i64 i = 0; i < A; ++i)
            io.angle_state[head * A + i] = theta[i];
        for (i64 n = 0; n < N; ++n)
            io.k_state[head * N + n] = kr[n];
    }
}
#else
/* gpu: an item per (row, head, pair i) walks the row's tokens (the pair's angle alone: no barrier). */
KERNEL mamba3_chunk_turn(i64 R, i64 S, i64 H, i64 P, i64 N, i64 A, i64 G, i64 K, int has_q_bias, int has_k_bias,
                         int has_d, int has_z, int carry, int varlen, int slotted, int dt_real, int param_real,
                         GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo, GLOBAL uchar* zb,
                         i64 zo, GLOBAL uchar* db, i64 dof, GLOBAL uchar* adtb, i64 adto, GLOBAL uchar* dtb, i64 dto,
                         GLOBAL uchar* trb, i64 tro, GLOBAL uchar* anb, i64 ano, GLOBAL uchar* qbb, i64 qbo,
                         GLOBAL uchar* kbb, i64 kbo, GLOBAL uchar* skb, i64 sko, GLOBAL uchar* asb, i64 aso,
                         GLOBAL uchar* stb, i64 sto, GLOBAL uchar* ksb, i64 kso, GLOBAL uchar* vsb, i64 vso,
                         GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo, GLOBAL uchar* sb, i64 so)
{
    const i64 pairs = N / 2, rh = GID(0) / pairs, i = GID(0) - rh * pairs, r = rh / H, h = rh - r * H;
    if (rh >= R * H)
        return;
    const m3_io io = m3_io_of(
        H, P, N, A, G, has_q_bias, has_k_bias, has_d, has_z, carry, varlen, slotted, dt_real, param_real,
        qb, qo, kb, ko, vb, vo, zb, zo, db, dof, adtb, adto, dtb, dto, trb, tro, anb, ano, qbb, qbo, kbb,
        kbo, skb, sko, asb, aso, stb, sto, ksb, kso, vsb, vso, cub, cuo, slb, slo);
    const m3_row row = m3_row_of(io, r, h, S);
    const m3c_scratch sc = m3c_scratch_of(sb, so, H, P, N, K);
    /* token j of the row: step j of its chunks, N values apart (row-major blocks, one after another) */
    const i64 head = row.entry * H + h, base = (h * K + m3c_row_slot(io, r, S)) * M3C_Q * N + 2 * i;
    real theta = carry && i < A ? m3_wrap(io.angle_state[head * A + i]) : (real)0;
    if (carry) {
        sc.kbar[rh * N + 2 * i] = io.k_state[head * N + 2 * i];
        sc.kbar[rh * N + 2 * i + 1] = io.k_state[head * N + 2 * i + 1];
    }
    m3_pair pr;
    pr.q0 = pr.q1 = pr.k0 = pr.k1 = (real)0;
    for (i64 tok = row.first; tok < row.end; ++tok) {
        if (i < A)
            theta = m3_advance(io, theta, tok, h, i, load_any(io.dt, tok * H + h, dt_real));
        pr = m3_pair_at(io, row, tok, i, m3_sincos(i < A ? theta : (real)0));
        const i64 at = base + (tok - row.first) * N;
        sc.q[at] = pr.q0;
        sc.q[at + 1] = pr.q1;
        sc.k[at] = pr.k0;
        sc.k[at + 1] = pr.k1;
    }
    if (carry && row.end > row.first) {
        if (i < A)
            io.angle_state[head * A + i] = theta;
        io.k_state[head * N + 2 * i] = pr.k0;
        io.k_state[head * N + 2 * i + 1] = pr.k1;
    }
}
#endif

#ifdef RLX_MMA
#define M3C_NW (M3C_LANES / 32 * 16) /* state columns per pass of mamba3_chunk_state's MMA variant: 16 per warp */

/* own[p0+p][n] = sum_s xw[s][p] k~[s][n] over the chunk's steps (the tile's M3C_PT rows, those past P too: the
 * state pass walks them): each warp one 16x16 tile of M3C_NW columns per pass, from k~ staged as [M3C_Q][M3C_NW]
 * operands (kt), through an f32 tile (out) to the store. */
INLINE_FN void m3c_state_mma_barrier(GLOBAL real* own, LOCAL_PTR const mma_t* xw, LOCAL_PTR mma_t* kt,
                                     LOCAL_PTR float* out, GLOBAL const real* ks, int steps, i64 p0, i64 P, i64 N,
                                     int lane)
{
    for (i64 n0 = 0; n0 < (steps > 0 ? N : 0); n0 += M3C_NW) {
        BARRIER(); /* the previous pass's readers are done */
        for (int e = lane; e < M3C_Q * M3C_NW; e += M3C_LANES) { /* kt[s][nn] = k~[s][n0+nn], zero past the steps */
            const int s = e / M3C_NW, nn = e - s * M3C_NW;
            kt[e] = TO_MMA(s < steps && n0 + nn < N ? ks[m3c_key_at(s, n0 + nn, N)] : (real)0);
        }
        BARRIER();
        mma_steps_tile(out, xw, kt, M3C_NW, steps, MMA_WARP(lane));
        BARRIER();
        for (int e = lane; e < M3C_PT * M3C_NW; e += M3C_LANES) {
            const int p = e / M3C_NW, nn = e - p * M3C_NW;
            if (n0 + nn < N)
                own[m3c_state_at(p0 + p, n0 + nn, P, N)] = out[e];
        }
    }
}
#endif

/* A work-group per (head, slot, tile of rows); a lane per (state column n, block of M3C_PS rows; the cpu target's
 * block is the tile), lanes adjacent in n; with RLX_MMA, m3c_state_mma_barrier's warps. */
KERNEL mamba3_chunk_state(i64 R, i64 S, i64 H, i64 P, i64 N, i64 A, i64 G, i64 K, int has_q_bias, int has_k_bias,
                          int has_d, int has_z, int carry, int varlen, int slotted, int dt_real, int param_real,
                          GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo,
                          GLOBAL uchar* zb, i64 zo, GLOBAL uchar* db, i64 dof, GLOBAL uchar* adtb, i64 adto,
                          GLOBAL uchar* dtb, i64 dto,
                          GLOBAL uchar* trb, i64 tro, GLOBAL uchar* anb, i64 ano, GLOBAL uchar* qbb, i64 qbo,
                          GLOBAL uchar* kbb, i64 kbo, GLOBAL uchar* skb, i64 sko, GLOBAL uchar* asb, i64 aso,
                          GLOBAL uchar* stb, i64 sto, GLOBAL uchar* ksb, i64 kso, GLOBAL uchar* vsb, i64 vso,
                          GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo, GLOBAL uchar* sb, i64 so)
{
    LOCAL real cum[M3C_Q], wgt[M3C_Q], gam[M3C_Q];
    M3C_LOCAL m3c_op_t xw[M3C_Q * M3C_PT];
    LOCAL int rs[M3C_Q];
    const int lane = (int)LID(0);
    const m3_io io = m3_io_of(
        H, P, N, A, G, has_q_bias, has_k_bias, has_d, has_z, carry, varlen, slotted, dt_real, param_real,
        qb, qo, kb, ko, vb, vo, zb, zo, db, dof, adtb, adto, dtb, dto, trb, tro, anb, ano, qbb, qbo, kbb,
        kbo, skb, sko, asb, aso, stb, sto, ksb, kso, vsb, vso, cub, cuo, slb, slo);
    const m3c_scratch sc = m3c_scratch_of(sb, so, H, P, N, K);
    const m3c_tile tile = m3c_tile_of(io, GROUP(0), R, S, K);
    const int steps = (int)tile.chunk.steps;
    m3c_stage_barrier(io, tile, lane, 1, cum, rs, wgt, gam, xw);
    if (tile.p0 == 0 && lane == 0 && steps > 0)
        sc.decay[tile.slot] = m3c_decay(cum, rs, steps - 1, -1);
    GLOBAL const real* ks = sc.k + tile.slot * M3C_Q * N;
    GLOBAL real* own = sc.states + tile.slot * m3c_rows(P) * N;
#ifdef RLX_MMA
    MMA_LOCAL mma_t kt[M3C_Q * M3C_NW];
    MMA_LOCAL float out[M3C_PT * M3C_NW];
    m3c_state_mma_barrier(own, xw, kt, out, ks, steps, tile.p0, P, N, lane);
#else
    for (i64 e = lane; e < (steps > 0 ? N * (M3C_PT / M3C_PS) : 0); e += M3C_LANES) {
        const i64 pb = e / N, n = e - pb * N, pr = tile.p0 + pb * M3C_PS;
        real acc[M3C_PS];
        PRAGMA_UNROLL
        for (int c = 0; c < M3C_PS; ++c)
            acc[c] = (real)0;
        for (int s = 0; s < steps; ++s) {
            const real kv = ks[m3c_key_at(s, n, N)];
            PRAGMA_UNROLL
            for (int c = 0; c < M3C_PS; ++c)
                acc[c] += xw[s * M3C_PT + pb * M3C_PS + c] * kv;
        }
        PRAGMA_UNROLL
        for (int c = 0; c < M3C_PS; ++c) /* the rows past P too (zero, or NaN from k~): the state pass walks them */
            if (pr + c < m3c_rows(P))
                own[m3c_state_at(pr + c, n, P, N)] = acc[c];
    }
#endif
}

/* A work-item per state column n and M3C_PP rows p .. p+M3C_PP-1 of one (row, head) (cpu: a tile, an inner loop that
 * vectorizes; gpu: one element): walks the row's chunks in order, leaving in each chunk's slot the state entering it.
 * The scratch's rows past P (m3c_rows) are walked too, unread by the outputs. */
KERNEL mamba3_state_pass(i64 R, i64 S, i64 H, i64 P, i64 N, i64 A, i64 G, i64 K, int has_q_bias, int has_k_bias,
                         int has_d, int has_z, int carry, int varlen, int slotted, int dt_real, int param_real,
                         GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo, GLOBAL uchar* zb,
                         i64 zo, GLOBAL uchar* db, i64 dof, GLOBAL uchar* adtb, i64 adto, GLOBAL uchar* dtb, i64 dto,
                         GLOBAL uchar* trb, i64 tro, GLOBAL uchar* anb, i64 ano, GLOBAL uchar* qbb, i64 qbo,
                         GLOBAL uchar* kbb, i64 kbo, GLOBAL uchar* skb, i64 sko, GLOBAL uchar* asb, i64 aso,
                         GLOBAL uchar* stb, i64 sto, GLOBAL uchar* ksb, i64 kso, GLOBAL uchar* vsb, i64 vso,
                         GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo, GLOBAL uchar* sb, i64 so)
{
    const i64 blocks = (P + M3C_PP - 1) / M3C_PP, per = N * blocks, e = GID(0);
    if (e >= R * H * per)
        return;
    /* adjacent items on adjacent elements of the scratch's layout (m3c_state_at): cpu n-major, gpu p-major */
    const i64 rh = e / per, el = e - rh * per, r = rh / H, h = rh - r * H;
#ifdef RLX_TARGET_CPU
    const i64 n = el / blocks, p = (el - n * blocks) * M3C_PP;
#else
    const i64 pb = el / N, n = el - pb * N, p = pb * M3C_PP;
#endif
    const m3_io io = m3_io_of(
        H, P, N, A, G, has_q_bias, has_k_bias, has_d, has_z, carry, varlen, slotted, dt_real, param_real,
        qb, qo, kb, ko, vb, vo, zb, zo, db, dof, adtb, adto, dtb, dto, trb, tro, anb, ano, qbb, qbo, kbb,
        kbo, skb, sko, asb, aso, stb, sto, ksb, kso, vsb, vso, cub, cuo, slb, slo);
    const m3_row row = m3_row_of(io, r, h, S);
    if (row.first == row.end)
        return;
    const m3c_scratch sc = m3c_scratch_of(sb, so, H, P, N, K);
    const i64 k0 = h * K + m3c_row_slot(io, r, S), chunks = m3c_chunks(row.end - row.first), head = row.entry * H + h;
    const i64 block = m3c_rows(P) * N;
    GLOBAL real* st = sc.states + k0 * block;
    real s[M3C_PP];
    /* S0: the initial state with the first token's beta term on the carried value and key (zero without carry) */
    const real bk = carry ? m3c_bprime(io, row.first, h) * sc.kbar[rh * N + n] : (real)0;
    PRAGMA_UNROLL
    for (int c = 0; c < M3C_PP; ++c)
        s[c] = carry && p + c < P ? io.state[(head * P + p + c) * N + n] + io.v_state[head * P + p + c] * bk : (real)0;
    for (i64 k = 0; k < chunks; ++k) {
        const real dk = sc.decay[k0 + k];
        PRAGMA_UNROLL
        for (int c = 0; c < M3C_PP; ++c) {
            const i64 at = k * block + m3c_state_at(p + c, n, P, N);
            const real own = st[at];
            st[at] = s[c];
            s[c] = dk * s[c] + own;
        }
    }
    PRAGMA_UNROLL
    for (int c = 0; c < M3C_PP; ++c)
        if (carry && p + c < P)
            io.state[(head * P + p + c) * N + n] = s[c];
}

#ifdef RLX_TARGET_CPU
/* cpu: a work-group per (head, slot, tile of rows), an item per step t: its q~[t].k~[s] for every s and its q~[t].S_in
 * for the tile's rows (inner loops over s and p, contiguous in the transposed k~ and states: they vectorize), then
 * its outputs from the tile's values in LOCAL. Private arrays: each row of products is the item's alone. */
KERNEL mamba3_chunk_scan(i64 R, i64 S, i64 H, i64 P, i64 N, i64 A, i64 G, i64 K, int has_q_bias, int has_k_bias,
                         int has_d, int has_z, int carry, int varlen, int slotted, int dt_real, int param_real,
                         GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo, GLOBAL uchar* zb,
                         i64 zo, GLOBAL uchar* db, i64 dof, GLOBAL uchar* adtb, i64 adto, GLOBAL uchar* dtb, i64 dto,
                         GLOBAL uchar* trb, i64 tro, GLOBAL uchar* anb, i64 ano, GLOBAL uchar* qbb, i64 qbo,
                         GLOBAL uchar* kbb, i64 kbo, GLOBAL uchar* skb, i64 sko, GLOBAL uchar* asb, i64 aso,
                         GLOBAL uchar* stb, i64 sto, GLOBAL uchar* ksb, i64 kso, GLOBAL uchar* vsb, i64 vso,
                         GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo, GLOBAL uchar* sb, i64 so)
{
    LOCAL real cum[M3C_Q], wgt[M3C_Q], gam[M3C_Q], xs[M3C_Q * M3C_PT], gl[M3C_Q * M3C_Q];
    LOCAL int rs[M3C_Q];
    const int lane = (int)LID(0);
    const m3_io io = m3_io_of(
        H, P, N, A, G, has_q_bias, has_k_bias, has_d, has_z, carry, varlen, slotted, dt_real, param_real,
        qb, qo, kb, ko, vb, vo, zb, zo, db, dof, adtb, adto, dtb, dto, trb, tro, anb, ano, qbb, qbo, kbb,
        kbo, skb, sko, asb, aso, stb, sto, ksb, kso, vsb, vso, cub, cuo, slb, slo);
    const m3c_scratch sc = m3c_scratch_of(sb, so, H, P, N, K);
    const m3c_tile tile = m3c_tile_of(io, GROUP(0), R, S, K);
    const i64 t0 = tile.chunk.first, h = tile.h, rows = m3c_rows(P);
    /* the item's row of q~.k~^T goes through LOCAL (gl[t][s]): read at a step s known only at run time, a private
     * array would leave registers for memory while it is summed */
    m3c_stage_barrier(io, tile, lane, 0, cum, rs, wgt, gam, xs);
    GLOBAL const real* ks = sc.k + tile.slot * M3C_Q * N;                    /* [n][s] */
    GLOBAL const real* fs = sc.states + tile.slot * rows * N + tile.p0;      /* [n][p]: the state entering the chunk */
    for (int t = lane; t < (int)tile.chunk.steps; t += M3C_LANES) {
        GLOBAL const real* qs = sc.q + (tile.slot * M3C_Q + t) * N;
        real g[M3C_Q], y[M3C_PT];
        PRAGMA_UNROLL
        for (int s = 0; s < M3C_Q; ++s)
            g[s] = (real)0;
        PRAGMA_UNROLL
        for (int c = 0; c < M3C_PT; ++c)
            y[c] = (real)0;
        for (i64 n = 0; n < N; ++n) {
            const real qv = qs[n];
            PRAGMA_UNROLL
            for (int s = 0; s < M3C_Q; ++s)
                g[s] += qv * ks[n * M3C_Q + s];
            PRAGMA_UNROLL
            for (int c = 0; c < M3C_PT; ++c)
                y[c] += qv * fs[n * rows + c];
        }
        PRAGMA_UNROLL
        for (int s = 0; s < M3C_Q; ++s)
            gl[t * M3C_Q + s] = g[s];
        const real et = m3c_decay(cum, rs, t, -1), own = gam[t] * gl[t * M3C_Q + t];
        PRAGMA_UNROLL
        for (int c = 0; c < M3C_PT; ++c)
            y[c] = et * y[c] + own * xs[t * M3C_PT + c];
        for (int s = 0; s < t; ++s) {
            const real m = m3c_decay(cum, rs, t, s) * wgt[s] * gl[t * M3C_Q + s];
            PRAGMA_UNROLL
            for (int c = 0; c < M3C_PT; ++c)
                y[c] += m * xs[s * M3C_PT + c];
        }
        for (int c = 0; c < tile.np; ++c)
            m3_store(io, ((t0 + t) * H + h) * P + tile.p0 + c, h, y[c], xs[t * M3C_PT + c]);
    }
    m3c_store_vbar(io, tile, lane, xs);
}
#elif !defined(RLX_NEED_FP64) /* f64 keeps the step kernels on GPUs: these tiles would pass CUDA's 48 KiB of static
                                * shared memory */
#define M3C_QP (M3C_Q + 1) /* LOCAL row strides padded by one so that a column walk spreads over banks */
#define M3C_NTP (M3C_NT + 1)
#define M3C_GS (M3C_Q * M3C_Q / M3C_LANES) /* entries of q~.k~^T per lane: row t = lane % M3C_Q, M3C_GS columns */
#define M3C_TS (M3C_LANES / M3C_PT)        /* a lane's outputs: p = lane % M3C_PT, t = lane / M3C_PT + i*M3C_TS */
#define M3C_YI (M3C_Q / M3C_TS)            /* outputs per lane */

#ifdef RLX_MMA
#define M3C_QT (M3C_Q / 16)               /* 16-step tiles of a chunk */
#define M3C_GT (M3C_QT * (M3C_QT + 1) / 2) /* q~.k~^T tiles on and below the diagonal */
#if (M3C_LANES / 32) * 2 < M3C_GT + M3C_QT
#error "mamba3_chunk_scan's MMA variant gives each warp at most two product tiles"
#endif

/* The chunk's sums and weights in LOCAL (m3c_stage_barrier's cum, rs, wgt, gam). */
typedef struct {
    LOCAL_PTR const real* cum;
    LOCAL_PTR const int* rs;
    LOCAL_PTR const real* wgt;
    LOCAL_PTR const real* gam;
} m3c_decays;

/* q~.k~^T and q~.S_in^T of the tile's chunk on the tensor cores (the LOCAL tiles at: mma_scan_local, q~ and k~
 * the rows and cols), over N in slices of 16: warp w accumulates product
 * tiles w and w + warps (mma_scan_pair: q~.k~^T, then q~.S_in^T), then stores them, f32, in gm and ys. */
INLINE_FN void m3c_scan_tiles_barrier(mma_scan_local at, m3c_scratch sc, m3c_tile tile, i64 P, i64 N, int lane)
{
    GLOBAL const real* qs = sc.q + tile.slot * M3C_Q * N;
    GLOBAL const real* ks = sc.k + tile.slot * M3C_Q * N;
    GLOBAL const real* fs = sc.states + tile.slot * m3c_rows(P) * N; /* the state entering this chunk */
    const int steps = (int)tile.chunk.steps;
    mma_scan_pair pair = mma_scan_pair_of(MMA_WARP(lane), M3C_LANES / 32, M3C_GT, M3C_QT);
    for (i64 n0 = 0; n0 < (steps > 0 ? N : 0); n0 += 16) {
        BARRIER(); /* the previous slice's readers are done */
        for (int e = lane; e < M3C_Q * 16; e += M3C_LANES) {
            const int s = e / 16, nn = e - s * 16, in = s < steps && n0 + nn < N;
            at.rows[e] = TO_MMA(in ? qs[s * N + n0 + nn] : (real)0);
            at.cols[e] = TO_MMA(in ? ks[m3c_key_at(s, n0 + nn, N)] : (real)0);
        }
        for (int e = lane; e < M3C_PT * 16; e += M3C_LANES) {
            const int p = e / 16, nn = e - p * 16;
            at.st[e] = TO_MMA(p < tile.np && n0 + nn < N ? fs[m3c_state_at(tile.p0 + p, n0 + nn, P, N)] : (real)0);
        }
        BARRIER();
        mma_scan_pair_add(&pair, at.rows, at.cols, at.st);
    }
    mma_scan_pair_store(&pair, at.gm, M3C_Q, at.ys, M3C_PT);
}

/* y[t][p] = exp(c[t]) q~[t].S_in[p] + sum_{s<t} exp(c[t] - c[s]) w[s] (q~[t].k~[s]) v[s][p] + gamma[t] (q~[t].k~[t])
 * v[t][p] on the tensor cores (m3c_scan_tiles_barrier), then: the weighted, decayed q~.k~^T entries below the
 * diagonal tiles become operands (gmm), those of the diagonal tiles stay f32 in gm; the state part scaled by
 * exp(c[t]) takes gmm times v on the tensor cores (warp w < M3C_Q/16: steps 16w..), and each lane adds its
 * diagonal terms, a sum bounded by t, and stores. As on the portable path nothing at a step s > t reaches y[t],
 * not even a NaN: such entries are selected away, never multiplied by a zero mask. */
INLINE_FN void m3c_scan_mma_barrier(m3_io io, m3c_tile tile, m3c_scratch sc, mma_scan_local at, m3c_decays dc,
                                    LOCAL_PTR const mma_t* xs, int lane)
{
    const int steps = (int)tile.chunk.steps;
    m3c_scan_tiles_barrier(at, sc, tile, io.P, io.N, lane);
    BARRIER();
    for (int e = lane; e < M3C_Q * M3C_Q; e += M3C_LANES) {
        const int t = e / M3C_Q, s = e - t * M3C_Q;
        if (s / 16 > t / 16)
            continue; /* never computed, never read */
        const real v = s <= t && t < steps
                           ? (s < t ? m3c_decay(dc.cum, dc.rs, t, s) * dc.wgt[s] : dc.gam[t]) * at.gm[e]
                           : (real)0;
        if (s / 16 == t / 16)
            at.gm[e] = v;
        else
            at.gmm[e] = TO_MMA(v);
    }
    for (int e = lane; e < M3C_Q * M3C_PT; e += M3C_LANES) {
        const int t = e / M3C_PT;
        at.ys[e] = t < steps ? m3c_decay(dc.cum, dc.rs, t, -1) * at.ys[e] : (real)0;
    }
    BARRIER();
    const int w = MMA_WARP(lane);
    if (w < M3C_Q / 16) {
        mma_acc y;
        mma_load(&y, at.ys + w * 16 * M3C_PT, M3C_PT);
        for (int sj = 0; sj < w; ++sj)
            mma_tile(&y, MMA_ROW, at.gmm + w * 16 * M3C_Q + sj * 16, M3C_Q, MMA_ROW, xs + sj * 16 * M3C_PT, M3C_PT);
        mma_store(at.ys + w * 16 * M3C_PT, &y, M3C_PT);
    }
    BARRIER();
    for (int e = lane; e < M3C_Q * M3C_PT; e += M3C_LANES) {
        const int t = e / M3C_PT, p = e - t * M3C_PT;
        if (t < steps && p < tile.np) {
            real y = at.ys[e];
            for (int s = t / 16 * 16; s <= t; ++s)
                y += at.gm[t * M3C_Q + s] * FROM_MMA(xs[s * M3C_PT + p]);
            m3_store(io, ((tile.chunk.first + t) * io.H + tile.h) * io.P + tile.p0 + p, tile.h, y, FROM_MMA(xs[e]));
        }
    }
}
#endif

/* gpu: a work-group per (head, slot, tile of rows); q~.k~^T and q~.S_in accumulated over tiles of M3C_NT state
 * columns staged in LOCAL (each lane M3C_GS entries of the first, M3C_YI of the second), the masked, weighted
 * products into LOCAL, then each lane's outputs; with RLX_MMA on the tensor cores (m3c_scan_mma_barrier). */
KERNEL mamba3_chunk_scan(i64 R, i64 S, i64 H, i64 P, i64 N, i64 A, i64 G, i64 K, int has_q_bias, int has_k_bias,
                         int has_d, int has_z, int carry, int varlen, int slotted, int dt_real, int param_real,
                         GLOBAL uchar* qb, i64 qo, GLOBAL uchar* kb, i64 ko, GLOBAL uchar* vb, i64 vo, GLOBAL uchar* zb,
                         i64 zo, GLOBAL uchar* db, i64 dof, GLOBAL uchar* adtb, i64 adto, GLOBAL uchar* dtb, i64 dto,
                         GLOBAL uchar* trb, i64 tro, GLOBAL uchar* anb, i64 ano, GLOBAL uchar* qbb, i64 qbo,
                         GLOBAL uchar* kbb, i64 kbo, GLOBAL uchar* skb, i64 sko, GLOBAL uchar* asb, i64 aso,
                         GLOBAL uchar* stb, i64 sto, GLOBAL uchar* ksb, i64 kso, GLOBAL uchar* vsb, i64 vso,
                         GLOBAL uchar* cub, i64 cuo, GLOBAL uchar* slb, i64 slo, GLOBAL uchar* sb, i64 so)
{
    LOCAL real cum[M3C_Q], wgt[M3C_Q], gam[M3C_Q];
    M3C_LOCAL m3c_op_t xs[M3C_Q * M3C_PT];
    LOCAL int rs[M3C_Q];
    const int lane = (int)LID(0);
    const m3_io io = m3_io_of(
        H, P, N, A, G, has_q_bias, has_k_bias, has_d, has_z, carry, varlen, slotted, dt_real, param_real,
        qb, qo, kb, ko, vb, vo, zb, zo, db, dof, adtb, adto, dtb, dto, trb, tro, anb, ano, qbb, qbo, kbb,
        kbo, skb, sko, asb, aso, stb, sto, ksb, kso, vsb, vso, cub, cuo, slb, slo);
    const m3c_scratch sc = m3c_scratch_of(sb, so, H, P, N, K);
    const m3c_tile tile = m3c_tile_of(io, GROUP(0), R, S, K);
    m3c_stage_barrier(io, tile, lane, 0, cum, rs, wgt, gam, xs);
#ifdef RLX_MMA
    MMA_LOCAL float at_gm[M3C_Q * M3C_Q], at_ys[M3C_Q * M3C_PT];
    MMA_LOCAL mma_t at_rows[M3C_Q * 16], at_cols[M3C_Q * 16], at_st[M3C_PT * 16];
#if RLX_MMA == 2 /* TF32 operands are f32: those below the diagonal in place */
    const mma_scan_local at = {at_gm, at_ys, at_gm, at_rows, at_cols, at_st};
#else
    MMA_LOCAL mma_t at_gmm[M3C_Q * M3C_Q];
    const mma_scan_local at = {at_gm, at_ys, at_gmm, at_rows, at_cols, at_st};
#endif
    const m3c_decays dc = {cum, rs, wgt, gam};
    m3c_scan_mma_barrier(io, tile, sc, at, dc, xs, lane);
#else
    LOCAL real qt[M3C_Q * M3C_NTP], kt[M3C_Q * M3C_NTP], ft[M3C_PT * M3C_NTP], gm[M3C_Q * M3C_QP];
    const int steps = (int)tile.chunk.steps;
    const i64 t0 = tile.chunk.first, h = tile.h, p0 = tile.p0;
    GLOBAL const real* qs = sc.q + tile.slot * M3C_Q * N;
    GLOBAL const real* ks = sc.k + tile.slot * M3C_Q * N;
    GLOBAL const real* fs = sc.states + tile.slot * m3c_rows(P) * N; /* the state entering this chunk */
    /* this lane's q~.k~^T entries: row tg, columns s0..; its outputs: row p0+py, steps ty + i*M3C_TS (remainders as
     * x - q*d: a div/rem pair becomes an LLVM `freeze`, which Oclgrind rejects) */
    const int sh = lane / M3C_Q, tg = lane - sh * M3C_Q, s0 = sh * M3C_GS, ty = lane / M3C_PT, py = lane - ty * M3C_PT;
    real g[M3C_GS], yi[M3C_YI];
    PRAGMA_UNROLL
    for (int j = 0; j < M3C_GS; ++j)
        g[j] = (real)0;
    PRAGMA_UNROLL
    for (int i = 0; i < M3C_YI; ++i)
        yi[i] = (real)0;
    for (i64 n0 = 0; n0 < (steps > 0 ? N : 0); n0 += M3C_NT) {
        BARRIER(); /* the previous tile's readers are done */
        for (int e = lane; e < M3C_Q * M3C_NT; e += M3C_LANES) {
            const int s = e / M3C_NT, nn = e - s * M3C_NT, in = s < steps && n0 + nn < N;
            qt[s * M3C_NTP + nn] = in ? qs[s * N + n0 + nn] : (real)0;
            kt[s * M3C_NTP + nn] = in ? ks[m3c_key_at(s, n0 + nn, N)] : (real)0;
        }
        for (int e = lane; e < M3C_PT * M3C_NT; e += M3C_LANES) {
            const int p = e / M3C_NT, nn = e - p * M3C_NT;
            ft[p * M3C_NTP + nn] = p < tile.np && n0 + nn < N ? fs[m3c_state_at(p0 + p, n0 + nn, P, N)] : (real)0;
        }
        BARRIER();
        for (int nn = 0; nn < M3C_NT; ++nn) { /* not unrolled: ptxas would hoist every tile load */
            const real qv = qt[tg * M3C_NTP + nn], fv = ft[py * M3C_NTP + nn];
            PRAGMA_UNROLL
            for (int j = 0; j < M3C_GS; ++j)
                g[j] += qv * kt[(s0 + j) * M3C_NTP + nn];
            PRAGMA_UNROLL
            for (int i = 0; i < M3C_YI; ++i)
                yi[i] += qt[(ty + i * M3C_TS) * M3C_NTP + nn] * fv;
        }
    }
    /* gm[t][s] = exp(c[t] - c[s]) w[s] (q~[t].k~[s]) for s < t, gamma[t] (q~[t].k~[t]) on the diagonal, for t < steps;
     * the rest is never read */
    PRAGMA_UNROLL
    for (int j = 0; j < M3C_GS; ++j)
        if (s0 + j <= tg && tg < steps)
            gm[tg * M3C_QP + s0 + j] = (s0 + j < tg ? m3c_decay(cum, rs, tg, s0 + j) * wgt[s0 + j] : gam[tg]) * g[j];
    BARRIER();
    PRAGMA_UNROLL
    for (int i = 0; i < M3C_YI; ++i) {
        const int t = ty + i * M3C_TS;
        if (t < steps && py < tile.np) {
            real y = m3c_decay(cum, rs, t, -1) * yi[i];
            for (int s = 0; s <= t; ++s)
                y += gm[t * M3C_QP + s] * xs[s * M3C_PT + py];
            m3_store(io, ((t0 + t) * H + h) * P + p0 + py, h, y, xs[t * M3C_PT + py]);
        }
    }
#endif
    m3c_store_vbar(io, tile, lane, xs);
}
#endif
#endif

/* decodert's own CPU decode step for dense llama-family int4 artifacts (runtime/backends/native/step.py builds
 * this file with the system C compiler at first use and calls it through ctypes; docs/features/placement.md).
 *
 * One nd_forward call runs tokens of rows through every layer, each token as the ort target's decode graph runs one
 * (several rows' next tokens, or one row's consecutive tokens as a verify pass scores them; the weights read once):
 *   x = embed(token)                                   Gather (float) or GatherBlockQuantized (4-bit rows)
 *   per layer l:
 *     h = RMSNorm(x) * in_norm[l]                      (layer 0: RMSNormalization; later: SkipSimplifiedLayerNorm
 *                                                       adds the previous MLP's output to x first)
 *     qkv = W_qkv h (+ bias)      [(H + 2 H_kv) D]     MatMulNBits
 *     q, k = RoPE(q, k, pos)  (halves, the graph's cos/sin tables); k, v written at pos of the row's cache
 *     a = softmax(q K^T * scale) V over positions 0..pos, kv head = q head / (H / H_kv)   GroupQueryAttention
 *     x = x + W_o a;  h = RMSNorm(x) * post_norm[l]    MatMulNBits, SkipSimplifiedLayerNormalization
 *     g, u = W_gate_up h;  m = silu(g) * u;  d = W_down m                                  MatMulNBits, Split
 *   x = x + d (last layer);  logits = W_lm RMSNorm(x) * final_norm
 *
 * Weights: 4-bit, blocks of 32 along K, asymmetric (4-bit zero point, fp32 scale per block): the MatMulNBits
 * layout on input, repacked once by nd_pack. Activations are quantized to int8 per block of 32 (amax / 127), as
 * MatMulNBits does at accuracy level 4; the products run on AVX-512 VNNI (vpdpbusd: unsigned weight bytes x signed
 * activation bytes).
 *
 * Packed layout, per tile of 16 rows: nb x 256 bytes of nibbles, then nb x 16 fp32 scales, then nb x 16 zero
 * points (one byte each), padded to 64 bytes. In the 256 bytes of block b, chunk j (64 bytes) holds at byte
 * 4r+u the weight w[r, 32b+8j+u] in its low nibble and w[r, 32b+8j+4+u] in its high nibble, so one vpdpbusd on
 * the low nibbles and one on the high nibbles (each against 4 activation bytes broadcast) add 16 rows' partial
 * dots in the 16 int32 lanes. The zero point enters as -zp * sum(qa) in int32 (vpmaddwd), before the scale.
 *
 * Threads: the caller and nd_start(threads) - 1 workers take chunks of a job (tiles of a product, heads of the
 * attention) from one atomic counter (high half: the job number, so a late worker cannot take a chunk of a
 * finished job); the caller waits for the chunks to be done, never for a worker to arrive, so a preempted worker
 * costs nothing but its own chunk. Workers spin briefly between jobs, then sleep 200 us at a time, then block
 * (worker(), below).
 */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static size_t tile_bytes(int nb) { return ((size_t)nb * 336 + 63) & ~(size_t)63; }

size_t nd_packed_bytes(int n, int k) { return (size_t)((n + 15) / 16) * tile_bytes(k / 32); }

/* q [N, K/32, 16] (element 2i in the low nibble of byte i), scales [N, K/32], zp [N, ceil(K/64)] or NULL (8) */
void nd_pack(const uint8_t *q, const float *scales, const uint8_t *zp, int n_rows, int k, uint8_t *out) {
    int nb = k / 32, zstride = (nb + 1) / 2, tiles = (n_rows + 15) / 16;
    size_t tb = tile_bytes(nb);
    memset(out, 0, tb * tiles);
    for (int t = 0; t < tiles; t++) {
        uint8_t *base = out + t * tb;
        float *sc = (float *)(base + (size_t)nb * 256);
        uint8_t *zz = base + (size_t)nb * 320;
        for (int b = 0; b < nb; b++)
            for (int r = 0; r < 16 && t * 16 + r < n_rows; r++) {
                size_t n = (size_t)t * 16 + r;
                const uint8_t *blk = q + (n * nb + b) * 16;
                uint8_t w[32];
                for (int i = 0; i < 16; i++) {
                    w[2 * i] = blk[i] & 15;
                    w[2 * i + 1] = blk[i] >> 4;
                }
                for (int j = 0; j < 4; j++)
                    for (int u = 0; u < 4; u++)
                        base[(size_t)b * 256 + 64 * j + 4 * r + u] = (uint8_t)(w[8 * j + u] | (w[8 * j + 4 + u] << 4));
                int z = 8;
                if (zp) {
                    uint8_t pair = zp[n * zstride + b / 2];
                    z = (b & 1) ? pair >> 4 : pair & 15;
                }
                sc[16 * b + r] = scales[n * nb + b];
                zz[16 * b + r] = (uint8_t)z;
            }
    }
}

/* ---- vector helpers ---------------------------------------------------------------------------------------- */
/* e^x for 16 lanes: x = n ln2 + r (|r| <= ln2 / 2), e^r by its degree-7 Taylor polynomial (relative error
 * below 1e-8 on that range), times 2^n; lanes below -87 give 0 */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 split: high part exact
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 tail_mask(int left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }

/* y = (a + b if b) normalized: y = s * (1 / sqrt(mean(s^2) + eps)) * w, s = a (+ b) written back to a when b. The
 * sum of squares in 8 lanes (a product, then a sum: not fused), the lanes added as a tree: the order in which ONNX
 * Runtime's RMSNormalization comes out bit for bit the same here (measured on SmolLM2's rows). That matters: the
 * int8 quantization of y that follows rounds an activation one ulp apart to the next int8 step now and then,
 * ~3e-4 of a product's size, and 30 layers of that make the logits differ by ~3% */
static void rms_norm(float *a, const float *b, const float *w, int n, float eps, float *y) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) {
            float v = b ? a[i + j] + b[i + j] : a[i + j];
            a[i + j] = v;
            float sq = v * v;
            lane[j] = lane[j] + sq;
        }
    float ss = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    for (; i < n; i++) {
        float v = b ? a[i] + b[i] : a[i];
        a[i] = v;
        ss += v * v;
    }
    float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) y[i] = (a[i] * inv) * w[i];
}

/* x [K] -> qa [K] int8, sa [nb] block scales, nasum [nb] = -sum(qa of the block) in the low 16 bits */
static void quant_x(const float *x, int k, int8_t *qa, float *sa, int32_t *nasum) {
    for (int b = 0; b < k / 32; b++) {
        __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        float scale = amax / 127.f;  // the int8 step, and its reciprocal as MatMulNBits computes it
        __m512 inv = _mm512_set1_ps(scale != 0.f ? 1.f / scale : 0.f);
        __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        _mm_storeu_si128((__m128i *)(qa + 32 * b), _mm512_cvtsepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(qa + 32 * b + 16), _mm512_cvtsepi32_epi8(i1));
        sa[b] = scale;
        nasum[b] = (int32_t)(uint16_t)(int16_t)(-_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));
    }
}

/* One tile (16 rows, nb blocks at p) times ``g`` tokens' quantized activations (token u: a4[u], sa[u], nasum[u]) into
 * y[u]. The tile's nibbles are loaded and masked once per block for all g tokens; each token's sums run in the
 * one-token order (its -zp * sum(qa) first, the four chunks' dots in order, then its block's scale into its fp32
 * accumulator block after block), so a token's products do not depend on the tokens beside it. g is a constant
 * (1 .. 4) where it is inlined, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile_tokens(const uint8_t *p, int nb, int g, const int32_t *const *a4,
                                                              const float *const *sa, const int32_t *const *nasum,
                                                              float *const *y) {
    const __m512i lo_mask = _mm512_set1_epi8(0x0F), hi_mask = _mm512_set1_epi8((char)0xF0);
    const float *sc = (const float *)(p + (size_t)nb * 256);
    const uint8_t *zz = p + (size_t)nb * 320;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int b = 0; b < nb; b++, p += 256) {
        __m512i lo[4], hi[4];
        for (int j = 0; j < 4; j++) {
            __m512i packed = _mm512_loadu_si512(p + 64 * j);
            lo[j] = _mm512_and_si512(packed, lo_mask), hi[j] = _mm512_and_si512(packed, hi_mask);
        }
        __m512i zpx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zz + 16 * b)));
        __m512 scale = _mm512_loadu_ps(sc + 16 * b);
        for (int u = 0; u < g; u++) {
            const int32_t *a = a4[u] + 8 * b;
            __m512i dlo = _mm512_madd_epi16(zpx, _mm512_set1_epi32(nasum[u][b]));  // -zp * sum(qa)
            __m512i dhi = _mm512_setzero_si512();                                  // 16 x the high nibbles' dots
            for (int j = 0; j < 4; j++) {
                dlo = _mm512_dpbusd_epi32(dlo, lo[j], _mm512_set1_epi32(a[2 * j]));
                dhi = _mm512_dpbusd_epi32(dhi, hi[j], _mm512_set1_epi32(a[2 * j + 1]));
            }
            __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(dlo, _mm512_srai_epi32(dhi, 4)));
            acc[u] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(sa[u][b])), acc[u]);
        }
    }
    for (int u = 0; u < g; u++) _mm512_storeu_ps(y[u], acc[u]);
}

/* Tiles t0..t1 of w times each of ``count`` tokens' quantized activations (token i: qa + i * qs, sa / nasum + i * ss),
 * into y + i * ys, four tokens at a time: a tile's bytes come from memory once and from L1 for the next tokens. */
static void gemm_tiles(const uint8_t *w, int count, const int8_t *qa, size_t qs, const float *sa, const int32_t *nasum,
                       size_t ss, int nb, int t0, int t1, float *y, size_t ys) {
    size_t tb = tile_bytes(nb);
    for (int t = t0; t < t1; t++)
        for (int i = 0; i < count; i += 4) {
            const int32_t *a4[4];
            const float *sai[4];
            const int32_t *nai[4];
            float *yi[4];
            int g = count - i < 4 ? count - i : 4;
            for (int u = 0; u < g; u++) {
                a4[u] = (const int32_t *)(qa + (i + u) * qs);  // 4 activation bytes at a time
                sai[u] = sa + (i + u) * ss, nai[u] = nasum + (i + u) * ss, yi[u] = y + (i + u) * ys + 16 * t;
            }
            const uint8_t *p = w + (size_t)t * tb;
            switch (g) {
                case 4: tile_tokens(p, nb, 4, a4, sai, nai, yi); break;
                case 3: tile_tokens(p, nb, 3, a4, sai, nai, yi); break;
                case 2: tile_tokens(p, nb, 2, a4, sai, nai, yi); break;
                default: tile_tokens(p, nb, 1, a4, sai, nai, yi); break;
            }
        }
}

/* ---- the worker pool ----------------------------------------------------------------------------------------- */
typedef void (*chunk_fn)(const void *ctx, int chunk);
typedef struct {
    chunk_fn fn;
    const void *ctx;  // lives on the caller's stack until every chunk is done
    int chunks;
} job_t;

static job_t g_job;
static _Atomic uint64_t g_next = 0xffffffffu;  // job << 32 | next chunk; 0xffffffff while no job is open
static _Atomic int g_done;
static pthread_t g_workers[64];
static int g_nworkers;
static uint32_t g_jobno;

static int run_chunks(void) {
    int ran = 0;
    for (;;) {
        uint64_t cur = atomic_load_explicit(&g_next, memory_order_acquire);
        job_t j = g_job;  // read before the claim; a claim that succeeds proves it was this job's
        uint32_t c = (uint32_t)cur;
        if (c >= (uint32_t)j.chunks) return ran;
        if (!atomic_compare_exchange_weak(&g_next, &cur, cur + 1)) continue;
        j.fn(j.ctx, (int)c);
        atomic_fetch_add_explicit(&g_done, 1, memory_order_release);
        ran++;
    }
}

/* Idle workers: spin (a step's next product comes within microseconds), then poll every 200 us (between decode
 * steps), then, after ~50 ms without a job (no decoding), block until run_job opens one: an idle process costs no
 * CPU. A worker counts itself in g_sleepers under g_mu before it looks for a job, and run_job looks at g_sleepers
 * after it opens one (both sequentially consistent), so either the worker sees the job or run_job wakes it; and
 * run_job's caller claims chunks itself, so a worker that sleeps through a job only slows it. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static _Atomic int g_sleepers;

static int job_open(void) { return (uint32_t)atomic_load(&g_next) < (uint32_t)g_job.chunks; }

static void *worker(void *unused) {  // runs until the process ends
    (void)unused;
    for (int idle = 0;;) {
        if (run_chunks()) idle = 0;
        else if (++idle <= 2000) _mm_pause();
        else if (idle <= 2250) usleep(200);  // between decode steps: sleep, leave the core to others
        else {
            pthread_mutex_lock(&g_mu);
            atomic_fetch_add(&g_sleepers, 1);
            while (!job_open()) pthread_cond_wait(&g_cv, &g_mu);
            atomic_fetch_sub(&g_sleepers, 1);
            pthread_mutex_unlock(&g_mu);
            idle = 0;
        }
    }
    return NULL;
}

/* threads in all (the caller included); started once per process, later calls return the count running */
int nd_start(int threads) {
    if (!g_nworkers)
        for (int i = 0; i < threads - 1 && i < 64; i++)
            if (pthread_create(&g_workers[g_nworkers], NULL, worker, NULL) == 0) g_nworkers++;
    return g_nworkers + 1;
}

static void run_job(chunk_fn fn, const void *ctx, int chunks) {
    if (chunks <= 0) return;
    if (!g_nworkers || chunks == 1) {
        for (int c = 0; c < chunks; c++) fn(ctx, c);
        return;
    }
    job_t j = {fn, ctx, chunks};
    atomic_store(&g_next, 0xffffffffu);  // closed while the job is written
    g_job = j;
    atomic_store_explicit(&g_done, 0, memory_order_relaxed);
    atomic_store(&g_next, (uint64_t)(++g_jobno) << 32);
    if (atomic_load(&g_sleepers)) {
        pthread_mutex_lock(&g_mu);
        pthread_cond_broadcast(&g_cv);
        pthread_mutex_unlock(&g_mu);
    }
    run_chunks();
    while (atomic_load_explicit(&g_done, memory_order_acquire) < chunks) _mm_pause();
}

/* ---- products ------------------------------------------------------------------------------------------------ */
typedef struct {
    const uint8_t *w;  // packed (nd_pack)
    const float *bias;  // [N] or NULL
    int n, k;
} mat_t;

typedef struct {
    const uint8_t *w;
    int count;
    const int8_t *qa;
    size_t qs;
    const float *sa;
    const int32_t *nasum;
    size_t ss;
    int nb, tiles, chunk;
    float *y;
    size_t ys;
} gemm_ctx;

static void gemm_chunk(const void *p, int c) {
    const gemm_ctx *g = p;
    int t0 = c * g->chunk, t1 = t0 + g->chunk < g->tiles ? t0 + g->chunk : g->tiles;
    gemm_tiles(g->w, g->count, g->qa, g->qs, g->sa, g->nasum, g->ss, g->nb, t0, t1, g->y, g->ys);
}

/* activation scratch for ``count`` tokens of up to ``k`` inputs: qa [count, qs], sa / nasum [count, ss] */
typedef struct {
    int8_t *qa;
    float *sa;
    int32_t *nasum;
    size_t qs, ss;
} act_t;

/* y_i = w x_i (+ bias) for the ``count`` tokens x + i * xs -> y + i * ys (each y_i [16 ceil(N / 16)]) */
static void gemm(const act_t *s, const mat_t *w, int count, const float *x, size_t xs, float *y, size_t ys) {
    int nb = w->k / 32, tiles = (w->n + 15) / 16, threads = g_nworkers + 1, chunk = tiles / (8 * threads);
    if (chunk < 1) chunk = 1;
    for (int i = 0; i < count; i++) quant_x(x + i * xs, w->k, s->qa + i * s->qs, s->sa + i * s->ss, s->nasum + i * s->ss);
    gemm_ctx g = {w->w, count, s->qa, s->qs, s->sa, s->nasum, s->ss, nb, tiles, chunk, y, ys};
    run_job(gemm_chunk, &g, (tiles + chunk - 1) / chunk);
    if (w->bias)
        for (int i = 0; i < count; i++)
            for (int j = 0; j < w->n; j++) y[i * ys + j] += w->bias[j];
}

static float *pad_alloc(size_t n) {
    size_t bytes = ((n + 16) * sizeof(float) + 63) & ~(size_t)63;
    float *p = aligned_alloc(64, bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

static size_t pad16(size_t n) { return (n + 15) & ~(size_t)15; }

static int act_alloc(act_t *s, int count, int k) {
    s->qs = pad16((size_t)k + 64), s->ss = pad16((size_t)k / 32 + 1);
    s->qa = (int8_t *)pad_alloc(count * s->qs / 4), s->sa = pad_alloc(count * s->ss);
    s->nasum = (int32_t *)pad_alloc(count * s->ss);
    return s->qa && s->sa && s->nasum;
}

static void act_free(act_t *s) {
    free(s->qa);
    free(s->sa);
    free(s->nasum);
}

/* ---- the model ----------------------------------------------------------------------------------------------- */
enum { LP_IN_NORM, LP_POST_NORM, LP_QKV, LP_QKV_BIAS, LP_O, LP_O_BIAS, LP_GU, LP_GU_BIAS, LP_DOWN, LP_DOWN_BIAS, LP_COUNT };
enum { MP_COS, MP_SIN, MP_EMBED_F, MP_EMBED_Q, MP_EMBED_S, MP_EMBED_Z, MP_FINAL_NORM, MP_LM, MP_LM_BIAS, MP_COUNT };
enum { D_LAYERS, D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_INTER, D_VOCAB, D_ROT_HALF, D_MAX_POS, D_EMBED_KIND,
       D_MAX_SEQ, D_MAX_TOKENS, D_COUNT };

typedef struct {
    int layers, hidden, heads, kv_heads, head_dim, inter, vocab, rot_half, max_pos, embed_kind, max_seq, cap;
    float eps, scale;
    const float *cos, *sin;  // [max_pos, rot_half]
    const float *embed_f;    // [V, hidden] (embed_kind 0)
    const uint8_t *embed_q;  // [V, hidden / 32, 16] nibbles (embed_kind 1), scales [V, hidden / 32], zp [V, hidden / 32]
    const float *embed_s;
    const uint8_t *embed_z;  // one byte per block, the zero point in its low nibble (NULL: 8)
    const float *final_norm;
    mat_t lm;
    const float **in_norm, **post_norm;  // [layers] -> [hidden]
    mat_t *qkv, *o, *gu, *down;          // [layers]
    // scratch for ``cap`` tokens, token i at i * its stride (each padded to 16 floats)
    size_t sh, sq, sa, sg, si, ssc;      // strides: hidden, qkv, attention out, gate_up, inter, scores of a head
    float *x, *h, *qkv_out, *attn, *o_out, *gu_out, *act, *down_out, *scores;
    act_t act_q;
} model_t;

void nd_free(void *p) {
    model_t *m = p;
    if (!m) return;
    float *bufs[] = {m->x, m->h, m->qkv_out, m->attn, m->o_out, m->gu_out, m->act, m->down_out, m->scores};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    act_free(&m->act_q);
    free(m->in_norm);
    free(m->post_norm);
    free(m->qkv);
    free(m->o);
    free(m->gu);
    free(m->down);
    free(m);
}

/* dims [D_COUNT], fparams {eps, scale}, ptrs [MP_COUNT], layer_ptrs [layers * LP_COUNT]; the caller keeps every
 * array alive until nd_free. D_MAX_TOKENS: the most tokens one nd_forward call takes. NULL when out of memory. */
void *nd_create(const int *dims, const float *fparams, void *const *ptrs, void *const *layer_ptrs) {
    model_t *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    m->layers = dims[D_LAYERS], m->hidden = dims[D_HIDDEN], m->heads = dims[D_HEADS], m->kv_heads = dims[D_KV_HEADS];
    m->head_dim = dims[D_HEAD_DIM], m->inter = dims[D_INTER], m->vocab = dims[D_VOCAB], m->rot_half = dims[D_ROT_HALF];
    m->max_pos = dims[D_MAX_POS], m->embed_kind = dims[D_EMBED_KIND], m->max_seq = dims[D_MAX_SEQ];
    m->cap = dims[D_MAX_TOKENS] > 0 ? dims[D_MAX_TOKENS] : 1;
    m->eps = fparams[0], m->scale = fparams[1];
    m->cos = ptrs[MP_COS], m->sin = ptrs[MP_SIN], m->embed_f = ptrs[MP_EMBED_F], m->embed_q = ptrs[MP_EMBED_Q];
    m->embed_s = ptrs[MP_EMBED_S], m->embed_z = ptrs[MP_EMBED_Z], m->final_norm = ptrs[MP_FINAL_NORM];
    m->lm = (mat_t){ptrs[MP_LM], ptrs[MP_LM_BIAS], m->vocab, m->hidden};
    int L = m->layers, qkv_n = (m->heads + 2 * m->kv_heads) * m->head_dim, q_n = m->heads * m->head_dim;
    m->in_norm = calloc(L, sizeof *m->in_norm), m->post_norm = calloc(L, sizeof *m->post_norm);
    m->qkv = calloc(L, sizeof *m->qkv), m->o = calloc(L, sizeof *m->o);
    m->gu = calloc(L, sizeof *m->gu), m->down = calloc(L, sizeof *m->down);
    int widest = m->hidden > q_n ? m->hidden : q_n;
    if (m->inter > widest) widest = m->inter;
    size_t c = (size_t)m->cap;
    m->sh = pad16(m->hidden), m->sq = pad16(qkv_n), m->sa = pad16(q_n), m->sg = pad16(2 * (size_t)m->inter);
    m->si = pad16(m->inter), m->ssc = pad16((size_t)m->max_seq + 16);
    m->x = pad_alloc(c * m->sh), m->h = pad_alloc(c * m->sh), m->qkv_out = pad_alloc(c * m->sq);
    m->attn = pad_alloc(c * m->sa), m->o_out = pad_alloc(c * m->sh), m->gu_out = pad_alloc(c * m->sg);
    m->act = pad_alloc(c * m->si), m->down_out = pad_alloc(c * m->sh);
    m->scores = pad_alloc(c * m->heads * m->ssc);
    int acts = act_alloc(&m->act_q, m->cap, widest);
    if (!m->in_norm || !m->post_norm || !m->qkv || !m->o || !m->gu || !m->down || !m->x || !m->h || !m->qkv_out ||
        !m->attn || !m->o_out || !m->gu_out || !m->act || !m->down_out || !m->scores || !acts) {
        nd_free(m);
        return NULL;
    }
    for (int l = 0; l < L; l++) {
        void *const *p = layer_ptrs + (size_t)l * LP_COUNT;
        m->in_norm[l] = p[LP_IN_NORM], m->post_norm[l] = p[LP_POST_NORM];
        m->qkv[l] = (mat_t){p[LP_QKV], p[LP_QKV_BIAS], qkv_n, m->hidden};
        m->o[l] = (mat_t){p[LP_O], p[LP_O_BIAS], m->hidden, q_n};
        m->gu[l] = (mat_t){p[LP_GU], p[LP_GU_BIAS], 2 * m->inter, m->hidden};
        m->down[l] = (mat_t){p[LP_DOWN], p[LP_DOWN_BIAS], m->hidden, m->inter};
    }
    return m;
}

/* count products one after another, outside a model (a decode step's, in order): w[i] packed by nd_pack, x[i] [K[i]],
 * y[i] [16 ceil(N[i] / 16)]; the kernel and the worker pool nd_forward runs, for bench/gemv_kernel.py. 0, or -1 where
 * a K is not a positive multiple of 32 or there is no memory for the activations' scratch. */
int nd_gemv_steps(int count, const uint8_t *const *w, const float *const *x, const int *n, const int *k, float *const *y) {
    int widest = 0;
    for (int i = 0; i < count; i++) {
        if (k[i] <= 0 || k[i] % 32) return -1;
        if (k[i] > widest) widest = k[i];
    }
    act_t s;
    int ok = act_alloc(&s, 1, widest);
    for (int i = 0; ok && i < count; i++) {
        mat_t mat = {w[i], NULL, n[i], k[i]};
        gemm(&s, &mat, 1, x[i], 0, y[i], 0);
    }
    act_free(&s);
    return ok ? 0 : -1;
}

static void embed(const model_t *m, int64_t token, float *x) {
    int H = m->hidden;
    if (m->embed_kind == 0) {
        memcpy(x, m->embed_f + (size_t)token * H, H * sizeof(float));
        return;
    }
    int nb = H / 32;
    const uint8_t *q = m->embed_q + (size_t)token * nb * 16;
    for (int b = 0; b < nb; b++) {
        float s = m->embed_s[(size_t)token * nb + b];
        int z = m->embed_z ? (m->embed_z[(size_t)token * nb + b] & 15) : 8;
        for (int i = 0; i < 16; i++) {
            x[32 * b + 2 * i] = (float)((q[16 * b + i] & 15) - z) * s;
            x[32 * b + 2 * i + 1] = (float)((q[16 * b + i] >> 4) - z) * s;
        }
    }
}

/* the first 2 * rot_half dims of each of ``heads`` vectors [D] rotated by halves at ``pos`` */
static void rope(const model_t *m, float *v, int heads, int pos) {
    const float *c = m->cos + (size_t)pos * m->rot_half, *s = m->sin + (size_t)pos * m->rot_half;
    for (int h = 0; h < heads; h++) {
        float *a = v + (size_t)h * m->head_dim, *b = a + m->rot_half;
        for (int i = 0; i < m->rot_half; i++) {
            float x1 = a[i], x2 = b[i];
            a[i] = x1 * c[i] - x2 * s[i];
            b[i] = x2 * c[i] + x1 * s[i];
        }
    }
}

typedef struct {
    const model_t *m;
    int layer;
    const int *pos;         // [count]: token i attends its row's positions 0 .. pos[i]
    float *const *kv;       // [count, 2 * layers]: token i's row's K and V bases ([H_kv, max_seq, D] each)
} attn_ctx;

/* chunk c: token c / heads, its query head c % heads */
static void attn_head(const void *p, int c) {
    const attn_ctx *a = p;
    const model_t *m = a->m;
    int i = c / m->heads, h = c % m->heads;
    int D = m->head_dim, n = a->pos[i] + 1, kvh = h / (m->heads / m->kv_heads);
    const float *q = m->qkv_out + i * m->sq + (size_t)h * D;
    float *const *kv = a->kv + (size_t)i * 2 * m->layers;
    const float *K = kv[2 * a->layer] + (size_t)kvh * m->max_seq * D, *V = kv[2 * a->layer + 1] + (size_t)kvh * m->max_seq * D;
    float *sc = m->scores + ((size_t)i * m->heads + h) * m->ssc, *out = m->attn + i * m->sa + (size_t)h * D;
    float best = -INFINITY;
    int t = 0;
    for (; t + 4 <= n; t += 4) {  // four positions at a time: independent chains
        const float *k0 = K + (size_t)t * D;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int j = 0; j < D; j += 16) {
            __mmask16 mk = tail_mask(D - j);
            __m512 qj = _mm512_maskz_loadu_ps(mk, q + j);
            a0 = _mm512_fmadd_ps(qj, _mm512_maskz_loadu_ps(mk, k0 + j), a0);
            a1 = _mm512_fmadd_ps(qj, _mm512_maskz_loadu_ps(mk, k0 + D + j), a1);
            a2 = _mm512_fmadd_ps(qj, _mm512_maskz_loadu_ps(mk, k0 + 2 * D + j), a2);
            a3 = _mm512_fmadd_ps(qj, _mm512_maskz_loadu_ps(mk, k0 + 3 * D + j), a3);
        }
        float s4[4] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1), _mm512_reduce_add_ps(a2),
                       _mm512_reduce_add_ps(a3)};
        for (int j = 0; j < 4; j++) {
            float s = s4[j] * m->scale;
            sc[t + j] = s;
            if (s > best) best = s;
        }
    }
    for (; t < n; t++) {
        const float *kt = K + (size_t)t * D;
        __m512 acc = _mm512_setzero_ps();
        for (int j = 0; j < D; j += 16) {
            __mmask16 mk = tail_mask(D - j);
            acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, q + j), _mm512_maskz_loadu_ps(mk, kt + j), acc);
        }
        float s = _mm512_reduce_add_ps(acc) * m->scale;
        sc[t] = s;
        if (s > best) best = s;
    }
    __m512 mx = _mm512_set1_ps(best), sum = _mm512_setzero_ps();
    for (t = 0; t < n; t += 16) {
        __mmask16 mk = tail_mask(n - t);
        __m512 e = _mm512_maskz_mov_ps(mk, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sc + t), mx)));
        _mm512_mask_storeu_ps(sc + t, mk, e);
        sum = _mm512_add_ps(sum, e);
    }
    float inv = 1.f / _mm512_reduce_add_ps(sum);
    for (int j = 0; j < D; j += 16) {
        __mmask16 mk = tail_mask(D - j);
        __m512 acc = _mm512_setzero_ps();
        for (t = 0; t < n; t++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(sc[t]), _mm512_maskz_loadu_ps(mk, V + (size_t)t * D + j), acc);
        _mm512_mask_storeu_ps(out + j, mk, _mm512_mul_ps(acc, _mm512_set1_ps(inv)));
    }
}

/* silu(g) * u for the gate/up halves of gu [2 * inter] */
static void swiglu(const float *gu, int inter, float *out) {
    for (int i = 0; i < inter; i += 16) {
        __mmask16 mk = tail_mask(inter - i);
        __m512 g = _mm512_maskz_loadu_ps(mk, gu + i), u = _mm512_maskz_loadu_ps(mk, gu + inter + i);
        __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_mask_storeu_ps(out + i, mk, _mm512_mul_ps(_mm512_mul_ps(g, sig), u));
    }
}

/* ``count`` tokens (1 .. D_MAX_TOKENS) at once, token i = tokens[i] of a row at position pos[i] of it: kv [count,
 * 2 * layers] that row's K and V bases ([H_kv, max_seq, D] each, k0, v0, k1, ...). Several rows (a batch's next
 * tokens), one row's consecutive positions (a verify: token i sees the K/V tokens before it wrote, not those after),
 * or both. Each token's K (rotated) and V are written at its position, its logits at logits + i * ls (ls >= vocab
 * padded to 16) and its argmax (the first of equal bests) at best[i]. The weights are read once for all tokens, and
 * every token's arithmetic is that of a call with it alone, bit for bit. 0, or -1 when a count, token or position
 * is out of range (nothing written). */
int nd_forward(void *p, int count, const int64_t *tokens, const int *pos, float *const *kv, float *logits, int ls,
               int64_t *best) {
    model_t *m = p;
    if (count < 1 || count > m->cap || ls < (int)pad16(m->vocab)) return -1;
    for (int i = 0; i < count; i++)
        if (pos[i] < 0 || pos[i] >= m->max_seq || pos[i] >= m->max_pos || tokens[i] < 0 || tokens[i] >= m->vocab) return -1;
    int D = m->head_dim, q_n = m->heads * D, kv_n = m->kv_heads * D, L = m->layers;
    for (int i = 0; i < count; i++) embed(m, tokens[i], m->x + i * m->sh);
    for (int l = 0; l < L; l++) {
        for (int i = 0; i < count; i++)
            rms_norm(m->x + i * m->sh, l ? m->down_out + i * m->sh : NULL, m->in_norm[l], m->hidden, m->eps, m->h + i * m->sh);
        gemm(&m->act_q, &m->qkv[l], count, m->h, m->sh, m->qkv_out, m->sq);
        for (int i = 0; i < count; i++) {
            float *qkv = m->qkv_out + i * m->sq;
            if (m->rot_half) rope(m, qkv, m->heads + m->kv_heads, pos[i]);  // q heads then k heads
            float *K = kv[(size_t)i * 2 * L + 2 * l], *V = kv[(size_t)i * 2 * L + 2 * l + 1];
            for (int h = 0; h < m->kv_heads; h++) {
                memcpy(K + ((size_t)h * m->max_seq + pos[i]) * D, qkv + q_n + (size_t)h * D, D * sizeof(float));
                memcpy(V + ((size_t)h * m->max_seq + pos[i]) * D, qkv + q_n + kv_n + (size_t)h * D, D * sizeof(float));
            }
        }
        attn_ctx a = {m, l, pos, kv};
        run_job(attn_head, &a, count * m->heads);
        gemm(&m->act_q, &m->o[l], count, m->attn, m->sa, m->o_out, m->sh);
        for (int i = 0; i < count; i++)
            rms_norm(m->x + i * m->sh, m->o_out + i * m->sh, m->post_norm[l], m->hidden, m->eps, m->h + i * m->sh);
        gemm(&m->act_q, &m->gu[l], count, m->h, m->sh, m->gu_out, m->sg);
        for (int i = 0; i < count; i++) swiglu(m->gu_out + i * m->sg, m->inter, m->act + i * m->si);
        gemm(&m->act_q, &m->down[l], count, m->act, m->si, m->down_out, m->sh);
    }
    for (int i = 0; i < count; i++)
        rms_norm(m->x + i * m->sh, m->down_out + i * m->sh, m->final_norm, m->hidden, m->eps, m->h + i * m->sh);
    gemm(&m->act_q, &m->lm, count, m->h, m->sh, logits, (size_t)ls);
    for (int i = 0; i < count; i++) {
        const float *y = logits + (size_t)i * ls;
        int64_t b = 0;
        for (int j = 1; j < m->vocab; j++)
            if (y[j] > y[b]) b = j;
        best[i] = b;
    }
    return 0;
}

/* An int4 GEMV for one decode row, y[N] = W[N,K] x[K], measured against ONNX Runtime's MatMulNBits by
 * bench/gemv_kernel.py (which builds this file with the C compiler and calls it through ctypes).
 *
 * Weights: 4-bit, blocks of 32 along K, asymmetric (a 4-bit zero point and an fp32 scale per block), the
 * MatMulNBits layout on input. Activations: quantized to int8 per block of 32 (amax / 127), as MatMulNBits does at
 * accuracy level 4; products with AVX-512 VNNI (vpdpbusd: unsigned weight bytes x signed activation bytes).
 *
 * Packed layout, per tile of 16 rows: nb x 256 bytes of nibbles, then nb x 16 fp32 scales, then nb x 16 zero
 * points (one byte each), padded to 64 bytes. In the 256 bytes of block b, chunk j (64 bytes) holds at byte
 * 4r+u the weight w[r, 32b+8j+u] in its low nibble and w[r, 32b+8j+4+u] in its high nibble, so one vpdpbusd on
 * the low nibbles and one on the high nibbles (each against 4 activation bytes broadcast) add 16 rows' partial
 * dots in the 16 int32 lanes. The zero point enters as -zp * sum(qa) in int32 (vpmaddwd), before the scale.
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

static size_t tile_bytes(int nb) { return ((size_t)nb * 336 + 63) & ~(size_t)63; }

size_t q4_packed_bytes(int n, int k) { return (size_t)((n + 15) / 16) * tile_bytes(k / 32); }

/* q [N, K/32, 16] (element 2i in the low nibble of byte i), scales [N, K/32], zp [N, ceil(K/64)] or NULL (8) */
void q4_pack(const uint8_t *q, const float *scales, const uint8_t *zp, int n_rows, int k, uint8_t *out) {
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

/* x [K] -> qa [K] int8, sa [nb] block scales, nasum [nb] = -sum(qa of the block) in the low 16 bits */
static void quant_x(const float *x, int k, int8_t *qa, float *sa, int32_t *nasum) {
    for (int b = 0; b < k / 32; b++) {
        __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        __m512 inv = _mm512_set1_ps(amax > 0 ? 127.f / amax : 0.f);
        __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        _mm_storeu_si128((__m128i *)(qa + 32 * b), _mm512_cvtsepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(qa + 32 * b + 16), _mm512_cvtsepi32_epi8(i1));
        sa[b] = amax / 127.f;
        nasum[b] = (int32_t)(uint16_t)(int16_t)(-_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));
    }
}

static void gemv_tiles(const uint8_t *w, const int8_t *qa, const float *sa, const int32_t *nasum, int nb,
                       int t0, int t1, float *y) {
    const __m512i lo_mask = _mm512_set1_epi8(0x0F), hi_mask = _mm512_set1_epi8((char)0xF0);
    const int32_t *a4 = (const int32_t *)qa;  // 4 activation bytes at a time
    size_t tb = tile_bytes(nb);
    for (int t = t0; t < t1; t++) {
        const uint8_t *p = w + (size_t)t * tb;
        const float *sc = (const float *)(p + (size_t)nb * 256);
        const uint8_t *zz = p + (size_t)nb * 320;
        __m512 acc = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++, p += 256) {
            const int32_t *a = a4 + 8 * b;
            __m512i zpx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zz + 16 * b)));
            __m512i dlo = _mm512_madd_epi16(zpx, _mm512_set1_epi32(nasum[b]));  // -zp * sum(qa)
            __m512i dhi = _mm512_setzero_si512();                                // 16 x the high nibbles' dots
            for (int j = 0; j < 4; j++) {
                __m512i packed = _mm512_loadu_si512(p + 64 * j);
                dlo = _mm512_dpbusd_epi32(dlo, _mm512_and_si512(packed, lo_mask), _mm512_set1_epi32(a[2 * j]));
                dhi = _mm512_dpbusd_epi32(dhi, _mm512_and_si512(packed, hi_mask), _mm512_set1_epi32(a[2 * j + 1]));
            }
            __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(dlo, _mm512_srai_epi32(dhi, 4)));
            acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(_mm512_loadu_ps(sc + 16 * b), _mm512_set1_ps(sa[b])), acc);
        }
        _mm512_storeu_ps(y + 16 * t, acc);
    }
}

/* ---- threads: the caller and q4_start(threads) - 1 workers take chunks of tiles from one atomic counter
 * (high half: the job number, so a late worker cannot take a chunk of a finished job); the caller waits for the
 * chunks to be done, never for a worker to arrive, so a preempted worker costs nothing but its own chunk. */
typedef struct {
    const uint8_t *w;
    const int8_t *qa;
    const float *sa;
    const int32_t *nasum;
    int nb, tiles, chunk, chunks;
    float *y;
} job_t;

static job_t g_job;
static _Atomic uint64_t g_next = 0xffffffffu;  // job << 32 | next chunk; 0xffffffff while no job is open
static _Atomic int g_done;
static pthread_t g_workers[64];
static int g_nworkers;

static int run_chunks(void) {
    int ran = 0;
    for (;;) {
        uint64_t cur = atomic_load_explicit(&g_next, memory_order_acquire);
        job_t j = g_job;  // read before the claim; a claim that succeeds proves it was this job's
        uint32_t c = (uint32_t)cur;
        if (c >= (uint32_t)j.chunks) return ran;
        if (!atomic_compare_exchange_weak(&g_next, &cur, cur + 1)) continue;
        int t0 = (int)c * j.chunk, t1 = t0 + j.chunk < j.tiles ? t0 + j.chunk : j.tiles;
        gemv_tiles(j.w, j.qa, j.sa, j.nasum, j.nb, t0, t1, j.y);
        atomic_fetch_add_explicit(&g_done, 1, memory_order_release);
        ran++;
    }
}

static void *worker(void *unused) {  // runs until the process ends
    (void)unused;
    for (int idle = 0;;) {
        if (run_chunks()) idle = 0;
        else if (++idle > 2000) usleep(200);  // between decode steps: sleep, leave the core to others
        else _mm_pause();
    }
    return NULL;
}

int q4_start(int threads) {
    if (g_nworkers) return 0;
    for (int i = 0; i < threads - 1 && i < 64; i++)
        if (pthread_create(&g_workers[g_nworkers], NULL, worker, NULL) == 0) g_nworkers++;
    return g_nworkers + 1;
}

/* count GEMVs one after another (a decode step's products in order): w[i] packed, x[i] [K[i]], y[i] [16*ceil(N/16)] */
void q4_gemv_steps(int count, const uint8_t **w, const float **x, const int *n, const int *k, float **y) {
    static int8_t qa[65536] __attribute__((aligned(64)));
    static float sa[2048];
    static int32_t nasum[2048];
    static uint32_t job = 0;
    int threads = g_nworkers + 1;
    for (int i = 0; i < count; i++) {
        if (k[i] > 65536 || k[i] % 32) return;  // the static buffers above hold K <= 65536; K a multiple of the block
        int nb = k[i] / 32, tiles = (n[i] + 15) / 16, chunk = tiles / (8 * threads);
        if (chunk < 1) chunk = 1;
        quant_x(x[i], k[i], qa, sa, nasum);
        job_t j = {w[i], qa, sa, nasum, nb, tiles, chunk, (tiles + chunk - 1) / chunk, y[i]};
        atomic_store(&g_next, 0xffffffffu);  // closed while the job is written
        g_job = j;
        atomic_store_explicit(&g_done, 0, memory_order_relaxed);
        atomic_store_explicit(&g_next, (uint64_t)(++job) << 32, memory_order_release);
        run_chunks();
        while (atomic_load_explicit(&g_done, memory_order_acquire) < j.chunks) _mm_pause();
    }
}

/*
 * Multithreaded stress of the CalRT emulator, for the sanitizer builds (make asan / tsan /
 * check-sanitizers). Usage: stress [seconds] (default 8, capped at 20).
 *
 * Threads: decode workers on both engines (fixed PING/PONG and auto), a prefill worker with
 * slices, and a chaos thread that arms seeded faults (CCU exception, NaN, hang, stale
 * completion, Wait/submit codes, map/slice failures), flips knobs, resets (CCU,
 * configuration, full) and reconfigures, and hammers the API with forged, NULL and stale
 * handles and bad names/dtypes/sizes. Workers follow the executor's rules: after infer()
 * succeeds they do not touch the buffers until Wait reports the job finished (an injected
 * Wait failure is followed by more waits). Exit 0 when the run ends with consistent
 * counters, 1 otherwise; sanitizer reports fail the run through their exit codes.
 */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "calrt.h"
#include "calrt_emu.h"

enum { VOCAB = 4096, MAX_SEQ = 4096, TILE = 16, DECODE_WORKERS = 4, PREFILL_MAX = 48 };

static calrt_device *g_dev;
static calrt_calbin *g_cb;
static calrt_kv *g_kv;
static calrt_model *g_prefill, *g_decode;
static volatile int g_stop_flag;
static pthread_mutex_t g_cfg_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_failures;

static int stopped(void) { return __atomic_load_n(&g_stop_flag, __ATOMIC_ACQUIRE); }

static uint64_t rnd(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void fail(const char *what, int32_t rc)
{
    fprintf(stderr, "stress: %s: unexpected code %d\n", what, rc);
    __atomic_add_fetch(&g_failures, 1, __ATOMIC_RELAXED);
}

static void pause_us(long us)
{
    struct timespec ts = {0, us * 1000L};
    nanosleep(&ts, NULL);
}

static int write_calbin(char *path)
{
    FILE *f;
    int fd = mkstemp(path);
    if (fd < 0 || !(f = fdopen(fd, "w")))
        return 0;
    fprintf(f, "CALBIN 1\nseed 99\n");
    fprintf(f, "model p prefill_ids\nmeta logits_tile_d0 %d\nmeta max_seq %d\nmeta vocab %d\n", TILE, MAX_SEQ, VOCAB);
    fprintf(f, "input input_ids S32 1 1,%d\ninput positions S32 1 1,%d\noutput logits BF16 0 1,%d,%d\n", MAX_SEQ,
            MAX_SEQ, TILE, VOCAB);
    fprintf(f, "csr cur_seq_len\ncsr total_seq_len\nend\n");
    fprintf(f, "model d decode\nmeta logits_tile_d0 1\nmeta max_seq %d\nmeta vocab %d\n", MAX_SEQ, VOCAB);
    fprintf(f, "input input_ids S32 0 1,1\ninput positions S32 0 1,1\noutput logits BF16 0 1,1,%d\n", VOCAB);
    fprintf(f, "csr cur_seq_len\ncsr total_seq_len\nend\n");
    return fclose(f) == 0;
}

/* Wait until the job is finished (any final status) or the run stops. */
static void wait_final(calrt_outputbuf *ob, uint64_t *rng)
{
    while (!stopped()) {
        int32_t rc = calrt_wait(ob, (int64_t)(rnd(rng) % 3000));
        int32_t st = -1;
        if (rc == CALRT_SUCCESS)
            return;
        if (calrt_get_status(ob, &st) != CALRT_SUCCESS)
            fail("get_status", -1);
    }
}

typedef struct worker {
    int seq;
    int prefill;
    uint64_t rng;
    int32_t ids[MAX_SEQ], pos[MAX_SEQ];
    uint16_t *out;
} worker;

static void *worker_main(void *arg)
{
    worker *w = (worker *)arg;
    calrt_model *m = w->prefill ? g_prefill : g_decode;
    calrt_inputbuf *ib = NULL;
    calrt_outputbuf *ob = NULL;
    uint64_t out_bytes = (uint64_t)(w->prefill ? TILE : 1) * VOCAB * 2;
    w->out = (uint16_t *)calloc(1, out_bytes);
    if (!w->out || calrt_inputbuf_create(m, &ib) || calrt_outputbuf_create(m, &ob)) {
        fail("worker setup", -1);
        return NULL;
    }
    uint64_t in_bytes = w->prefill ? sizeof w->ids : 4;
    while (!stopped()) {
        /* map may fail by injection: retry next round */
        if (calrt_inputbuf_map(ib, "input_ids", CALRT_DTYPE_S32, w->ids, in_bytes) ||
            calrt_inputbuf_map(ib, "positions", CALRT_DTYPE_S32, w->pos, in_bytes) ||
            calrt_outputbuf_map(ob, "logits", CALRT_DTYPE_BF16, w->out, out_bytes))
            continue;
        uint32_t past = 0;
        if (calrt_kv_seq_len(g_kv, w->seq, &past) != CALRT_SUCCESS)
            fail("seq_len", -1);
        uint32_t n = w->prefill ? 1 + (uint32_t)(rnd(&w->rng) % PREFILL_MAX) : 1;
        if (past + n >= MAX_SEQ || rnd(&w->rng) % 64 == 0) {
            calrt_kv_release(g_kv, w->seq);
            past = 0;
        }
        for (uint32_t i = 0; i < n; i++) {
            w->ids[i] = (int32_t)(rnd(&w->rng) % VOCAB);
            w->pos[i] = (int32_t)(past + i);
        }
        if (w->prefill && (calrt_inputbuf_slice(ib, "input_ids", 0, n) || calrt_inputbuf_slice(ib, "positions", 0, n)))
            continue;
        if (calrt_inputbuf_set_csr(ib, "cur_seq_len", n) || calrt_inputbuf_set_csr(ib, "total_seq_len", past + n))
            continue;
        if (!calrt_kv_apply(g_kv, w->seq, past + n)) {
            pause_us(50);
            continue;
        }
        int32_t rc;
        int mode = (int)(rnd(&w->rng) % 3);
        if (mode == 2)
            rc = calrt_infer(g_dev, m, g_kv, w->seq, ib, ob);
        else
            rc = calrt_infer_with_fixed_task_type(g_dev, m, g_kv, w->seq, ib, ob, mode);
        if (rc == CALRT_SUCCESS) {
            wait_final(ob, &w->rng);
            if (w->prefill)
                calrt_inputbuf_undo_slice(ib, "input_ids");
        } else if (rc != CALRT_ERR_DEVICE_BUSY && rc != CALRT_ERR_MISSING_CONFIG && rc != CALRT_ERR_UNSUPPORTED &&
                   rc != CALRT_ERR_DEVICE_UNAVAILABLE && rc != CALRT_ERR_INVALID_CONFIG) {
            fail("infer", rc);
        } else {
            pause_us(100);
        }
    }
    return NULL;
}

static void bad_calls(uint64_t *rng)
{
    static int32_t scratch[64];
    calrt_device *forged = (calrt_device *)(uintptr_t)(rnd(rng) | 1);
    int32_t st;
    if (calrt_reset(forged) != CALRT_ERR_INVALID_VALUE)
        fail("forged reset", -1);
    if (calrt_wait(NULL, 0) != CALRT_ERR_INVALID_VALUE || calrt_get_status(NULL, &st) != CALRT_ERR_INVALID_VALUE)
        fail("null wait/status", -1);
    calrt_inputbuf *ib = NULL;
    calrt_outputbuf *ob = NULL;
    if (calrt_inputbuf_create(g_prefill, &ib) != CALRT_SUCCESS || calrt_outputbuf_create(g_decode, &ob) != CALRT_SUCCESS) {
        fail("create", -1);
        return;
    }
    int32_t rc = calrt_inputbuf_map(ib, "input_ids", CALRT_DTYPE_F32, scratch, sizeof scratch);
    if (rc != CALRT_ERR_DTYPE_MISMATCH && rc != CALRT_ERR_MAP_BROKEN)
        fail("map dtype", rc);
    rc = calrt_inputbuf_map(ib, "nope", CALRT_DTYPE_S32, scratch, sizeof scratch);
    if (rc != CALRT_ERR_INVALID_VALUE)
        fail("map name", rc);
    rc = calrt_inputbuf_slice(ib, "input_ids", MAX_SEQ - 1, 2);
    if (rc != CALRT_ERR_OUT_OF_BOUNDS)
        fail("slice range", rc);
    if (calrt_wait(ob, 0) != CALRT_ERR_INVALID_VALUE)
        fail("wait idle", -1);
    calrt_inputbuf_destroy(ib);
    calrt_outputbuf_destroy(ob);
    if (calrt_inputbuf_set_csr(ib, "cur_seq_len", 1) != CALRT_ERR_INVALID_VALUE ||
        calrt_outputbuf_destroy(ob) != CALRT_ERR_INVALID_VALUE)
        fail("stale handle", -1);
}

static void *chaos_main(void *arg)
{
    uint64_t rng = (uint64_t)(uintptr_t)arg | 1;
    static const int points[] = {CALRT_EMU_FAULT_CCU_EXCEPTION, CALRT_EMU_FAULT_OUTPUT_NAN, CALRT_EMU_FAULT_OUTPUT_SHORT,
                                 CALRT_EMU_FAULT_HANG, CALRT_EMU_FAULT_STALE_COMPLETION, CALRT_EMU_FAULT_WAIT_RC,
                                 CALRT_EMU_FAULT_SUBMIT_RC, CALRT_EMU_FAULT_MAP_FAIL, CALRT_EMU_FAULT_APPLY_FALSE,
                                 CALRT_EMU_FAULT_SLICE_FAIL, CALRT_EMU_FAULT_UNKNOWN_CSR};
    while (!stopped()) {
        uint64_t r = rnd(&rng);
        int point = points[r % (sizeof points / sizeof points[0])];
        calrt_emu_fault_set(g_dev, point, CALRT_EMU_MODE_PROB, 20000 + (r >> 40) % 60000, r, 0);
        if (r % 7 == 0)
            calrt_emu_fault_clear(g_dev, point);
        calrt_emu_set_knob(g_dev, "overlap", (int64_t)((r >> 8) % 3));
        calrt_emu_set_knob(g_dev, "kv_after_failed_wait", (int64_t)((r >> 12) % 3));
        calrt_emu_set_knob(g_dev, "stale_delay_us", (int64_t)((r >> 16) % 500));
        pthread_mutex_lock(&g_cfg_mu);
        int32_t rc = CALRT_SUCCESS;
        switch ((r >> 20) % 8) {
        case 0: rc = calrt_reset(g_dev); break;
        case 1: rc = calrt_reset_configuration(g_dev); break;
        case 2:
        case 3: rc = calrt_reset_ccu(g_dev); break;
        default: break;
        }
        if (rc != CALRT_SUCCESS)
            fail("reset", rc);
        rc = calrt_configure(g_dev, g_cb);
        if (rc != CALRT_SUCCESS && rc != CALRT_ERR_ALREADY_CONFIGURED)
            fail("configure", rc);
        pthread_mutex_unlock(&g_cfg_mu);
        calrt_emu_counters c;
        if (calrt_emu_get_counters(g_dev, &c) != CALRT_SUCCESS)
            fail("counters", -1);
        bad_calls(&rng);
        pause_us(2000 + (long)(r % 3000));
    }
    return NULL;
}

int main(int argc, char **argv)
{
    int seconds = argc > 1 ? atoi(argv[1]) : 8;
    if (seconds < 1 || seconds > 20)
        seconds = 8;
    char path[] = "/tmp/calrt_stress_XXXXXX";
    if (!write_calbin(path)) {
        fprintf(stderr, "stress: cannot write calbin\n");
        return 1;
    }
    calrt_model *models[4];
    int32_t count = 0;
    if (calrt_device_open("queue_depth=4;kv_block_size=16;kv_blocks=4096;decode_us=20;h2d_us=5", &g_dev) ||
        calrt_calbin_load(g_dev, path, &g_cb) || calrt_configure(g_dev, g_cb) || calrt_kv_create(g_dev, g_cb, &g_kv) ||
        calrt_get_all_models(g_cb, models, 4, &count) || count != 2 || calrt_enable_parallel_mode(g_dev, 1)) {
        fprintf(stderr, "stress: setup failed\n");
        unlink(path);
        return 1;
    }
    unlink(path);
    g_prefill = models[0];
    g_decode = models[1];
    static worker workers[DECODE_WORKERS + 1];
    pthread_t th[DECODE_WORKERS + 2];
    for (int i = 0; i <= DECODE_WORKERS; i++) {
        workers[i].seq = i;
        workers[i].prefill = i == DECODE_WORKERS;
        workers[i].rng = 0x9E3779B97F4A7C15ULL * (uint64_t)(i + 1);
        pthread_create(&th[i], NULL, worker_main, &workers[i]);
    }
    pthread_create(&th[DECODE_WORKERS + 1], NULL, chaos_main, (void *)(uintptr_t)0xC4A05);
    sleep((unsigned)seconds);
    __atomic_store_n(&g_stop_flag, 1, __ATOMIC_RELEASE);
    /* Hung jobs keep their workers' buffers; a reset lets everyone finish. */
    calrt_reset_ccu(g_dev);
    for (int i = 0; i < DECODE_WORKERS + 2; i++)
        pthread_join(th[i], NULL);
    calrt_reset_ccu(g_dev);
    calrt_emu_counters c;
    calrt_emu_get_counters(g_dev, &c);
    uint64_t ended = c.jobs_executed + c.ccu_exceptions + c.jobs_aborted;
    printf("stress: %d s, submitted %llu executed %llu ccu %llu aborted %llu hangs %llu resets %llu/%llu/%llu "
           "stale %llu failures %d\n",
           seconds, (unsigned long long)c.jobs_submitted, (unsigned long long)c.jobs_executed,
           (unsigned long long)c.ccu_exceptions, (unsigned long long)c.jobs_aborted, (unsigned long long)c.hangs,
           (unsigned long long)c.resets_ccu, (unsigned long long)c.resets_configuration,
           (unsigned long long)c.resets_full, (unsigned long long)c.stale_completions, g_failures);
    if (ended != c.jobs_submitted) {
        fprintf(stderr, "stress: %llu jobs submitted but %llu ended\n", (unsigned long long)c.jobs_submitted,
                (unsigned long long)ended);
        g_failures++;
    }
    if (calrt_device_close(g_dev) != CALRT_SUCCESS)
        g_failures++;
    for (int i = 0; i <= DECODE_WORKERS; i++)
        free(workers[i].out);
    return g_failures ? 1 : 0;
}

/*
 * The floor of the executor's per-token control cost (issue 28): the same greedy decode the
 * executor runs, on the emulator, in C, with the two device threads the executor has and
 * nothing else. Invariant 2: only the submitter thread calls infer, only the completion
 * thread calls Wait. Per token:
 *
 *   completion thread: Wait -> status -> argmax over the BF16 logits row -> hand-off
 *   submitter thread:  (woken by the hand-off) write the token and its position, CSRs ->
 *                      infer -> hand-off of the job in flight to the completion thread
 *
 * Two hand-offs per token (mutex + condition variable each way), no queues, no charts, no
 * allocation after setup. With --roles 3 the executor's third role joins: the completion
 * thread hands the argmax to a caller thread, which hands it on to the submitter (three
 * hand-offs per token, the executor's caller -> submitter -> completion -> caller, in C:
 * no GIL). Job 0 is the prompt's prefill (sliced, valid row (n-1) % D0), then
 * warm-up decode tokens (not timed), then the timed decode tokens. The KV of the whole block
 * is reserved once before the prefill, as the executor's kv_reserve_len does.
 *
 * Token time i = completion time of token i minus that of token i-1 (the argmax done), the
 * steady-state period of the loop; the floor = token time minus the device's decode latency.
 *
 * Usage: floor [--calbin PATH] [--decode-us US] [--tokens N] [--warmup W] [--prompt a,b,...]
 *              [--prefill NAME] [--decode NAME] [--roles 2|3]
 * Without --calbin it writes a small calbin of its own (for the sanitizer builds). Prints one
 * JSON object on stdout: token_us (every timed token), token_us_p50/p99, floor_us_p50/p99,
 * tokens (the prefill's argmax then every decode token), counters. Exit 0, 1 on a runtime
 * failure (the reason on stderr), 2 on a bad argument (one line naming it).
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "calrt.h"
#include "calrt_emu.h"

enum { MAX_PROMPT = 256, MAX_TOKENS = 100000, MAX_DECODE_US = 1000000, WAIT_US = 30000000 };

/* the synthetic calbin's model names (drivers/synthetic/calbin.py) */
static const char *g_prefill_name = "qwen3_prefill_ids_s40960_b1";
static const char *g_decode_name = "qwen3_decode_s40960_b1";

typedef struct slot {
    calrt_model *model;
    calrt_inputbuf *ib;
    calrt_outputbuf *ob;
    int32_t *ids, *pos;
    uint16_t *logits;
    uint64_t in_elems, tile_d0, vocab;
    int sliceable;
} slot;

typedef struct loop {
    calrt_device *dev;
    calrt_kv *kv;
    slot prefill, decode;
    int32_t prompt[MAX_PROMPT];
    int prompt_len;
    long warmup, tokens, decode_us, roles;
    /* the hand-offs: guarded by mu */
    pthread_mutex_t mu;
    pthread_cond_t to_submitter, to_completion, to_caller;
    int token_ready, job_ready, result_ready, failed;
    int32_t token, result;
    slot *job_slot;  /* the slot of the job in flight */
    uint64_t job_row; /* its valid row */
    /* written by the completion thread only, read after both threads joined */
    int32_t *out_tokens;
    int64_t *done_ns;
} loop;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void fail(loop *l, const char *what, int32_t rc)
{
    fprintf(stderr, "floor: %s: code %d\n", what, rc);
    pthread_mutex_lock(&l->mu);
    l->failed = 1;
    pthread_cond_broadcast(&l->to_submitter);
    pthread_cond_broadcast(&l->to_completion);
    pthread_cond_broadcast(&l->to_caller);
    pthread_mutex_unlock(&l->mu);
}

/* numpy's argmax of the BF16 values: the first index of the largest (NaN never occurs: the
 * device writes finite logits unless a fault is armed, and none is here) */
static int32_t argmax_bf16(const uint16_t *row, uint64_t n)
{
    uint64_t best = 0;
    float best_v = 0.0f;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)row[i] << 16;
        float v;
        memcpy(&v, &bits, sizeof v);
        if (i == 0 || v > best_v) {
            best_v = v;
            best = i;
        }
    }
    return (int32_t)best;
}

/* Submitter: the only thread that calls infer. Job j = 0 is the prefill, then decodes. */
static void *submitter_main(void *arg)
{
    loop *l = (loop *)arg;
    long jobs = 1 + l->warmup + l->tokens;
    uint32_t past = 0;
    for (long j = 0; j < jobs; j++) {
        slot *s = j == 0 ? &l->prefill : &l->decode;
        uint32_t n = j == 0 ? (uint32_t)l->prompt_len : 1;
        if (j == 0) {
            for (uint32_t i = 0; i < n; i++) {
                s->ids[i] = l->prompt[i];
                s->pos[i] = (int32_t)i;
            }
        } else {
            pthread_mutex_lock(&l->mu);
            while (!l->token_ready && !l->failed)
                pthread_cond_wait(&l->to_submitter, &l->mu);
            int32_t token = l->token;
            l->token_ready = 0;
            int failed = l->failed;
            pthread_mutex_unlock(&l->mu);
            if (failed)
                return NULL;
            s->ids[0] = token;
            s->pos[0] = (int32_t)past;
        }
        int32_t rc = CALRT_SUCCESS;
        if (s->sliceable && ((rc = calrt_inputbuf_slice(s->ib, "input_ids", 0, n)) != CALRT_SUCCESS ||
                             (rc = calrt_inputbuf_slice(s->ib, "positions", 0, n)) != CALRT_SUCCESS)) {
            fail(l, "slice", rc);
            return NULL;
        }
        if ((rc = calrt_inputbuf_set_csr(s->ib, "cur_seq_len", n)) != CALRT_SUCCESS ||
            (rc = calrt_inputbuf_set_csr(s->ib, "total_seq_len", past + n)) != CALRT_SUCCESS) {
            fail(l, "set_csr", rc);
            return NULL;
        }
        rc = calrt_infer(l->dev, s->model, l->kv, 0, s->ib, s->ob);
        if (rc != CALRT_SUCCESS) {
            fail(l, "infer", rc);
            return NULL;
        }
        past += n;
        pthread_mutex_lock(&l->mu);
        l->job_slot = s;
        l->job_row = (n - 1) % s->tile_d0;
        l->job_ready = 1;
        pthread_cond_signal(&l->to_completion);
        pthread_mutex_unlock(&l->mu);
    }
    return NULL;
}

/* Completion thread: the only thread that calls Wait. */
static void *completion_main(void *arg)
{
    loop *l = (loop *)arg;
    long jobs = 1 + l->warmup + l->tokens;
    for (long j = 0; j < jobs; j++) {
        pthread_mutex_lock(&l->mu);
        while (!l->job_ready && !l->failed)
            pthread_cond_wait(&l->to_completion, &l->mu);
        slot *s = l->job_slot;
        uint64_t row = l->job_row;
        l->job_ready = 0;
        int failed = l->failed;
        pthread_mutex_unlock(&l->mu);
        if (failed)
            return NULL;
        int32_t rc = calrt_wait(s->ob, WAIT_US), status = -1;
        if (rc != CALRT_SUCCESS) {
            fail(l, "wait", rc);
            return NULL;
        }
        if ((rc = calrt_get_status(s->ob, &status)) != CALRT_SUCCESS || status != CALRT_JOB_DONE) {
            fail(l, "job status (3 = done)", rc != CALRT_SUCCESS ? rc : status);
            return NULL;
        }
        if (s->sliceable && (rc = calrt_inputbuf_undo_slice(s->ib, "input_ids")) == CALRT_SUCCESS)
            rc = calrt_inputbuf_undo_slice(s->ib, "positions");
        if (rc != CALRT_SUCCESS) {
            fail(l, "undo_slice", rc);
            return NULL;
        }
        int32_t token = argmax_bf16(s->logits + row * s->vocab, s->vocab);
        l->done_ns[j] = now_ns();
        l->out_tokens[j] = token;
        pthread_mutex_lock(&l->mu);
        if (l->roles == 3) { /* to the caller, who hands it on */
            l->result = token;
            l->result_ready = 1;
            pthread_cond_signal(&l->to_caller);
        } else {
            l->token = token;
            l->token_ready = 1;
            pthread_cond_signal(&l->to_submitter);
        }
        pthread_mutex_unlock(&l->mu);
    }
    return NULL;
}

/* Caller (--roles 3): takes each job's argmax from the completion thread and hands it to the
 * submitter as the next token, as the executor's caller does with a result. */
static void *caller_main(void *arg)
{
    loop *l = (loop *)arg;
    long jobs = 1 + l->warmup + l->tokens;
    for (long j = 0; j + 1 < jobs; j++) { /* every job but the last feeds a next one */
        pthread_mutex_lock(&l->mu);
        while (!l->result_ready && !l->failed)
            pthread_cond_wait(&l->to_caller, &l->mu);
        int failed = l->failed;
        l->result_ready = 0;
        if (!failed) {
            l->token = l->result;
            l->token_ready = 1;
            pthread_cond_signal(&l->to_submitter);
        }
        pthread_mutex_unlock(&l->mu);
        if (failed)
            return NULL;
    }
    return NULL;
}

static int setup_slot(loop *l, calrt_calbin *cb, const char *name, slot *s)
{
    calrt_model *models[16];
    int32_t count = 0;
    char buf[CALRT_NAME_MAX];
    if (calrt_get_all_models(cb, models, 16, &count) != CALRT_SUCCESS)
        return 0;
    s->model = NULL;
    for (int32_t i = 0; i < count && i < 16; i++)
        if (calrt_model_name(models[i], buf, sizeof buf) == CALRT_SUCCESS && strcmp(buf, name) == 0)
            s->model = models[i];
    if (!s->model) {
        fprintf(stderr, "floor: the calbin has no model named %s\n", name);
        return 0;
    }
    calrt_tensor_info in, out;
    if (calrt_model_input_info(s->model, 0, &in) != CALRT_SUCCESS ||
        calrt_model_output_info(s->model, 0, &out) != CALRT_SUCCESS || out.rank != 3 || in.rank != 2) {
        fprintf(stderr, "floor: %s: not a [1,S] ids -> [1,D0,V] logits graph\n", name);
        return 0;
    }
    s->in_elems = in.shape[1];
    s->tile_d0 = out.shape[1];
    s->vocab = out.shape[2];
    s->sliceable = in.sliceable;
    s->ids = (int32_t *)calloc(s->in_elems, sizeof(int32_t));
    s->pos = (int32_t *)calloc(s->in_elems, sizeof(int32_t));
    s->logits = (uint16_t *)calloc(s->tile_d0 * s->vocab, sizeof(uint16_t));
    if (!s->ids || !s->pos || !s->logits || calrt_inputbuf_create(s->model, &s->ib) != CALRT_SUCCESS ||
        calrt_outputbuf_create(s->model, &s->ob) != CALRT_SUCCESS ||
        calrt_inputbuf_map(s->ib, "input_ids", CALRT_DTYPE_S32, s->ids, s->in_elems * 4) != CALRT_SUCCESS ||
        calrt_inputbuf_map(s->ib, "positions", CALRT_DTYPE_S32, s->pos, s->in_elems * 4) != CALRT_SUCCESS ||
        calrt_outputbuf_map(s->ob, "logits", CALRT_DTYPE_BF16, s->logits, s->tile_d0 * s->vocab * 2) !=
            CALRT_SUCCESS) {
        fprintf(stderr, "floor: %s: buffer setup failed\n", name);
        return 0;
    }
    (void)l;
    return 1;
}

static void free_slot(slot *s)
{
    free(s->ids);
    free(s->pos);
    free(s->logits);
}

/* a small calbin of the synthetic one's shape, for runs without --calbin */
static int write_calbin(char *path)
{
    FILE *f;
    int fd = mkstemp(path);
    if (fd < 0 || !(f = fdopen(fd, "w")))
        return 0;
    fprintf(f, "CALBIN 1\nseed 99\n");
    fprintf(f, "model %s prefill_ids\nmeta logits_tile_d0 16\nmeta max_seq 2048\nmeta vocab 4096\n", g_prefill_name);
    fprintf(f, "input input_ids S32 1 1,2048\ninput positions S32 1 1,2048\noutput logits BF16 0 1,16,4096\n");
    fprintf(f, "csr cur_seq_len\ncsr total_seq_len\nend\n");
    fprintf(f, "model %s decode\nmeta logits_tile_d0 1\nmeta max_seq 2048\nmeta vocab 4096\n", g_decode_name);
    fprintf(f, "input input_ids S32 0 1,1\ninput positions S32 0 1,1\noutput logits BF16 0 1,1,4096\n");
    fprintf(f, "csr cur_seq_len\ncsr total_seq_len\nend\n");
    return fclose(f) == 0;
}

/* numpy's default percentile (linear interpolation) of sorted values */
static double percentile(const double *sorted, long n, double q)
{
    double rank = q / 100.0 * (double)(n - 1);
    long lo = (long)rank;
    long hi = lo + 1 < n ? lo + 1 : lo;
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - (double)lo);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int bad_arg(const char *flag, const char *value, const char *why)
{
    fprintf(stderr, "floor: %s=%s: %s\n", flag, value ? value : "", why);
    return 2;
}

static int parse_long(const char *text, long lo, long hi, long *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || end == text || *end != '\0' || v < lo || v > hi)
        return 0;
    *out = v;
    return 1;
}

static int parse_prompt(loop *l, const char *text)
{
    char copy[4096];
    if (strlen(text) >= sizeof copy)
        return 0;
    strcpy(copy, text);
    l->prompt_len = 0;
    char *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        long v;
        if (l->prompt_len >= MAX_PROMPT || !parse_long(tok, 0, INT32_MAX, &v))
            return 0;
        l->prompt[l->prompt_len++] = (int32_t)v;
    }
    return l->prompt_len > 0;
}

int main(int argc, char **argv)
{
    static loop l;
    const char *calbin = NULL;
    pthread_mutex_init(&l.mu, NULL);
    pthread_cond_init(&l.to_submitter, NULL);
    pthread_cond_init(&l.to_completion, NULL);
    pthread_cond_init(&l.to_caller, NULL);
    l.roles = 2;
    l.decode_us = 2000;
    l.tokens = 100;
    l.warmup = 8;
    l.prompt_len = 17;
    for (int i = 0; i < l.prompt_len; i++)
        l.prompt[i] = i + 1;
    for (int i = 1; i < argc; i++) {
        const char *flag = argv[i], *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (!value)
            return bad_arg(flag, NULL, "needs a value (usage: see the head of drivers/calrt/floor.c)");
        i++;
        if (strcmp(flag, "--calbin") == 0)
            calbin = value;
        else if (strcmp(flag, "--decode-us") == 0) {
            if (!parse_long(value, 0, MAX_DECODE_US, &l.decode_us))
                return bad_arg(flag, value, "must be an integer in 0..1000000");
        } else if (strcmp(flag, "--tokens") == 0) {
            if (!parse_long(value, 1, MAX_TOKENS, &l.tokens))
                return bad_arg(flag, value, "must be an integer in 1..100000");
        } else if (strcmp(flag, "--warmup") == 0) {
            if (!parse_long(value, 0, MAX_TOKENS, &l.warmup))
                return bad_arg(flag, value, "must be an integer in 0..100000");
        } else if (strcmp(flag, "--prompt") == 0) {
            if (!parse_prompt(&l, value))
                return bad_arg(flag, value, "must be 1..256 comma-separated token ids");
        } else if (strcmp(flag, "--prefill") == 0)
            g_prefill_name = value;
        else if (strcmp(flag, "--decode") == 0)
            g_decode_name = value;
        else if (strcmp(flag, "--roles") == 0) {
            if (!parse_long(value, 2, 3, &l.roles))
                return bad_arg(flag, value, "must be 2 (submitter, completion) or 3 (and a caller)");
        }
        else
            return bad_arg(flag, value, "unknown flag (usage: see the head of drivers/calrt/floor.c)");
    }
    char own[] = "/tmp/calrt_floor_XXXXXX";
    if (!calbin) {
        if (!write_calbin(own)) {
            fprintf(stderr, "floor: cannot write a calbin\n");
            return 1;
        }
        calbin = own;
    }
    long jobs = 1 + l.warmup + l.tokens;
    char config[64];
    snprintf(config, sizeof config, "decode_us=%ld", l.decode_us);
    calrt_calbin *cb = NULL;
    int ok = calrt_device_open(config, &l.dev) == CALRT_SUCCESS && calrt_calbin_load(l.dev, calbin, &cb) == CALRT_SUCCESS &&
             calrt_configure(l.dev, cb) == CALRT_SUCCESS && calrt_kv_create(l.dev, cb, &l.kv) == CALRT_SUCCESS;
    if (calbin == own)
        unlink(own);
    if (!ok) {
        fprintf(stderr, "floor: device setup failed (open, calbin %s, configure, kv)\n", calbin == own ? "own" : calbin);
        return 1;
    }
    int rc = 1;
    l.out_tokens = (int32_t *)calloc((size_t)jobs, sizeof(int32_t));
    l.done_ns = (int64_t *)calloc((size_t)jobs, sizeof(int64_t));
    double *token_us = (double *)calloc((size_t)l.tokens, sizeof(double));
    double *sorted = (double *)calloc((size_t)l.tokens, sizeof(double));
    if (!l.out_tokens || !l.done_ns || !token_us || !sorted || !setup_slot(&l, cb, g_prefill_name, &l.prefill) ||
        !setup_slot(&l, cb, g_decode_name, &l.decode))
        goto out;
    if ((uint64_t)l.prompt_len > l.prefill.in_elems || (uint64_t)(l.prompt_len + jobs) > l.prefill.in_elems ||
        !calrt_kv_apply(l.kv, 0, (uint32_t)(l.prompt_len + jobs))) {
        fprintf(stderr, "floor: the block (%d + %ld tokens) does not fit the model or its KV\n", l.prompt_len, jobs);
        goto out;
    }
    pthread_t sub, comp, caller;
    if (pthread_create(&comp, NULL, completion_main, &l) != 0) {
        fprintf(stderr, "floor: cannot start the completion thread\n");
        goto out;
    }
    if (l.roles == 3 && pthread_create(&caller, NULL, caller_main, &l) != 0) {
        fail(&l, "cannot start the caller thread", -1);
        pthread_join(comp, NULL);
        goto out;
    }
    if (pthread_create(&sub, NULL, submitter_main, &l) != 0) {
        fail(&l, "cannot start the submitter thread", -1);
        pthread_join(comp, NULL);
        if (l.roles == 3)
            pthread_join(caller, NULL);
        goto out;
    }
    pthread_join(sub, NULL);
    pthread_join(comp, NULL);
    if (l.roles == 3)
        pthread_join(caller, NULL);
    if (l.failed)
        goto out;
    long first = 1 + l.warmup; /* the first timed decode job */
    for (long i = 0; i < l.tokens; i++) {
        token_us[i] = (double)(l.done_ns[first + i] - l.done_ns[first + i - 1]) / 1e3;
        sorted[i] = token_us[i];
    }
    qsort(sorted, (size_t)l.tokens, sizeof(double), cmp_double);
    double p50 = percentile(sorted, l.tokens, 50), p99 = percentile(sorted, l.tokens, 99);
    calrt_emu_counters c;
    if (calrt_emu_get_counters(l.dev, &c) != CALRT_SUCCESS) {
        fprintf(stderr, "floor: counters failed\n");
        goto out;
    }
    printf("{\"program\": \"calrt-floor\", \"threads\": %ld, \"handoffs_per_token\": %ld, \"decode_us\": %ld, "
           "\"tokens\": %ld, \"warmup\": %ld, \"prompt_len\": %d, \"vocab\": %llu, ",
           l.roles, l.roles, l.decode_us, l.tokens, l.warmup, l.prompt_len, (unsigned long long)l.decode.vocab);
    printf("\"token_us_p50\": %.2f, \"token_us_p99\": %.2f, \"floor_us_p50\": %.2f, \"floor_us_p99\": %.2f, ", p50, p99,
           p50 - (double)l.decode_us, p99 - (double)l.decode_us);
    printf("\"jobs_submitted\": %llu, \"jobs_executed\": %llu, \"dma_violations\": %llu, \"token_us\": [",
           (unsigned long long)c.jobs_submitted, (unsigned long long)c.jobs_executed,
           (unsigned long long)(c.dma_input_violations + c.dma_output_violations));
    for (long i = 0; i < l.tokens; i++)
        printf("%s%.3f", i ? ", " : "", token_us[i]);
    printf("], \"token_ids\": [");
    for (long j = 0; j < jobs; j++)
        printf("%s%d", j ? ", " : "", l.out_tokens[j]);
    printf("]}\n");
    rc = 0;
out:
    if (calrt_device_close(l.dev) != CALRT_SUCCESS && rc == 0) {
        fprintf(stderr, "floor: device close failed\n");
        rc = 1;
    }
    free_slot(&l.prefill);
    free_slot(&l.decode);
    free(l.out_tokens);
    free(l.done_ns);
    free(token_us);
    free(sorted);
    return rc;
}

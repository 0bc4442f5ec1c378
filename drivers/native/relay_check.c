/* Self-check of the native relay (calexec_relay.c) for the sanitizer builds (ASan+UBSan, TSan;
 * `make -C drivers/calrt check-sanitizers`). A fake runtime in C (a job "runs" for a few
 * microseconds; its logits' argmax is a function of the token it was given), and the three
 * threads of the design: the submitter (submitter_wait; after each job given to infer it arms
 * the next job and registers its fire rule), the completion thread (completion_wait; a job
 * whose rule did not fire is fired by it, the plain path), and a third thread that withdraws
 * rules at random (a cancel racing the firing), and a consumer waiting in C for each job's
 * decision (calexec_relay_result_wait). Checks: every job completes once, in order;
 * each job's input token is its predecessor's argmax whichever path fired it; a withdrawal
 * that answered 1 was never followed by that rule's firing. Exit 0, 1 on a failed check. */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "calexec_native.h"
#include "calexec_relay.h"

enum { JOBS = 4000, VOCAB = 256, SLOTS = 2, DONE = 3 };

typedef struct fake_slot {
    int32_t token;                /* the job's input (written by the rule or the plain path) */
    uint16_t logits[VOCAB];       /* written by the fake device when the job runs */
    float row[VOCAB];
    atomic_long tag;              /* the job in flight on this slot */
} fake_slot;

static fake_slot g_slots[SLOTS];
static atomic_long g_withdrawn_then_fired, g_completed, g_bad_token, g_out_of_order;
static atomic_int g_withdraw_won[JOBS + 2];
static calexec_relay *g_relay;

static int32_t argmax_of(int32_t token) { return (token * 31 + 7) % VOCAB; }

static void sleep_us(long us)
{
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

/* the fake runtime: a job's logits put their maximum at argmax_of(its input token) */
static int32_t fake_infer(void *dev, void *model, void *kv, int32_t seq, void *inbuf, void *outbuf)
{
    (void)dev, (void)model, (void)kv, (void)seq, (void)inbuf;
    fake_slot *s = (fake_slot *)outbuf;
    int32_t best = argmax_of(s->token);
    for (int i = 0; i < VOCAB; i++)
        s->logits[i] = (uint16_t)(i == best ? 0x4080 : 0x3f80); /* 4.0 at best, 1.0 elsewhere */
    return 0;
}

static int32_t fake_wait(void *outbuf, int64_t timeout_us)
{
    (void)outbuf, (void)timeout_us;
    sleep_us(20);
    return 0;
}

static int32_t fake_status(void *outbuf, int32_t *status)
{
    (void)outbuf;
    *status = DONE;
    return 0;
}

static int32_t fake_valid(void *outbuf, uint64_t *bytes)
{
    (void)outbuf;
    *bytes = VOCAB * 2;
    return 0;
}

static calexec_relay_job job_of(long tag)
{
    calexec_relay_job j;
    memset(&j, 0, sizeof j);
    j.tag = tag;
    j.outbuf = &g_slots[tag % SLOTS];
    j.inbuf = j.outbuf;
    return j;
}

static void *submitter(void *arg)
{
    (void)arg;
    for (;;) {
        calexec_relay_event ev;
        if (calexec_relay_submitter_wait(g_relay, 1000000, &ev) != CALEXEC_RELAY_OK || ev.kind == CALEXEC_RELAY_CLOSED)
            return NULL;
        if (ev.kind != CALEXEC_RELAY_INFERRED || ev.tag >= JOBS)
            continue;
        long next = ev.tag + 1;
        fake_slot *cur = &g_slots[ev.tag % SLOTS], *nxt = &g_slots[next % SLOTS];
        atomic_store(&nxt->tag, next);
        calexec_relay_rule rule;
        memset(&rule, 0, sizeof rule);
        rule.tag = ev.tag;
        rule.next = job_of(next);
        rule.token_dst = &nxt->token;
        rule.logits = cur->logits;
        rule.size = VOCAB;
        rule.n = VOCAB;
        rule.dst = cur->row;
        rule.dst_len = VOCAB;
        rule.expect_bytes = VOCAB * 2;
        calexec_relay_register(g_relay, &rule); /* refused (EARG) only when decided already */
    }
}

static void *withdrawer(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    while (atomic_load(&g_completed) < JOBS) {
        long tag = atomic_load(&g_completed) + 1;
        if (rand_r(&seed) % 4 == 0 && calexec_relay_withdraw(g_relay, tag) == 1)
            atomic_store(&g_withdraw_won[tag], 1);
        sleep_us(rand_r(&seed) % 30);
    }
    return NULL;
}

/* a consumer waiting in C for each job's decision (it may fall behind the kept ones) */
static atomic_long g_results_seen;
static void *consumer(void *arg)
{
    (void)arg;
    for (long tag = 1; tag <= JOBS && atomic_load(&g_completed) < JOBS; tag++) {
        calexec_relay_event ev;
        if (calexec_relay_result_wait(g_relay, tag, 2000, &ev) != CALEXEC_RELAY_OK || ev.kind == CALEXEC_RELAY_CLOSED)
            return NULL;
        if (ev.kind == CALEXEC_RELAY_DONE) {
            if (ev.tag != tag)
                atomic_fetch_add(&g_out_of_order, 1);
            atomic_fetch_add(&g_results_seen, 1);
        }
    }
    return NULL;
}

static void *completion(void *arg)
{
    (void)arg;
    long expect = 1;
    while (expect <= JOBS) {
        calexec_relay_event ev;
        if (calexec_relay_completion_wait(g_relay, 1000000, &ev) != CALEXEC_RELAY_OK || ev.kind == CALEXEC_RELAY_CLOSED)
            return NULL;
        if (ev.kind != CALEXEC_RELAY_DONE)
            continue;
        if (ev.tag != expect)
            atomic_fetch_add(&g_out_of_order, 1);
        fake_slot *cur = &g_slots[ev.tag % SLOTS];
        if (ev.why == CALEXEC_RELAY_FIRED && atomic_load(&g_withdraw_won[ev.tag]))
            atomic_fetch_add(&g_withdrawn_then_fired, 1);
        calexec_relay_withdraw(g_relay, ev.tag); /* a rule registered after the decision */
        if (ev.why != CALEXEC_RELAY_FIRED && ev.tag < JOBS) {
            calexec_logits_stats st;
            calexec_bf16_logits(cur->logits, VOCAB, 0, VOCAB, cur->row, VOCAB, 0, &st);
            g_slots[(ev.tag + 1) % SLOTS].token = (int32_t)st.argmax;
            calexec_relay_job j = job_of(ev.tag + 1);
            if (calexec_relay_fire(g_relay, &j) != CALEXEC_RELAY_OK)
                return NULL;
        }
        if (ev.tag < JOBS && g_slots[(ev.tag + 1) % SLOTS].token != argmax_of(cur->token))
            atomic_fetch_add(&g_bad_token, 1);
        atomic_fetch_add(&g_completed, 1);
        expect++;
    }
    return NULL;
}

/* the executor's use (calexec_relay_submitter_only): two threads fire, one wakes, the
 * submitter infers until the close; every job fired is inferred once or dropped by the
 * close, none is tracked, track and register are refused */
enum { SO_PER_FIRER = 2000 };
static calexec_relay *g_so;
static atomic_long g_so_fired, g_so_inferred, g_so_bad;

static int32_t so_infer(void *dev, void *model, void *kv, int32_t seq, void *inbuf, void *outbuf)
{
    (void)dev, (void)model, (void)kv, (void)inbuf, (void)outbuf;
    return seq == 7 ? 0 : 4;
}

static void *so_submitter(void *arg)
{
    (void)arg;
    calexec_relay_event ev;
    for (;;) {
        if (calexec_relay_submitter_wait(g_so, 100000, &ev) != CALEXEC_RELAY_OK) {
            atomic_fetch_add(&g_so_bad, 1);
            return NULL;
        }
        if (ev.kind == CALEXEC_RELAY_CLOSED)
            return NULL;
        if (ev.kind == CALEXEC_RELAY_INFERRED) {
            atomic_fetch_add(&g_so_inferred, 1);
            if (ev.rc != 0 || ev.why != CALEXEC_RELAY_FIRED)
                atomic_fetch_add(&g_so_bad, 1);
        }
    }
}

static void *so_firer(void *arg)
{
    long base = (long)(uintptr_t)arg;
    for (long i = 0; i < SO_PER_FIRER; i++) {
        calexec_relay_job job = {base + i, NULL, NULL, NULL, NULL, NULL, 7};
        int32_t rc;
        while ((rc = calexec_relay_fire(g_so, &job)) == CALEXEC_RELAY_EFULL)
            sleep_us(5);
        if (rc != CALEXEC_RELAY_OK)
            atomic_fetch_add(&g_so_bad, 1);
        else
            atomic_fetch_add(&g_so_fired, 1);
        if (i % 7 == 0)
            calexec_relay_wake(g_so);
    }
    return NULL;
}

static int submitter_only_check(void)
{
    calexec_relay_fns fns = {so_infer, fake_wait, fake_status, fake_valid, DONE};
    g_so = calexec_relay_new(&fns);
    if (!g_so || calexec_relay_submitter_only(g_so) != CALEXEC_RELAY_OK)
        return 1;
    calexec_relay_job job = {1, NULL, NULL, NULL, NULL, NULL, 7};
    if (calexec_relay_track(g_so, &job) != CALEXEC_RELAY_EARG)
        return 1;
    pthread_t ts, f1, f2;
    pthread_create(&ts, NULL, so_submitter, NULL);
    pthread_create(&f1, NULL, so_firer, (void *)(uintptr_t)1000000);
    pthread_create(&f2, NULL, so_firer, (void *)(uintptr_t)2000000);
    pthread_join(f1, NULL);
    pthread_join(f2, NULL);
    int32_t dropped = calexec_relay_close(g_so, NULL, 0);
    pthread_join(ts, NULL);
    calexec_relay_counters c;
    calexec_relay_counters_get(g_so, &c);
    calexec_relay_free(g_so);
    long fired = atomic_load(&g_so_fired), inferred = atomic_load(&g_so_inferred);
    printf("relay_check: submitter-only: %ld fired, %ld inferred, %d dropped at the close\n",
           fired, inferred, dropped);
    if (fired != 2 * SO_PER_FIRER || inferred + dropped != fired || c.in_flight != 0 ||
        atomic_load(&g_so_bad)) {
        fprintf(stderr, "relay_check: submitter-only FAILED: fired %ld, inferred %ld, dropped "
                        "%d, in flight %d, bad %ld\n", fired, inferred, dropped, c.in_flight,
                atomic_load(&g_so_bad));
        return 1;
    }
    return 0;
}

int main(void)
{
    if (submitter_only_check() != 0)
        return 1;
    calexec_relay_fns fns = {fake_infer, fake_wait, fake_status, fake_valid, DONE};
    g_relay = calexec_relay_new(&fns);
    if (!g_relay) {
        fprintf(stderr, "relay_check: calexec_relay_new failed\n");
        return 1;
    }
    g_slots[1].token = 5;
    atomic_store(&g_slots[1].tag, 1);
    pthread_t ts, tc, tw, tr;
    pthread_create(&ts, NULL, submitter, NULL);
    pthread_create(&tc, NULL, completion, NULL);
    pthread_create(&tw, NULL, withdrawer, (void *)(uintptr_t)12345);
    pthread_create(&tr, NULL, consumer, NULL);
    calexec_relay_job first = job_of(1);
    calexec_relay_fire(g_relay, &first);
    pthread_join(tc, NULL);
    pthread_join(tw, NULL);
    calexec_relay_close(g_relay, NULL, 0);
    pthread_join(ts, NULL);
    pthread_join(tr, NULL);
    calexec_relay_counters c;
    calexec_relay_counters_get(g_relay, &c);
    calexec_relay_free(g_relay);
    long done = atomic_load(&g_completed);
    printf("relay_check: %ld jobs, %lld fired by rules, %lld by the plain path, %lld withdrawn, "
           "%ld decisions seen by a consumer waiting in C\n", done, (long long)c.fired_by_rule,
           (long long)c.fired_by_python - 1, (long long)c.withdrawn, atomic_load(&g_results_seen));
    if (done != JOBS || atomic_load(&g_out_of_order) || atomic_load(&g_bad_token) ||
        atomic_load(&g_withdrawn_then_fired) || c.fired_by_rule == 0 || c.fired_by_python < 2) {
        fprintf(stderr, "relay_check: FAILED: completed %ld/%d, out of order %ld, bad tokens %ld, "
                        "withdrawn then fired %ld\n",
                done, JOBS, atomic_load(&g_out_of_order), atomic_load(&g_bad_token),
                atomic_load(&g_withdrawn_then_fired));
        return 1;
    }
    return 0;
}

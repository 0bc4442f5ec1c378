/* calexec native relay (calexec_relay.h has the contract). */
#define _POSIX_C_SOURCE 200809L

#include "calexec_relay.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "calexec_native.h"

typedef struct ring {
    calexec_relay_job jobs[CALEXEC_RELAY_QUEUE];
    int32_t head, count;
} ring;

typedef struct decision {
    int64_t tag, fired_tag;
    int32_t rc, status, why, token;
    int64_t t_ns;
} decision;

struct calexec_relay {
    calexec_relay_fns fns;
    pthread_mutex_t mu;
    pthread_cond_t to_submitter, to_completion, to_caller;
    decision decided[CALEXEC_RELAY_QUEUE]; /* the last decisions, oldest first */
    int32_t decided_head, decided_count;
    ring fires;     /* jobs for the submitter to infer, oldest first */
    ring in_flight; /* jobs given to infer, for the completion thread, oldest first */
    calexec_relay_rule rules[CALEXEC_RELAY_RULES];
    uint8_t rule_used[CALEXEC_RELAY_RULES];
    int32_t wake, closed, in_submitter, in_completion;
    int64_t last_inferred; /* the tag of the job the submitter gave to infer last */
    int32_t inferring;     /* the submitter holds a popped job it has not reported yet */
    int32_t submitter_only; /* inferred jobs are not tracked (calexec_relay_submitter_only) */
    calexec_relay_counters counters;
};

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static struct timespec deadline_after(int64_t timeout_us)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t ns = (int64_t)ts.tv_nsec + (timeout_us % 1000000) * 1000;
    ts.tv_sec += (time_t)(timeout_us / 1000000 + ns / 1000000000LL);
    ts.tv_nsec = (long)(ns % 1000000000LL);
    return ts;
}

static int ring_push(ring *q, const calexec_relay_job *job)
{
    if (q->count == CALEXEC_RELAY_QUEUE)
        return 0;
    q->jobs[(q->head + q->count) % CALEXEC_RELAY_QUEUE] = *job;
    q->count++;
    return 1;
}

static calexec_relay_job ring_pop(ring *q)
{
    calexec_relay_job job = q->jobs[q->head];
    q->head = (q->head + 1) % CALEXEC_RELAY_QUEUE;
    q->count--;
    return job;
}

static void event_init(calexec_relay_event *out, int32_t kind)
{
    memset(out, 0, sizeof *out);
    out->kind = kind;
    out->status = -1;
    out->token = -1;
    out->fired_tag = -1;
    out->t_ns = now_ns();
}

calexec_relay *calexec_relay_new(const calexec_relay_fns *fns)
{
    if (!fns || !fns->infer || !fns->wait || !fns->status)
        return NULL;
    calexec_relay *r = (calexec_relay *)calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->fns = *fns;
    pthread_condattr_t attr;
    int ok = pthread_condattr_init(&attr) == 0;
    ok = ok && pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) == 0;
    ok = ok && pthread_mutex_init(&r->mu, NULL) == 0;
    if (ok && pthread_cond_init(&r->to_submitter, &attr) != 0) {
        pthread_mutex_destroy(&r->mu);
        ok = 0;
    }
    if (ok && pthread_cond_init(&r->to_completion, &attr) != 0) {
        pthread_cond_destroy(&r->to_submitter);
        pthread_mutex_destroy(&r->mu);
        ok = 0;
    }
    if (ok && pthread_cond_init(&r->to_caller, &attr) != 0) {
        pthread_cond_destroy(&r->to_completion);
        pthread_cond_destroy(&r->to_submitter);
        pthread_mutex_destroy(&r->mu);
        ok = 0;
    }
    pthread_condattr_destroy(&attr);
    if (!ok) {
        free(r);
        return NULL;
    }
    return r;
}

int32_t calexec_relay_submitter_only(calexec_relay *r)
{
    if (!r)
        return CALEXEC_RELAY_ENULL;
    pthread_mutex_lock(&r->mu);
    r->submitter_only = 1;
    pthread_mutex_unlock(&r->mu);
    return CALEXEC_RELAY_OK;
}

void calexec_relay_free(calexec_relay *r)
{
    if (!r)
        return;
    pthread_cond_destroy(&r->to_submitter);
    pthread_cond_destroy(&r->to_completion);
    pthread_cond_destroy(&r->to_caller);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

int32_t calexec_relay_close(calexec_relay *r, int64_t *tags, int32_t cap)
{
    if (!r)
        return -CALEXEC_RELAY_ENULL;
    pthread_mutex_lock(&r->mu);
    int32_t dropped = 0;
    while (r->fires.count > 0) {
        calexec_relay_job job = ring_pop(&r->fires);
        if (tags && dropped < cap)
            tags[dropped] = job.tag;
        dropped++;
    }
    memset(r->rule_used, 0, sizeof r->rule_used);
    r->counters.rules = 0;
    r->closed = 1;
    pthread_cond_broadcast(&r->to_submitter);
    pthread_cond_broadcast(&r->to_completion);
    pthread_cond_broadcast(&r->to_caller);
    pthread_mutex_unlock(&r->mu);
    return dropped;
}

/* Python's jobs: onto `q` and wake the thread waiting on `cv` (EFULL, ECLOSED) */
static int32_t push_job(calexec_relay *r, ring *q, pthread_cond_t *cv, int64_t *counter,
                        const calexec_relay_job *job)
{
    if (!r || !job)
        return CALEXEC_RELAY_ENULL;
    pthread_mutex_lock(&r->mu);
    int32_t rc = r->closed ? CALEXEC_RELAY_ECLOSED : ring_push(q, job) ? CALEXEC_RELAY_OK : CALEXEC_RELAY_EFULL;
    if (rc == CALEXEC_RELAY_OK) {
        if (counter)
            (*counter)++;
        pthread_cond_signal(cv);
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

int32_t calexec_relay_fire(calexec_relay *r, const calexec_relay_job *job)
{
    return r ? push_job(r, &r->fires, &r->to_submitter, &r->counters.fired_by_python, job) : CALEXEC_RELAY_ENULL;
}

int32_t calexec_relay_wake(calexec_relay *r)
{
    if (!r)
        return CALEXEC_RELAY_ENULL;
    pthread_mutex_lock(&r->mu);
    int32_t rc = r->closed ? CALEXEC_RELAY_ECLOSED : CALEXEC_RELAY_OK;
    if (rc == CALEXEC_RELAY_OK) {
        r->wake = 1;
        pthread_cond_signal(&r->to_submitter);
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

int32_t calexec_relay_track(calexec_relay *r, const calexec_relay_job *job)
{
    if (!r)
        return CALEXEC_RELAY_ENULL;
    if (r->submitter_only) /* (set before any other thread uses the relay: no lock needed) */
        return CALEXEC_RELAY_EARG;
    return push_job(r, &r->in_flight, &r->to_completion, NULL, job);
}

/* wait on cv until ready() or closed or the deadline; 1 when ready, 0 timeout/closed */
static int wait_for(calexec_relay *r, pthread_cond_t *cv, int64_t timeout_us, int (*ready)(const calexec_relay *))
{
    struct timespec until = deadline_after(timeout_us);
    while (!r->closed && !ready(r)) {
        if (timeout_us == 0)
            return 0;
        int e = pthread_cond_timedwait(cv, &r->mu, &until);
        if (e == ETIMEDOUT)
            return !r->closed && ready(r);
    }
    return !r->closed;
}

static int submitter_ready(const calexec_relay *r)
{
    return r->fires.count > 0 || r->wake;
}

static int completion_ready(const calexec_relay *r)
{
    return r->in_flight.count > 0;
}

int32_t calexec_relay_submitter_wait(calexec_relay *r, int64_t timeout_us, calexec_relay_event *out)
{
    if (!r || !out)
        return CALEXEC_RELAY_ENULL;
    if (timeout_us < 0)
        return CALEXEC_RELAY_EARG;
    pthread_mutex_lock(&r->mu);
    if (r->in_submitter) {
        pthread_mutex_unlock(&r->mu);
        return CALEXEC_RELAY_EBUSY;
    }
    r->in_submitter = 1;
    int ready = wait_for(r, &r->to_submitter, timeout_us, submitter_ready);
    if (!ready) {
        event_init(out, r->closed ? CALEXEC_RELAY_CLOSED : CALEXEC_RELAY_TIMEOUT);
        r->in_submitter = 0;
        pthread_mutex_unlock(&r->mu);
        return CALEXEC_RELAY_OK;
    }
    if (r->fires.count == 0) { /* a wake */
        r->wake = 0;
        r->counters.wakes++;
        event_init(out, CALEXEC_RELAY_WAKE);
        r->in_submitter = 0;
        pthread_mutex_unlock(&r->mu);
        return CALEXEC_RELAY_OK;
    }
    calexec_relay_job job = ring_pop(&r->fires);
    r->inferring = 1;
    pthread_mutex_unlock(&r->mu);
    /* only this thread infers; outside the mutex (infer may take the runtime's own locks) */
    int32_t rc = r->fns.infer(job.dev, job.model, job.kv, job.seq, job.inbuf, job.outbuf);
    pthread_mutex_lock(&r->mu);
    event_init(out, CALEXEC_RELAY_INFERRED);
    out->tag = job.tag;
    out->rc = rc;
    r->counters.inferred++;
    r->last_inferred = job.tag;
    r->inferring = 0;
    pthread_cond_broadcast(&r->to_completion); /* a completion thread waiting for its firing */
    if (rc == 0 && !r->submitter_only) {
        /* the in-flight ring holds as many as the fire ring: a job popped from one always
         * fits the other unless Python tracked jobs of its own beyond it (then it stays
         * Python's to wait for: reported as an infer that needs Python, rc kept 0) */
        if (ring_push(&r->in_flight, &job))
            pthread_cond_signal(&r->to_completion);
        else
            out->why = CALEXEC_RELAY_QUEUE_FULL;
    }
    r->in_submitter = 0;
    pthread_mutex_unlock(&r->mu);
    return CALEXEC_RELAY_OK;
}

static int find_fire(const calexec_relay *r, int64_t tag)
{
    for (int32_t i = 0; i < r->fires.count; i++)
        if (r->fires.jobs[(r->fires.head + i) % CALEXEC_RELAY_QUEUE].tag == tag)
            return 1;
    return 0;
}

static int find_rule(const calexec_relay *r, int64_t tag)
{
    for (int i = 0; i < CALEXEC_RELAY_RULES; i++)
        if (r->rule_used[i] && r->rules[i].tag == tag)
            return i;
    return -1;
}

int32_t calexec_relay_register(calexec_relay *r, const calexec_relay_rule *rule)
{
    if (!r || !rule || !rule->token_dst || !rule->logits || !rule->dst)
        return CALEXEC_RELAY_ENULL;
    if (rule->n_stop < 0 || rule->n_stop > CALEXEC_RELAY_MAX_STOP || rule->n == 0 ||
        rule->base > rule->size || rule->n > rule->size - rule->base || rule->n > rule->dst_len)
        return CALEXEC_RELAY_EARG;
    pthread_mutex_lock(&r->mu);
    int32_t rc = CALEXEC_RELAY_EFULL;
    if (r->submitter_only) /* no completion side here: a rule would never be decided */
        rc = CALEXEC_RELAY_EARG;
    else if (r->closed)
        rc = CALEXEC_RELAY_ECLOSED;
    else if (find_rule(r, rule->tag) >= 0)
        rc = CALEXEC_RELAY_EARG;
    else
        for (int i = 0; i < CALEXEC_RELAY_RULES; i++)
            if (!r->rule_used[i]) {
                r->rules[i] = *rule;
                r->rule_used[i] = 1;
                r->counters.rules++;
                rc = CALEXEC_RELAY_OK;
                break;
            }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

int32_t calexec_relay_withdraw(calexec_relay *r, int64_t tag)
{
    if (!r)
        return -CALEXEC_RELAY_ENULL;
    pthread_mutex_lock(&r->mu);
    int i = find_rule(r, tag);
    if (i >= 0) {
        r->rule_used[i] = 0;
        r->counters.rules--;
        r->counters.withdrawn++;
    }
    pthread_mutex_unlock(&r->mu);
    return i >= 0 ? 1 : 0;
}

static int is_stop(const calexec_relay_rule *rule, int32_t token)
{
    for (int32_t i = 0; i < rule->n_stop; i++)
        if (rule->stop[i] == token)
            return 1;
    return 0;
}

int32_t calexec_relay_completion_wait(calexec_relay *r, int64_t timeout_us, calexec_relay_event *out)
{
    if (!r || !out)
        return CALEXEC_RELAY_ENULL;
    if (timeout_us < 0)
        return CALEXEC_RELAY_EARG;
    int64_t start = now_ns();
    pthread_mutex_lock(&r->mu);
    if (r->in_completion) {
        pthread_mutex_unlock(&r->mu);
        return CALEXEC_RELAY_EBUSY;
    }
    r->in_completion = 1;
    if (!wait_for(r, &r->to_completion, timeout_us, completion_ready)) {
        event_init(out, r->closed ? CALEXEC_RELAY_CLOSED : CALEXEC_RELAY_TIMEOUT);
        r->in_completion = 0;
        pthread_mutex_unlock(&r->mu);
        return CALEXEC_RELAY_OK;
    }
    calexec_relay_job job = r->in_flight.jobs[r->in_flight.head]; /* stays queued until done */
    pthread_mutex_unlock(&r->mu);

    int64_t left_us = timeout_us - (now_ns() - start) / 1000;
    int32_t wait_rc = r->fns.wait(job.outbuf, left_us > 0 ? left_us : 0);
    if (wait_rc == 13) { /* CalRT's timeout: the job keeps running; Wait may be called again */
        pthread_mutex_lock(&r->mu);
        event_init(out, CALEXEC_RELAY_TIMEOUT);
        out->tag = job.tag;
        out->rc = wait_rc;
        r->in_completion = 0;
        pthread_mutex_unlock(&r->mu);
        return CALEXEC_RELAY_OK;
    }
    int32_t status = -1, why = CALEXEC_RELAY_NO_RULE, token = -1;
    calexec_relay_rule rule;
    memset(&rule, 0, sizeof rule);
    int have_rule = 0;
    pthread_mutex_lock(&r->mu);
    ring_pop(&r->in_flight); /* the completion thread is its only consumer: still the head */
    int i = find_rule(r, job.tag);
    if (i >= 0) {
        rule = r->rules[i];
        have_rule = 1;
    }
    pthread_mutex_unlock(&r->mu);

    if (wait_rc != 0)
        why = CALEXEC_RELAY_WAIT_FAILED;
    else if (r->fns.status(job.outbuf, &status) != 0 || status != r->fns.done_status)
        why = CALEXEC_RELAY_NOT_DONE;
    else if (have_rule) {
        uint64_t valid = 0;
        calexec_logits_stats stats;
        if (r->fns.valid_bytes && (r->fns.valid_bytes(job.outbuf, &valid) != 0 || valid < rule.expect_bytes))
            why = CALEXEC_RELAY_SHORT;
        else if (calexec_bf16_logits(rule.logits, rule.size, rule.base, rule.n, rule.dst, rule.dst_len, CALEXEC_LOGITS_NOSTORE,
                                     &stats) != CALEXEC_LOGITS_OK)
            why = CALEXEC_RELAY_NONFINITE;
        else {
            token = (int32_t)stats.argmax;
            why = is_stop(&rule, token) ? CALEXEC_RELAY_STOP : CALEXEC_RELAY_FIRED;
        }
    }

    pthread_mutex_lock(&r->mu);
    if (have_rule) {
        /* the decision point: the rule still registered (not withdrawn meanwhile)? */
        int j = find_rule(r, job.tag);
        if (j < 0 && why == CALEXEC_RELAY_FIRED)
            why = CALEXEC_RELAY_WITHDRAWN;
        if (why == CALEXEC_RELAY_FIRED) {
            if (r->closed || r->fires.count == CALEXEC_RELAY_QUEUE) {
                why = r->closed ? CALEXEC_RELAY_WITHDRAWN : CALEXEC_RELAY_QUEUE_FULL;
            } else {
                *rule.token_dst = token;
                ring_push(&r->fires, &rule.next);
                r->counters.fired_by_rule++;
                pthread_cond_signal(&r->to_submitter);
            }
        }
        if (j >= 0) { /* decided: fired or not, the rule is spent */
            r->rule_used[j] = 0;
            r->counters.rules--;
        }
    }
    if (why == CALEXEC_RELAY_FIRED && timeout_us > 0) {
        /* Hand the CPU to the job just fired: wait (bounded) until the submitter gave it to
         * infer before returning to Python. The submitter was woken on this CPU; Python work
         * here would hold the CPU it needs (measured: each microsecond of it went onto the
         * device's path) */
        int64_t left = timeout_us - (now_ns() - start) / 1000;
        struct timespec until = deadline_after(left < CALEXEC_RELAY_HANDOVER_US ? (left > 0 ? left : 0)
                                                                                : CALEXEC_RELAY_HANDOVER_US);
        while (!r->closed && (r->inferring || find_fire(r, rule.next.tag)) &&
               pthread_cond_timedwait(&r->to_completion, &r->mu, &until) != ETIMEDOUT)
            ;
    }
    event_init(out, CALEXEC_RELAY_DONE);
    out->tag = job.tag;
    out->rc = wait_rc;
    out->status = status;
    out->why = why;
    out->token = token;
    out->fired_tag = why == CALEXEC_RELAY_FIRED ? rule.next.tag : -1;
    r->counters.done++;
    /* published for calexec_relay_result_wait: the oldest decision makes room */
    if (r->decided_count == CALEXEC_RELAY_QUEUE) {
        r->decided_head = (r->decided_head + 1) % CALEXEC_RELAY_QUEUE;
        r->decided_count--;
    }
    decision *d = &r->decided[(r->decided_head + r->decided_count) % CALEXEC_RELAY_QUEUE];
    d->tag = out->tag;
    d->fired_tag = out->fired_tag;
    d->rc = out->rc;
    d->status = out->status;
    d->why = out->why;
    d->token = out->token;
    d->t_ns = out->t_ns;
    r->decided_count++;
    pthread_cond_broadcast(&r->to_caller);
    r->in_completion = 0;
    pthread_mutex_unlock(&r->mu);
    return CALEXEC_RELAY_OK;
}

static const decision *find_decision(const calexec_relay *r, int64_t tag)
{
    for (int32_t i = 0; i < r->decided_count; i++) {
        const decision *d = &r->decided[(r->decided_head + i) % CALEXEC_RELAY_QUEUE];
        if (d->tag == tag)
            return d;
    }
    return NULL;
}

int32_t calexec_relay_result_wait(calexec_relay *r, int64_t tag, int64_t timeout_us, calexec_relay_event *out)
{
    if (!r || !out)
        return CALEXEC_RELAY_ENULL;
    if (timeout_us < 0)
        return CALEXEC_RELAY_EARG;
    struct timespec until = deadline_after(timeout_us);
    pthread_mutex_lock(&r->mu);
    const decision *d;
    while (!(d = find_decision(r, tag)) && !r->closed) {
        if (timeout_us == 0 || pthread_cond_timedwait(&r->to_caller, &r->mu, &until) == ETIMEDOUT) {
            d = find_decision(r, tag);
            break;
        }
    }
    if (d) {
        event_init(out, CALEXEC_RELAY_DONE);
        out->tag = d->tag;
        out->fired_tag = d->fired_tag;
        out->rc = d->rc;
        out->status = d->status;
        out->why = d->why;
        out->token = d->token;
        out->t_ns = d->t_ns;
    } else {
        event_init(out, r->closed ? CALEXEC_RELAY_CLOSED : CALEXEC_RELAY_TIMEOUT);
        out->tag = tag;
    }
    pthread_mutex_unlock(&r->mu);
    return CALEXEC_RELAY_OK;
}

int32_t calexec_relay_counters_get(calexec_relay *r, calexec_relay_counters *out)
{
    if (!r || !out)
        return CALEXEC_RELAY_ENULL;
    pthread_mutex_lock(&r->mu);
    *out = r->counters;
    out->queued = r->fires.count;
    out->in_flight = r->in_flight.count;
    pthread_mutex_unlock(&r->mu);
    return CALEXEC_RELAY_OK;
}

/* calexec native relay: the submitter's and the completion thread's waits, in C (issue 28;
 * docs/architecture.md, "Native hand-offs"). Host code, not part of the CalRT ABI: it calls
 * the runtime through the function pointers it is given (the bundled emulator's or a vendor
 * shim's), so it is built into the host-side native module (drivers/native_build.py).
 *
 * The threads stay the executor's (invariant 2): only the thread in
 * calexec_relay_submitter_wait calls infer, only the thread in calexec_relay_completion_wait
 * calls Wait. What moves into C is the hand-off between them and one decision, taken in C only
 * when Python registered it beforehand (a *fire rule*):
 *
 *   completion_wait: the oldest job in flight -> Wait -> GetStatus -> (valid bytes) -> when a
 *     rule is registered for that job: the finiteness check and argmax of its logits slice
 *     (calexec_bf16_logits, NOSTORE) -> unless the argmax is a stop token, write it into the
 *     armed successor's input and queue the successor for the submitter. All before any Python
 *     runs. The event says what happened (fired or why not).
 *   submitter_wait: a queued job (fired by a rule, or by Python through calexec_relay_fire)
 *     -> infer -> the job joins the in-flight queue for the completion thread; or a wake from
 *     Python (WAKE: it has other work for the submitter); or the relay closed; or the timeout.
 *
 * Python decides, C only carries it out: a rule is registered when the successor is armed and
 * withdrawn (calexec_relay_withdraw) by every event that makes the plain path refuse to fire
 * it (cancel, close, deadline, fence, recovery). The decision point is one critical section of
 * the relay's mutex: a withdrawal before it removes the rule (1), one after it finds the rule
 * gone (0: the completion's event says whether it fired). The argmax is computed outside the
 * mutex and only used if the rule is still there afterwards.
 *
 * Every wait is bounded by its timeout (us; a negative timeout is refused, 0 polls). No
 * allocation after calexec_relay_new, no global state. Codes: CALEXEC_RELAY_OK, or the error
 * codes below; a wait's outcome is the event's kind.
 */
#ifndef CALEXEC_RELAY_H
#define CALEXEC_RELAY_H

#include <stddef.h>
#include <stdint.h>

enum calexec_relay_rc {
    CALEXEC_RELAY_OK = 0,
    CALEXEC_RELAY_ENULL = 1,   /* a NULL relay, argument or function pointer */
    CALEXEC_RELAY_EFULL = 2,   /* the fire queue, the in-flight queue or the rule table is full */
    CALEXEC_RELAY_ECLOSED = 3, /* the relay is closed */
    CALEXEC_RELAY_EARG = 4,    /* a bad argument (negative timeout, rule slice out of bounds,
                                  too many stop tokens, a tag registered twice) */
    CALEXEC_RELAY_EBUSY = 5    /* another thread is in this wait (one submitter, one completion) */
};

enum calexec_relay_kind {
    CALEXEC_RELAY_TIMEOUT = 0, /* nothing within the timeout (completion: the job still runs) */
    CALEXEC_RELAY_INFERRED = 1, /* submitter: a queued job was given to infer (rc: its code) */
    CALEXEC_RELAY_WAKE = 2,    /* submitter: Python asked for it (calexec_relay_wake) */
    CALEXEC_RELAY_CLOSED = 3,  /* the relay was closed */
    CALEXEC_RELAY_DONE = 4     /* completion: the oldest job in flight finished waiting */
};

/* completion: why a finished job's rule did not fire (fired == 0) */
enum calexec_relay_why {
    CALEXEC_RELAY_FIRED = 0,
    CALEXEC_RELAY_NO_RULE = 1,     /* no rule registered for the job (or withdrawn before) */
    CALEXEC_RELAY_WAIT_FAILED = 2, /* Wait returned non-zero (rc) */
    CALEXEC_RELAY_NOT_DONE = 3,    /* GetStatus failed or the status is not DONE */
    CALEXEC_RELAY_SHORT = 4,       /* the output's valid bytes are short of the rule's */
    CALEXEC_RELAY_NONFINITE = 5,   /* the logits slice holds a NaN/Inf (or bad bounds) */
    CALEXEC_RELAY_STOP = 6,        /* the argmax is one of the rule's stop tokens */
    CALEXEC_RELAY_WITHDRAWN = 7,   /* withdrawn while the argmax was computed */
    CALEXEC_RELAY_QUEUE_FULL = 8   /* the fire queue was full */
};

/* HANDOVER_US: how long a completion that fired a job waits, at most, for the submitter to
 * give it to infer before it returns (calexec_relay_completion_wait) */
enum { CALEXEC_RELAY_MAX_STOP = 16, CALEXEC_RELAY_QUEUE = 4, CALEXEC_RELAY_RULES = 8,
       CALEXEC_RELAY_HANDOVER_US = 2000 };

/* calrt.h's signatures with opaque handles */
typedef int32_t (*calexec_relay_infer_fn)(void *dev, void *model, void *kv, int32_t seq, void *inbuf,
                                          void *outbuf);
typedef int32_t (*calexec_relay_wait_fn)(void *outbuf, int64_t timeout_us);
typedef int32_t (*calexec_relay_status_fn)(void *outbuf, int32_t *status);
typedef int32_t (*calexec_relay_valid_fn)(void *outbuf, uint64_t *bytes);

typedef struct calexec_relay_fns {
    calexec_relay_infer_fn infer;
    calexec_relay_wait_fn wait;
    calexec_relay_status_fn status;
    calexec_relay_valid_fn valid_bytes;
    int32_t done_status; /* the runtime's DONE status (CALRT_JOB_DONE) */
} calexec_relay_fns;

/* a job for infer: the caller's tag (unique among the relay's live jobs) and the handles */
typedef struct calexec_relay_job {
    int64_t tag;
    void *dev, *model, *kv, *inbuf, *outbuf;
    int32_t seq;
} calexec_relay_job;

/* fire `next` when the job `tag` completes DONE with `expect_bytes` valid bytes and a finite
 * logits slice logits[base, base + n) of `size` elements whose argmax is no stop token: the
 * argmax is written to *token_dst first, then `next` is queued for the submitter. The memory behind token_dst and logits must stay
 * valid until the rule is withdrawn or decided (the event of job `tag`). */
typedef struct calexec_relay_rule {
    int64_t tag;
    calexec_relay_job next;
    int32_t *token_dst;
    const uint16_t *logits;
    uint64_t size, base, n;
    float *dst;        /* the FP32 row the plain path converts the slice into: checked (n <=
                          dst_len), never written by the relay (NOSTORE) */
    uint64_t dst_len;
    uint64_t expect_bytes;
    int32_t stop[16]; /* CALEXEC_RELAY_MAX_STOP (a literal: the cffi cdef reads this header) */
    int32_t n_stop;
} calexec_relay_rule;

typedef struct calexec_relay_event {
    int32_t kind;      /* calexec_relay_kind */
    int64_t tag;       /* INFERRED, DONE: the job's tag */
    int32_t rc;        /* INFERRED: infer's code; DONE: Wait's code */
    int32_t status;    /* DONE: GetStatus's status (-1: not read) */
    int32_t why;       /* DONE: calexec_relay_why */
    int64_t fired_tag; /* DONE with why FIRED: the successor queued */
    int32_t token;     /* DONE: the argmax when computed (-1: not computed) */
    int64_t t_ns;      /* CLOCK_MONOTONIC when the event was decided */
} calexec_relay_event;

typedef struct calexec_relay calexec_relay;

/* NULL on a NULL/incomplete fns or no memory */
calexec_relay *calexec_relay_new(const calexec_relay_fns *fns);
/* a submitter-only relay (the executor's use, docs/architecture.md "Native hand-offs"): the
 * jobs its submitter gives to infer do not join the in-flight queue (the caller's own
 * completion thread Waits for them); track and register are refused (EARG). Call it once,
 * right after calexec_relay_new, before any other thread uses the relay. */
int32_t calexec_relay_submitter_only(calexec_relay *r);
/* frees the relay; call only once no thread is in it (after close and both waits returned) */
void calexec_relay_free(calexec_relay *r);
/* closes it: every wait returns CLOSED from now on; fires and rules are refused. Returns how
 * many queued jobs were never given to infer (*dropped tags into tags[0, cap), if given). A
 * job the submitter was giving to infer as it closed is still reported by its INFERRED event;
 * from the close on the relay Waits for nothing: the jobs in flight are the caller's to Wait
 * for (or to end by a reset) before their buffers are freed. */
int32_t calexec_relay_close(calexec_relay *r, int64_t *tags, int32_t cap);

/* Python's own fire: queue `job` for the submitter (EFULL, ECLOSED) */
int32_t calexec_relay_fire(calexec_relay *r, const calexec_relay_job *job);
/* wake the submitter's wait with WAKE (once per call, coalesced while not yet taken) */
int32_t calexec_relay_wake(calexec_relay *r);
int32_t calexec_relay_submitter_wait(calexec_relay *r, int64_t timeout_us, calexec_relay_event *out);

/* the job given to infer by Python itself (the plain path) joins the in-flight queue */
int32_t calexec_relay_track(calexec_relay *r, const calexec_relay_job *job);
int32_t calexec_relay_register(calexec_relay *r, const calexec_relay_rule *rule);
/* 1: the rule was there and is removed (it will not fire); 0: not there (never registered, or
 * already decided: the job's DONE event says how); negative: an error code */
int32_t calexec_relay_withdraw(calexec_relay *r, int64_t tag);
int32_t calexec_relay_completion_wait(calexec_relay *r, int64_t timeout_us, calexec_relay_event *out);

/* A caller's wait for the decision on job `tag` (any thread, any number of them): DONE with
 * the completion's why, token and fired_tag once the completion thread decided it (the last
 * CALEXEC_RELAY_QUEUE decisions are kept), CLOSED, or TIMEOUT. It lets the thread that
 * consumes a job's token wake from C, without a hand-off through the completion thread's
 * Python. */
int32_t calexec_relay_result_wait(calexec_relay *r, int64_t tag, int64_t timeout_us, calexec_relay_event *out);

/* counters for tests and reports: jobs inferred, events by kind, fires by rule */
typedef struct calexec_relay_counters {
    int64_t inferred, done, fired_by_rule, fired_by_python, wakes, withdrawn;
    int32_t queued, in_flight, rules;
} calexec_relay_counters;
int32_t calexec_relay_counters_get(calexec_relay *r, calexec_relay_counters *out);

#endif

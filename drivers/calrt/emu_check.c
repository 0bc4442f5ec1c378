/*
 * Self-check of the emulated device's modelled time (emu_stage_start_ns / emu_stage_end_ns,
 * emu_engine.c): pure arithmetic on given instants, no clock read, no sleep, no timing
 * threshold. A stage starts in the model when the job is ready (infer(), then its previous
 * stage's modelled end), the engine is free and any resource it waited for was released,
 * never after its thread started it; it ends max(latency, work) after that start. So a job's
 * completion is infer() + its stages' profiles, whatever its engine thread's wake-up lateness.
 *
 *   make -C drivers/calrt emu-check && drivers/calrt/out/emu_check
 *
 * Prints one line per failed check and exits 1, or "emu_check: N checks passed" and 0.
 * check-sanitizers runs it under ASan+UBSan (emu-check-asan).
 */
#define _POSIX_C_SOURCE 200809L

#include <stdint.h>
#include <stdio.h>

#include "emu_internal.h"

static int g_checks, g_failed;

static void expect(const char *what, int64_t got, int64_t want)
{
    g_checks++;
    if (got != want) {
        g_failed++;
        printf("emu_check: %s: got %lld, want %lld\n", what, (long long)got, (long long)want);
    }
}

/* One decode job's stages on an idle engine, H2D/D2H without a profile (the benchmark's
 * decode-only profile), the engine thread waking `late` ns after infer() and each stage's
 * sleep returning `late` ns past its deadline: returns the job's modelled completion. */
static int64_t decode_job_end(int64_t infer_ns, int64_t late, int64_t decode_ns, int64_t h2d_work,
                              int64_t compute_work, int64_t d2h_work, int64_t engine_free)
{
    int64_t ready = infer_ns, now = infer_ns + late;
    int64_t s = emu_stage_start_ns(ready, engine_free, 0, now, 0); /* H2D */
    int64_t e = emu_stage_end_ns(s, 0, h2d_work);
    now += h2d_work; /* no sleep: its deadline s + 0 has passed */
    ready = engine_free = e;
    s = emu_stage_start_ns(ready, engine_free, 0, now, 0); /* COMPUTE */
    e = emu_stage_end_ns(s, decode_ns, compute_work);
    now = (s + decode_ns > now + compute_work ? s + decode_ns : now + compute_work) + late;
    ready = engine_free = e;
    s = emu_stage_start_ns(ready, engine_free, 0, now, 0); /* D2H */
    return emu_stage_end_ns(s, 0, d2h_work);
}

int main(void)
{
    /* start: the latest of ready, engine free, resource free */
    expect("idle engine: the stage starts at infer()", emu_stage_start_ns(1000, 400, 0, 1517, 0), 1000);
    expect("queued behind the engine's last stage", emu_stage_start_ns(1000, 1300, 0, 1517, 0), 1300);
    expect("waited for another engine's compute", emu_stage_start_ns(1000, 400, 1450, 1517, 0), 1450);
    expect("never after its thread started it", emu_stage_start_ns(2000, 2100, 2200, 1517, 0), 1517);
    expect("stepped mode: the caller's step is the start", emu_stage_start_ns(1000, 400, 0, 1517, 1), 1517);
    expect("all at now", emu_stage_start_ns(1517, 1517, 1517, 1517, 0), 1517);
    /* end: max(latency, work) after the start */
    expect("profile longer than the work", emu_stage_end_ns(1000, 2000000, 35000), 2001000);
    expect("work longer than the profile", emu_stage_end_ns(1000, 2000000, 2500000), 2501000);
    expect("no profile: the work", emu_stage_end_ns(1000, 0, 40), 1040);
    expect("no profile, no work", emu_stage_end_ns(1000, 0, 0), 1000);
    expect("a negative latency is none", emu_stage_end_ns(1000, -5, 40), 1040);
    /* a 2 ms decode job: its completion does not move with the thread's lateness */
    const int64_t t0 = 5000000000LL, decode = 2000000, h2d = 3000, comp = 40000, d2h = 9000;
    int64_t want = t0 + h2d + decode + d2h;
    expect("2 ms decode, threads on time", decode_job_end(t0, 0, decode, h2d, comp, d2h, 0), want);
    expect("2 ms decode, threads 50 us late", decode_job_end(t0, 50000, decode, h2d, comp, d2h, 0), want);
    expect("2 ms decode, threads 517 us late", decode_job_end(t0, 517000, decode, h2d, comp, d2h, 0), want);
    expect("2 ms decode, threads 5.9 ms late", decode_job_end(t0, 5913000, decode, h2d, comp, d2h, 0), want);
    /* queued behind the engine's previous job (modelled end t0 + 1 ms; its thread took this
     * one 0.5 ms after that): starts at that end */
    expect("2 ms decode queued behind a job", decode_job_end(t0, 1517000, decode, h2d, comp, d2h, t0 + 1000000),
           t0 + 1000000 + h2d + decode + d2h);
    /* compute work longer than the profile: the work's length counts, not the lateness */
    expect("compute work over the profile", decode_job_end(t0, 50000, decode, h2d, 2500000, d2h, 0),
           t0 + h2d + 2500000 + d2h);
    if (g_failed) {
        printf("emu_check: %d of %d checks failed\n", g_failed, g_checks);
        return 1;
    }
    printf("emu_check: %d checks passed\n", g_checks);
    return 0;
}

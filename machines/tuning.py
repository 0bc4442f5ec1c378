"""The hot path's timing tuning (issue 17, made per executor in issue 24).

Every value is a shortcut's timing, measured on the emulator's 10 ms decode profile
(docs/benchmarks.md): none of them changes what a request returns, only when work runs (the
differential test, tests/test_differential.py, proves that for every value it runs, the zeros
of ``HotPathTuning.immediate()`` included). ``ExecutorConfig.tuning`` holds one per executor,
so two executors in one process (a test's variants) can be tuned apart.
"""

from __future__ import annotations

import attrs

from calexec.contracts import fields

#: every timing is a finite number >= 0 (``_POSITIVE``: > 0): an infinite delay or yield
#: reached a thread's wait (``OverflowError: timestamp out of range``, the completion thread's
#: fault and a recovery)
_TIMING = fields.number(0, owner="HotPathTuning")
_POSITIVE = fields.number(0, above=True, owner="HotPathTuning")


@attrs.frozen
class HotPathTuning:
    #: the submitter arms a pre-armed job (a decode stream's next step, an implicit pre-arm)
    #: this long after it submitted the job before, at most a quarter of a decode job's
    #: device time: arming at once, right after infer(), slowed that job and the hand-offs
    #: around it (A/B in one process, 10 ms profile: P50 -60..-130 us, P99 -120..-260 us)
    arm_delay_s: float = attrs.field(default=0.002, validator=_TIMING)
    #: greedy ahead: the submitter arms the step after a fired-ahead one this much later (at
    #: most a quarter of the previous step's device time), so the arming does not take the
    #: GIL from the delivery of the previous step and its caller
    ahead_arm_delay_s: float = attrs.field(default=0.001, validator=_TIMING)
    #: greedy ahead: how long the completion thread, having fired a stream's next job ahead,
    #: leaves the GIL to the submitter before it delivers the previous job
    ahead_yield_s: float = attrs.field(default=0.002, validator=_TIMING)
    #: ... only after a job that ran at least this long (us): on a fast device the next job
    #: ends before the previous one is delivered, and the yield costs a round trip
    ahead_yield_min_us: float = attrs.field(default=1000.0, validator=_TIMING)
    #: implicit pre-arms (machines/autoarm.py) only while decode jobs are expected to run at
    #: least this long (us): on a faster device the caller is back before the guess is armed
    auto_prearm_min_us: float = attrs.field(default=1000.0, validator=_TIMING)
    #: an implicit pre-arm is released this long after its predecessor's expected end when
    #: the caller has not asked for it (s)
    auto_idle_s: float = attrs.field(default=0.05, validator=_POSITIVE)
    #: early wake-ups: a thread asleep through a decode job's device time wakes this long
    #: before the job's expected end, for jobs expected to run at least ``prewake_min_us``;
    #: 0 turns them off
    prewake_s: float = attrs.field(default=0.0003, validator=_TIMING)
    prewake_min_us: float = attrs.field(default=1500.0, validator=_TIMING)

    @classmethod
    def immediate(cls) -> HotPathTuning:
        """No delay anywhere: arm at once, never yield, no early wake-ups (the timing a
        shortcut would have without its tuning; the differential test runs it too)."""
        return cls(arm_delay_s=0.0, ahead_arm_delay_s=0.0, ahead_yield_s=0.0,
                   ahead_yield_min_us=0.0, auto_prearm_min_us=0.0, prewake_s=0.0)


#: the defaults (docs/benchmarks.md measured them)
DEFAULT_TUNING = HotPathTuning()

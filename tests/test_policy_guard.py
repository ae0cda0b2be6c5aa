"""The batch guard's state machine per width, a test per transition: measuring → on or off, on → off, off → probe
allowed → probing, probing → on or off; what a probe waits for; and the draft's idle share."""

from __future__ import annotations

from specrpc.engine.policy import BatchGuard
from specrpc.engine.policy.guard import Phase


def phase(guard: BatchGuard, width: int) -> Phase:
    """The phase of `width`'s bucket."""
    return guard.widths[BatchGuard.bucket(width)].phase


def measured(guard: BatchGuard, width: int) -> bool:
    """Whether both rates at `width` have `min_steps` steps."""
    state = guard.widths.get(BatchGuard.bucket(width))
    return state is not None and state.measured(guard.min_steps)


def measure(guard: BatchGuard, width: int, drafted_s: float, plain_s: float, tokens: int) -> list[int | None]:
    """Follow the guard's caps until both rates are measured (drafted steps take `drafted_s`, plain ones `plain_s`,
    each committing `tokens`); the caps it gave."""
    caps = []
    while not measured(guard, width):
        caps.append(cap := guard.plan(width))
        guard.observe(width, bool(cap), drafted_s if cap else plain_s, tokens)
    return caps


def plain_steps_to_probe(guard: BatchGuard, width: int, seconds: float, tokens: int) -> int:
    """Plain steps of `seconds` for `tokens` tokens before the guard allows a probe at `width`."""
    steps = 0
    while guard.plan(width) == 0:
        guard.observe(width, False, seconds, tokens)
        steps += 1
    return steps


# measuring


def test_measuring_alternates_drafted_and_plain_steps_until_both_are_measured() -> None:
    guard = BatchGuard(min_steps=2, probe_every=4, probe_k=2, plain_every=3, probe_share=1.0)
    # drafted steps (at most probe_k) and plain ones in turn, so that drift hits both
    assert measure(guard, 8, drafted_s=2.0, plain_s=1.0, tokens=8) == [2, 0, 2, 0]
    assert phase(guard, 8) is Phase.MEASURING  # judged at the next plan


def test_measuring_to_off_when_drafted_steps_are_slower() -> None:
    guard = BatchGuard(min_steps=2, probe_every=4, probe_k=2, plain_every=3, probe_share=1.0)
    measure(guard, 8, drafted_s=2.0, plain_s=1.0, tokens=8)  # 0.25 s per token with drafts, 0.125 s plain
    assert not guard.drafting_on(8) and not guard.drafting_on(5)
    assert guard.plan(8) == 0 and phase(guard, 8) is Phase.OFF


def test_measuring_to_on_when_drafted_steps_are_faster() -> None:
    guard = BatchGuard(min_steps=2, probe_k=2)
    measure(guard, 8, drafted_s=0.5, plain_s=1.0, tokens=8)
    assert guard.drafting_on(8)
    assert guard.plan(8) is None and phase(guard, 8) is Phase.ON


def test_measuring_to_off_is_not_held_by_one_stalled_plain_step() -> None:
    """Plain steps at 8 streams take 4.5 ms for 8 tokens, drafted ones 6.5 ms for 10 (slower per token); one plain
    step the host stalled to 17 ms does not make drafting look faster: it is judged off once both kinds are
    measured, and a drafted step stalled alike does not turn it back on."""
    guard = BatchGuard(min_steps=4)
    for _ in range(8):
        guard.observe(8, True, 6.5e-3, 10)
    guard.observe(8, False, 17e-3, 8)
    for _ in range(4):
        guard.observe(8, False, 4.5e-3, 8)
    assert guard.plan(8) == 0 and not guard.drafting_on(8)
    guard.observe(8, True, 30e-3, 10)
    assert not guard.drafting_on(8)


def test_widths_are_judged_per_bucket() -> None:
    guard = BatchGuard(min_steps=2, probe_every=4, probe_k=2, plain_every=3, probe_share=1.0)
    measure(guard, 8, drafted_s=2.0, plain_s=1.0, tokens=8)
    assert guard.plan(4) == 2 and guard.plan(7) == 0  # another bucket of widths decides on its own; 5..8 together
    assert [BatchGuard.bucket(w) for w in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]


# off → probe allowed → probing


def test_off_allows_a_probe_every_probe_every_steps_and_stays_off_until_one_drafts() -> None:
    guard = BatchGuard(min_steps=2, probe_every=4, probe_k=2, plain_every=3, probe_share=1.0)
    measure(guard, 8, drafted_s=2.0, plain_s=1.0, tokens=8)
    decisions = []
    for _ in range(8):
        decisions.append(guard.plan(8))
        guard.observe(8, False, 1.0, 8)
    assert decisions == [0, 0, 0, 2, 0, 0, 0, 2]  # off, a probe (at most probe_k) every 4th step
    assert phase(guard, 8) is Phase.PROBE_ALLOWED and not guard.drafting_on(8)


def probed_back_on() -> tuple[BatchGuard, list[int | None]]:
    """A guard that measured drafting slower at 8 streams, stayed off for 8 steps and 1 at 7 streams, then probed
    and found drafting faster (the stall is gone); the caps it gave from the last off step to the probe's end."""
    guard = BatchGuard(min_steps=2, probe_every=4, probe_k=2, plain_every=3, probe_share=1.0)
    measure(guard, 8, drafted_s=2.0, plain_s=1.0, tokens=8)
    for _ in range(8):
        guard.plan(8)
        guard.observe(8, False, 1.0, 8)
    guard.plan(7)
    probe = []
    while (cap := guard.plan(8)) is not None:  # the probe drafts fast now
        probe.append(cap)
        guard.observe(8, bool(cap), 0.5 if cap else 1.0, 8)
        assert phase(guard, 8) is (Phase.PROBING if 2 in probe else Phase.PROBE_ALLOWED)
    return guard, probe


def test_probe_allowed_to_probing_measures_both_rates_afresh_then_on_when_drafting_is_faster() -> None:
    guard, probe = probed_back_on()
    assert probe[-4:] == [2, 0, 2, 0]  # min_steps drafted and plain steps in turn, measured afresh
    assert phase(guard, 8) is Phase.ON and guard.drafting_on(8)


# probing → on or off


def margin_guard() -> BatchGuard:
    """A guard that measured drafting slower at 4 streams (0.25 s a token against 0.2 s plain), probing every 2
    steps at first, every 8 at most, coming back only 1.2× faster; what a probe costs is not what it waits for
    here (`test_probing_to_off_waits_for_plain_decoding_to_take_100x_what_the_probe_cost`)."""
    guard = BatchGuard(min_steps=1, probe_every=2, max_probe_every=8, resume_speedup=1.2, probe_k=2,
                       probe_share=1.0)
    assert guard.plan(4) == 2
    guard.observe(4, True, 1.0, 4)  # 0.25 s per token with drafts
    assert guard.plan(4) == 0
    guard.observe(4, False, 1.0, 5)  # 0.2 s per token plain: off
    return guard


def probe_gaps(guard: BatchGuard, drafted_s: float, probes: int) -> list[int]:
    """At 4 streams: plain steps (1 s for 5 tokens) before each of `probes` probes, each probe's step taking
    `drafted_s` for 4 tokens."""
    gaps = []
    for _ in range(probes):
        gaps.append(plain_steps_to_probe(guard, 4, 1.0, 5))
        guard.observe(4, True, drafted_s, 4)
    return gaps


def back_on(guard: BatchGuard) -> BatchGuard:
    """`guard` (a `margin_guard`) after four failed probes and one that brought drafting back (0.15 s a token:
    1.33× plain), judged on."""
    probe_gaps(guard, 0.88, 4)
    probe_gaps(guard, 0.6, 1)
    guard.plan(4)
    guard.observe(4, False, 1.0, 5)
    guard.plan(4)
    return guard


def test_probing_to_off_without_the_resume_margin_doubles_the_wait_up_to_max_probe_every() -> None:
    guard = margin_guard()
    # 0.22 s per token: faster than plain, but not by the 1.2 margin a probe needs to bring speculation back
    assert probe_gaps(guard, 0.88, 4) == [1, 4, 8, 8]  # 1, 3, 7, 7 and each probe's plain step
    assert not guard.drafting_on(4)


def test_probing_to_on_with_the_resume_margin() -> None:
    guard = margin_guard()
    probe_gaps(guard, 0.88, 4)
    probe_gaps(guard, 0.6, 1)  # 0.15 s per token: 1.33× plain, speculation is back, unlimited (once plain is measured)
    assert guard.plan(4) == 0
    guard.observe(4, False, 1.0, 5)
    assert guard.plan(4) is None and guard.drafting_on(4) and phase(guard, 4) is Phase.ON


def test_probing_to_on_halves_the_wait_for_the_next_probe_instead_of_resetting_it() -> None:
    guard = back_on(margin_guard())  # the failed probes had raised the wait to 8 steps
    for _ in range(20):
        guard.observe(4, True, 0.78, 4)  # not faster by min_speedup: off at the next plan
    assert probe_gaps(guard, 0.88, 2) == [3, 8]  # the successful probe halved the wait (8 → 4), not reset it to 2


# on


def test_on_decodes_plainly_one_step_in_plain_every_plus_one() -> None:
    guard, _ = probed_back_on()
    on = [guard.plan(8) for _ in range(8)]
    # on, unlimited, but for a plain step now and then (the probe's last plan was the first unlimited one)
    assert on == [None, None, 0, None, None, None, 0, None]
    assert guard.speedup(8) is not None and guard.speedup(8) > 1


def test_on_stays_on_while_faster_by_min_speedup_and_turns_off_below_it() -> None:
    guard = back_on(margin_guard())
    guard.observe(4, True, 0.85, 4)  # once on, it stays on with a smaller margin (1.05)
    assert guard.plan(4) is None
    for _ in range(20):
        guard.observe(4, True, 0.78, 4)  # 0.195 s per token: 1.03× plain, within the rates' noise
    assert not guard.drafting_on(4)
    assert guard.plan(4) == 0 and phase(guard, 4) is Phase.OFF


# what a probe waits for


def wide_guard() -> BatchGuard:
    """A guard that measured drafting slower at 16 streams: plain steps take 0.5 s for 16 tokens, a drafted one
    1.0 s; probes every 2 steps at first, up to 8, and cost at most 1 % of plain decoding's time."""
    guard = BatchGuard(min_steps=1, probe_every=2, max_probe_every=8, probe_k=2, probe_share=0.01)
    assert guard.plan(16) == 2
    guard.observe(16, True, 1.0, 16)
    assert guard.plan(16) == 0
    guard.observe(16, False, 0.5, 16)  # plain is faster: off
    return guard


def test_measuring_to_off_waits_for_plain_decoding_to_take_100x_what_the_measurement_cost() -> None:
    guard = wide_guard()
    # the first measurement cost 0.5 s beyond plain decoding: 50 s of plain steps
    assert plain_steps_to_probe(guard, 16, 0.5, 16) == 100


def test_probing_to_off_waits_for_plain_decoding_to_take_100x_what_the_probe_cost() -> None:
    """A probe whose drafts caught up on 0.3 s of contexts and whose step took 1.0 s (0.5 s beyond plain decoding's
    rate) cost 0.8 s: at probe_share 0.01 the next probe waits for 80 s of plain steps, not for the 4 steps the
    doubling asks; a probe that cost little waits the steps."""
    guard = wide_guard()
    plain_steps_to_probe(guard, 16, 0.5, 16)
    guard.observe(16, True, 1.0, 16, catch_up_s=0.3)
    # 0.8 s / 0.01 = 80 s of plain steps of 0.5 s, the probe's own among them (doubling: 4)
    assert plain_steps_to_probe(guard, 16, 0.5, 16) == 160
    guard.observe(16, True, 0.51, 16)  # 0.01 s beyond plain: 1 s of plain steps, less than the doubling's wait
    assert plain_steps_to_probe(guard, 16, 0.5, 16) == 8  # the probe's own plain step, then 7


def test_off_is_not_turned_on_by_plain_steps_the_host_slowed() -> None:
    """While off, plain steps the host slowed do not turn drafting on against the last probe's drafted rate: only
    probes judge."""
    guard = wide_guard()
    plain_steps_to_probe(guard, 16, 0.5, 16)
    guard.observe(16, True, 1.0, 16, catch_up_s=0.3)
    plain_steps_to_probe(guard, 16, 0.5, 16)
    guard.observe(16, True, 0.51, 16)
    plain_steps_to_probe(guard, 16, 0.5, 16)
    for _ in range(20):  # the host slows plain steps (2 s for 16 tokens): the stale drafted rate does not judge
        assert guard.plan(16) in (0, 2) and not guard.drafting_on(16)
        guard.observe(16, False, 2.0, 16)


def test_a_measurements_cost_is_not_set_by_one_stalled_step() -> None:
    """A first measurement of three drafted steps of 16 tokens, 0.6 s each (plain: 0.5 s) but one the host stalled
    to 5 s: its cost is its tokens at the median rates' difference (0.1 s a step, 0.3 s), so the next probe waits
    30 s of plain steps (60), not the 470 s the stalled sum would ask."""
    guard = BatchGuard(min_steps=3, probe_every=2, probe_share=0.01)
    drafted = iter([0.6, 5.0, 0.6])
    for _ in range(6):  # drafted and plain steps in turn
        cap = guard.plan(16)
        guard.observe(16, bool(cap), next(drafted) if cap else 0.5, 16)
    assert plain_steps_to_probe(guard, 16, 0.5, 16) == 60 and not guard.drafting_on(16)


# the draft's share


def test_the_draft_is_idle_at_a_width_where_the_policy_hardly_drafts() -> None:
    """The share of planned streams drafting with the draft model, per width: where it stays near 0 (the policy
    picks k = 0 for almost every stream, whether or not the guard could judge the width) a prompt's draft prefill is
    idle work; nothing is known before a step was seen, and drafting again lifts the share back."""
    guard = BatchGuard()
    assert not guard.draft_idle(16)
    for _ in range(20):
        guard.observe_share(16, 0, 16)
    assert guard.draft_idle(16) and guard.draft_idle(9) and not guard.draft_idle(8)
    for _ in range(10):
        guard.observe_share(16, 8, 16)
    assert not guard.draft_idle(16)

"""The adaptive k policy: expected tokens, speed-up, switch-off at break-even, probing back (the batch guard's
tests are test_policy_guard.py)."""

from __future__ import annotations

import random

import pytest

from specrpc.engine.policy import (
    AcceptanceEstimate,
    AdaptivePolicy,
    BatchCosts,
    BatchLoad,
    CostModel,
    SharedRates,
    expected_tokens,
)


def costs(c: float, v_per_token: float, max_k: int = 8) -> CostModel:
    model = CostModel(target_step_s=1.0, draft_step_s=c)
    for width in range(1, max_k + 2):
        model.verify_s[width] = 1.0 + v_per_token * (width - 1)
    return model


def test_expected_tokens_matches_closed_form() -> None:
    assert expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens(1.0, 4) == pytest.approx(5.0)
    assert expected_tokens(0.8, 4) == pytest.approx(sum(0.8**i for i in range(5)))


def test_high_acceptance_cheap_draft_speculates_deeply() -> None:
    policy = AdaptivePolicy(max_k=8, costs=costs(c=0.05, v_per_token=0.02),
                            acceptance={"draft": AcceptanceEstimate(accepted=95, trials=100)})
    k = policy.choose()
    assert k >= 5
    assert policy.speedup(k) > 2.5


def test_low_acceptance_switches_off_and_probes_back() -> None:
    policy = AdaptivePolicy(max_k=8, costs=costs(c=0.3, v_per_token=0.1), probe_every=4,
                            acceptance={"draft": AcceptanceEstimate(accepted=2, trials=10)})
    choices = [policy.choose() for _ in range(8)]
    assert choices.count(0) == 6
    assert [k for k in choices if k] == [policy.probe_k, policy.probe_k]


def test_break_even_is_exact() -> None:
    """k = 1 with c = 0.5, V = 1: S = (1 + α) / 1.5 > 1 iff α > 0.5."""
    model = costs(c=0.5, v_per_token=0.0, max_k=1)
    below = AdaptivePolicy(max_k=1, costs=model, min_speedup=1.0, acceptance={"draft": AcceptanceEstimate(49, 100)})
    above = AdaptivePolicy(max_k=1, costs=model, min_speedup=1.0, acceptance={"draft": AcceptanceEstimate(60, 100)})
    assert below.choose() == 0
    assert above.choose() == 1


def test_host_time_around_the_forwards_counts() -> None:
    """A short target step (int8 weights, a GPU) with host work around it: the forwards alone say drafting pays
    (S(1) = 1.75 / 1.35 = 1.30), but a drafted step's host time of 1.5 target steps against a plain step's 0.2 makes
    it lose (S(1) = 1.75 · 1.2 / 2.85 = 0.74, at most 0.94 at any k): the policy picks by whole steps. Prompt lookup's
    steps keep their own host time."""
    model = costs(c=0.25, v_per_token=0.1)
    policy = AdaptivePolicy(max_k=8, costs=model, acceptance={"draft": AcceptanceEstimate(75, 100)})
    assert policy.choose() > 0 and policy.speedup(1) == pytest.approx(1.75 / 1.35)
    for _ in range(policy.host.min_window):
        policy.host.observe("plain", 0.2)
        policy.host.observe("draft", 1.5)
    assert policy.host.of("draft") == pytest.approx(1.5)
    assert policy.speedup(1) == pytest.approx(1.75 * 1.2 / 2.85)
    assert policy.choose() == 0
    # lookup's host time not measured yet: a plain step's, not free
    assert policy.speedup(2, "lookup3", alpha=0.9) == pytest.approx(2.71 * 1.2 / (1.2 + 0.2))
    policy.host.observe("lookup", 0.25)
    assert policy.host.of("lookup") == pytest.approx(0.25)
    assert policy.speedup(2, "lookup3", alpha=0.9) == pytest.approx(2.71 * 1.2 / (1.2 + 0.25))


def test_a_plain_steps_host_time_is_never_read_above_a_drafted_steps() -> None:
    """A drafted step does all a plain one does and more: a plain step's host time a stall inflated (its first
    steps: 3 target steps) reads as the drafted steps' measured 0.2, so drafting that does not pay at that host time
    (S(1) = 1.75 · 1.2 / 3.7 = 0.57) is not kept for good by a stale plain time no plain step comes to correct."""
    model = costs(c=0.5, v_per_token=2.0)
    policy = AdaptivePolicy(max_k=8, costs=model, acceptance={"draft": AcceptanceEstimate(75, 100)})
    policy.host.observe("plain", 3.0)
    assert policy.host.of("plain") == pytest.approx(3.0) and policy.choose() > 0  # S(1) = 1.75 · 4 / 6.5
    for _ in range(policy.host.min_window):
        policy.host.observe("draft", 0.2)
    assert policy.host.of("plain") == pytest.approx(0.2) and policy.host.of("draft") == pytest.approx(0.2)
    assert policy.speedup(1) == pytest.approx(1.75 * 1.2 / 3.7)
    assert policy.choose() == 0


def test_an_unmeasured_kind_of_step_is_not_taken_for_free_host_time() -> None:
    """Plain steps measured at 0.3 target steps of host time, drafted ones not yet: drafting is judged with the
    plain step's host time (S(1) = 1.75 · 1.3 / 1.65 = 1.38), not none (1.75 · 1.3 / 1.35 = 1.69, which would
    pay a catch-up on a whole prompt that the first drafted steps then show was not worth it)."""
    model = costs(c=0.25, v_per_token=0.1)
    policy = AdaptivePolicy(max_k=8, costs=model, acceptance={"draft": AcceptanceEstimate(75, 100)})
    policy.host.observe("plain", 0.3)
    assert policy.host.of("draft") == pytest.approx(0.3)
    assert policy.speedup(1) == pytest.approx(1.75 * 1.3 / 1.65)


def test_a_draft_catch_up_is_paid_only_where_the_request_repays_it() -> None:
    """Catching the draft up on 400 prompt tokens at 0.05 target steps each (20 steps) is worth it for 64 tokens
    to go at S ≈ 2.5 (they save about 38 steps), not for 16 (about 10); never when drafting does not pay; always when
    the catch-up costs nothing."""
    model = costs(c=0.05, v_per_token=0.05)
    model.draft_prefill_s = 0.05
    policy = AdaptivePolicy(max_k=8, costs=model, acceptance={"draft": AcceptanceEstimate(80, 100)})
    best = max(policy.speedup(k) for k in range(1, 9))
    assert 2.2 < best < 2.6
    assert policy.catch_up_pays(lag=400, remaining=64)
    assert not policy.catch_up_pays(lag=400, remaining=16)
    model.draft_prefill_s = 0.0
    assert policy.catch_up_pays(lag=400, remaining=1)
    poor = AdaptivePolicy(max_k=8, costs=model, acceptance={"draft": AcceptanceEstimate(1, 100)})
    assert not poor.catch_up_pays(lag=400, remaining=10**6)
    model.observe_catch_up(100, 2.0)
    assert model.draft_prefill_s == pytest.approx(0.9 * 0.0 + 0.1 * 0.02)


def test_acceptance_counts_first_rejection_only() -> None:
    est = AcceptanceEstimate(accepted=0.0, trials=0.0, decay=1.0)
    est.observe(proposed=4, accepted=2)  # 2 successes, 1 failure; the 4th draft was never tested
    est.observe(proposed=3, accepted=3)  # 3 successes
    assert est.alpha == pytest.approx(5 / 6)


def test_cost_model_interpolates_unmeasured_widths() -> None:
    model = CostModel(target_step_s=1.0)
    model.observe_target(1, 1.0)
    model.observe_target(5, 2.0)
    assert model.v(2) == pytest.approx(1.5)
    assert model.v(4) == pytest.approx(2.0)


def test_prompt_lookup_is_costed_as_free() -> None:
    """The same α pays with prompt lookup (c = 0) but not with an expensive draft model."""
    alpha = {"draft": AcceptanceEstimate(40, 100), "lookup": AcceptanceEstimate(40, 100)}
    policy = AdaptivePolicy(max_k=4, costs=costs(c=0.5, v_per_token=0.05), acceptance=alpha)
    assert policy.choose("draft") == 0
    assert policy.choose("lookup") >= 1


def test_realized_rate_switches_off_a_proposer_slower_than_plain_decoding() -> None:
    """The cost model predicts a large gain, but whole steps measured slower than a target step switch it off."""
    policy = AdaptivePolicy(max_k=8, costs=costs(c=0.05, v_per_token=0.02), probe_every=4,
                            acceptance={"draft": AcceptanceEstimate(accepted=95, trials=100)})
    assert policy.choose() > 0
    for _ in range(policy.min_realized_steps - 1):
        policy.observe_step("draft", seconds=4.0, tokens=2)  # 2 s per token against a 1 s target step
    assert policy.choose() > 0, "too few steps to judge"
    policy.observe_step("draft", seconds=4.0, tokens=2)
    assert policy.realized_speedup("draft") == pytest.approx(0.5)
    choices = [policy.choose() for _ in range(8)]
    assert choices.count(0) == 6 and [k for k in choices if k] == [policy.probe_k] * 2
    for _ in range(5):
        policy.observe_step("plain", seconds=5.0, tokens=1)  # plain steps measured slower still: back on
    assert policy.realized_speedup("draft") == pytest.approx(2.5)
    assert policy.choose() > 0


def test_a_new_session_judges_by_the_devices_realized_rates_until_it_has_steps_of_its_own() -> None:
    """A server's slots take new requests with policies of their own: where the draft was slower than plain
    decoding in fact on the device (every session's solo steps, `SharedRates`), a new session does not pay again to
    learn it (a catch-up on its prompt, slow steps); a session without the device's rates still tries. Its own
    steps take over once it has enough, and a request's own k does not teach the device."""
    device, model = SharedRates(), costs(c=0.05, v_per_token=0.02)
    acceptance = {"draft": AcceptanceEstimate(accepted=95, trials=100)}
    first = AdaptivePolicy(max_k=8, costs=model, shared=device, acceptance=dict(acceptance))
    for _ in range(first.min_realized_steps):
        first.observe_step("plain", seconds=1.0, tokens=1)
        first.observe_step("draft", seconds=4.0, tokens=2)  # 2 s a token against plain's 1 s
    fresh = AdaptivePolicy(max_k=8, costs=model, shared=device,
                           acceptance={"draft": AcceptanceEstimate(accepted=95, trials=100)})
    alone = AdaptivePolicy(max_k=8, costs=model, acceptance={"draft": AcceptanceEstimate(accepted=95, trials=100)})
    assert fresh.realized_speedup("draft") == pytest.approx(0.5) and fresh.choose() == 0
    assert alone.realized_speedup("draft") == float("inf") and alone.choose() > 0
    for _ in range(fresh.min_realized_steps):  # this session's text drafts well: its own steps decide
        fresh.observe_step("draft", seconds=1.0, tokens=4)
    assert fresh.realized_speedup("draft") == pytest.approx(4.0) and fresh.choose() > 0
    other = SharedRates()
    fixed = AdaptivePolicy(max_k=8, costs=model, shared=other)
    for _ in range(fixed.min_realized_steps):
        fixed.observe_step("draft", seconds=9.0, tokens=1, share=False)  # a request's own k
    assert other.rates == {}


def test_realized_guard_comes_back_at_the_first_good_probe_and_stays_off_while_probes_are_slow() -> None:
    """Both ways: a stall switches the proposer off within min_realized_steps steps; slow probes keep it off; once
    the stall is gone, the first probe's own step brings it back (the stalled history does not hold it off)."""
    policy = AdaptivePolicy(max_k=8, costs=costs(c=0.05, v_per_token=0.02), probe_every=4,
                            acceptance={"draft": AcceptanceEstimate(accepted=95, trials=100)})
    steps_on = 0
    while (k := policy.choose()) > 0:  # stalled: 20 s per step of k+1 tokens against a 1 s target step
        policy.observe_step("draft", seconds=20.0, tokens=k + 1)
        steps_on += 1
    assert steps_on == policy.min_realized_steps  # the loop's last choice was the first step off
    for cycle in range(3):  # still stalled: every probe is slow, so it stays off between probes
        ks = [policy.choose() for _ in range(policy.probe_every - (cycle == 0))]
        assert ks[-1] == policy.probe_k and set(ks[:-1]) == {0}
        policy.observe_step("draft", seconds=20.0, tokens=policy.probe_k + 1)
    ks = [policy.choose() for _ in range(policy.probe_every)]  # the stall is gone: the next probe is fast
    assert ks[-1] == policy.probe_k and set(ks[:-1]) == {0}
    # the probe's step included 5 s of the draft catching up on the tokens it sat out: a one-off, left out
    policy.observe_step("draft", seconds=1.2 + 5.0, tokens=policy.probe_k + 1, catch_up_s=5.0)
    assert policy.realized_speedup("draft") == pytest.approx((policy.probe_k + 1) / 1.2)
    assert policy.choose() > policy.probe_k, "back on, at the model's k"
    # after a step without the draft (prompt lookup's, a plain one) the catch-up is likewise that step's price
    policy.observe_step("draft", seconds=1.0 + 5.0, tokens=3, catch_up_s=5.0)
    assert policy.realized["draft"].seconds < 5.0 and policy.choose() > policy.probe_k


def test_the_realized_guard_judges_what_steps_cost_not_the_luck_of_their_draws() -> None:
    """Costs exactly as modelled and drafts accepted at α 0.8, drawn at random (a draft step 0.34 of a target step,
    as a 0.5B draft beside a 1.5B int8 target): the guard never switches the draft off, whatever runs of rejections
    the draws bring. Counted as drawn, such runs switched it off for 18-28 % of 3,000 steps (five seeds; 48-54 % at
    α 0.7), 1.29-1.33 tokens a target step against 1.34-1.36."""
    rng = random.Random(7)
    model = costs(c=0.34, v_per_token=0.05)
    policy = AdaptivePolicy(max_k=8, costs=model)
    off = 0
    for _ in range(3000):
        k = 0 if policy.plain_due() else policy.choose()
        if k == 0:
            policy.observe_step("plain", seconds=1.0, tokens=1)
            continue
        accepted = 0
        while accepted < k and rng.random() < 0.8:
            accepted += 1
        policy.observe("draft", k, accepted)
        policy.observe_step("draft", seconds=model.d(k) + model.v(k), tokens=accepted + 1, drafts=k)
        off += policy.realized_speedup("draft") <= policy.min_speedup
    assert off == 0


def test_online_costs_settle_at_the_measured_level_and_ignore_one_stall() -> None:
    costs = CostModel(target_step_s=0.010, verify_s={1: 0.010, 4: 0.014}, draft_s={1: 0.002, 4: 0.006})
    for _ in range(20):
        costs.observe_target(4, 0.020)  # the machine got slower than at start-up
        costs.observe_target(1, 0.015)
        costs.observe_draft(4, 0.012)
    assert costs.verify_s[4] == 0.020 and costs.target_step_s == 0.015 and costs.draft_s[4] == 0.012
    costs.observe_target(4, 1.0)  # one stall
    costs.observe_draft(4, 0.5)
    assert costs.verify_s[4] == 0.020 and costs.draft_s[4] == 0.012
    assert costs.v(3) == pytest.approx(0.020 / 0.015) and costs.d(4) == pytest.approx(0.8)
    assert costs.c == pytest.approx(0.2)  # a token's share of the longest draft measured


def test_a_draft_costs_what_was_measured_at_its_length() -> None:
    """A short draft costs more a token than a long one (its first forward finds the draft's weights evicted):
    each measured length is its own cost, an unmeasured one is scaled from the nearest measured, and without any
    measurement k tokens cost k `draft_step_s`. The policy prices k by D(k): here S(1) = 1.8 / (0.3 + 1.1) where a
    cost per token from the long draft (0.15) would say 1.8 / 1.25."""
    costs = CostModel(target_step_s=1.0, draft_step_s=0.5, verify_s={1: 1.0, 2: 1.1, 9: 2.0},
                      draft_s={1: 0.3, 8: 1.2})
    assert costs.d(1) == pytest.approx(0.3) and costs.d(8) == pytest.approx(1.2)
    assert costs.d(2) == pytest.approx(0.6) and costs.d(6) == pytest.approx(0.9)  # nearest: 1, and 8
    assert CostModel(target_step_s=2.0, draft_step_s=0.5).d(3) == pytest.approx(0.75)
    policy = AdaptivePolicy(max_k=8, costs=costs, acceptance={"draft": AcceptanceEstimate(80, 100)})
    assert policy.speedup(1) == pytest.approx(1.8 / 1.4)


def test_the_table_a_step_reads_is_d_and_v_with_every_size_measured() -> None:
    """With every size measured (as calibration leaves the tables), `ratios` reads each entry ÷ the target step: the
    same values as `d` and `v`, while sizes go stale (a lone stream decoding plainly for long) and come back."""
    costs = CostModel(target_step_s=1.0, draft_step_s=0.2, verify_s={n: 1.0 + 0.15 * (n - 1) for n in range(1, 10)},
                      draft_s={k: 0.1 + 0.2 * k for k in range(1, 9)}, stale_after=4)
    rng = random.Random(0)
    for i in range(60):
        width = 1 if i < 30 else rng.choice([1, 3, 5])  # first the others go stale, then some come back
        costs.observe_target(width, 1.0 + 0.15 * (width - 1) + rng.uniform(-0.05, 0.05))
        if i % 7 == 0:
            costs.observe_draft(2, 0.5 + rng.uniform(-0.05, 0.05))
        drafts, verifies = costs.ratios(8)
        assert drafts == [costs.d(k) for k in range(9)] and verifies == [costs.v(k) for k in range(9)], i


def test_the_table_a_step_reads_follows_every_change_of_the_costs() -> None:
    """`ratios` (what a step's planning reads every k from) equals `d` and `v` at each k after measurements, stale
    sizes read through their estimate, and writes straight into the tables (as calibration makes them)."""
    costs = CostModel(target_step_s=1.0, draft_step_s=0.2, verify_s={1: 1.0, 2: 1.1, 5: 1.6}, draft_s={1: 0.3},
                      stale_after=3)

    def table() -> tuple[list[float], list[float]]:
        return [costs.d(k) for k in range(9)], [costs.v(k) for k in range(9)]

    def read() -> tuple[list[float], list[float]]:
        drafts, verifies = costs.ratios(8)
        return drafts[:9], verifies[:9]

    assert read() == table()
    for width, seconds in ((2, 1.3), (2, 1.2), (3, 1.4), (2, 1.25), (3, 1.45), (2, 1.2)):  # 1 and 5 go stale
        costs.observe_target(width, seconds)
        assert read() == table()
    costs.observe_draft(4, 0.9)
    assert read() == table()
    costs.verify_s[2] = 3.0  # a direct write to a fresh size: nothing counted, the same sizes
    assert read() == table() and read()[1][1] == pytest.approx(3.0)
    costs.target_step_s = 2.0
    assert read() == table() and read()[1][1] == pytest.approx(1.5)


def test_first_measurements_move_the_calibrated_costs_gradually() -> None:
    costs = CostModel(target_step_s=0.010, verify_s={1: 0.010})
    costs.observe_target(1, 0.020)
    assert 0.010 < costs.target_step_s < 0.020  # an EMA from the calibration until a window is in
    for _ in range(costs.window):
        costs.observe_target(1, 0.030)
    assert costs.target_step_s == 0.030


def test_a_draft_length_timed_under_load_and_never_chosen_again_comes_back_to_the_calibrated_shape() -> None:
    """Drafts timed while other streams' work shared the cores (every length 5x its cost) make long drafts look
    dear; a lone stream then drafts short, and the long lengths, never timed again, would stay dear for good. Once
    stale, a length is read from the fresh ones through the calibrated shape, so the policy, drafting on its own
    choices, returns to the k it chose before the burst within a few stale windows (with the stale rule off, it
    stays at short drafts)."""

    def run(stale_after: int) -> tuple[int, int, int]:
        costs = CostModel(target_step_s=1.0, verify_s={n: 1.0 + 0.05 * (n - 1) for n in range(1, 10)},
                          draft_s={k: 0.02 + 0.04 * k for k in range(1, 9)}, stale_after=stale_after)
        policy = AdaptivePolicy(max_k=8, costs=costs, acceptance={"draft": AcceptanceEstimate(90, 100)})
        before = policy.choose()
        for _ in range(costs.window):  # the burst: every length timed at 5x
            for k in range(1, 9):
                costs.observe_draft(k, 5 * (0.02 + 0.04 * k))
        during = policy.choose()
        for _ in range(6 * stale_after if stale_after < 10**6 else 400):  # alone again: drafts at their cost
            k = policy.choose()
            if k:
                costs.observe_draft(k, 0.02 + 0.04 * k)
                costs.observe_target(k + 1, 1.0 + 0.05 * k)
            costs.observe_target(1, 1.0)
        return before, during, policy.choose()

    before, during, after = run(stale_after=CostModel.stale_after)
    assert during < before and after == before
    assert run(stale_after=10**9)[2] < before  # never stale: the burst's costs stay


def batch_costs(fixed_s: float, per_token_s: float, draft_s: float = 0.05) -> BatchCosts:
    """A batched target forward of n tokens takes fixed + n · per_token seconds (measured at a few sizes)."""
    return BatchCosts(target_s={n: fixed_s + per_token_s * n for n in (1, 2, 4, 8, 16, 36, 72, 144)},
                      draft_s={w: draft_s * (1 + 0.1 * w) for w in (1, 2, 4, 8, 16)})


def test_batch_costs_interpolate_and_never_fall() -> None:
    table = BatchCosts(target_s={2: 2.0, 4: 3.0, 8: 2.9})
    assert table.target(3) == pytest.approx(2.5) and table.target(1) == pytest.approx(2.0)
    assert table.target(16) == pytest.approx(2.9)  # noisy last points falling: extended flat, not downwards
    assert BatchCosts().target(4) > 0 and BatchCosts(target_s={1: 0.0}).target(1) > 0


def test_batch_costs_extend_along_a_wide_baseline() -> None:
    """Beyond the largest size measured, the slope runs back to the largest size at most half of it: a forward
    costing 1 ms + 0.1 ms a token, its two largest entries off by noise in opposite directions, is extended near
    its true cost (along those two entries alone, 144 tokens would cost 38 ms against 15: a prompt chunk looking
    2.4x dearer)."""
    true = {n: 1e-3 + 1e-4 * n for n in (1, 2, 4, 8, 16, 32, 64, 72)}
    noisy = {**true, 64: true[64] * 0.85, 72: true[72] * 1.15}
    assert BatchCosts(target_s=true).target(144) == pytest.approx(true[72] + 1e-4 * 72)
    assert BatchCosts(target_s=noisy).target(144) == pytest.approx(true[72] + 1e-4 * 72, rel=0.25)
    assert BatchCosts(target_s={4: 1.0, 8: 3.0}).target(16) == pytest.approx(7.0)
    assert BatchCosts(target_s={6: 1.0, 8: 3.0}).target(16) == pytest.approx(11.0)  # none at most half: the smallest


@pytest.mark.parametrize("streams", [1, 2, 4, 8, 16])
def test_batched_k_shrinks_with_the_batch_and_turns_off(streams: int) -> None:
    """A device where a forward costs about its tokens beyond a fixed part (a CPU): alone, the stream speculates as
    its solo policy would; in a batch its k is chosen for the batch's throughput, smaller as the batch grows, and
    0 once each extra token costs more than the tokens it is expected to add."""
    policy = AdaptivePolicy(max_k=8, costs=costs(c=0.05, v_per_token=0.1),
                            acceptance={"draft": AcceptanceEstimate(accepted=80, trials=100)})
    table = batch_costs(fixed_s=1.0, per_token_s=0.1)
    others = streams - 1
    load = BatchLoad(table, tokens=others, committed=float(others))
    ks = [policy.choose(batch=load) for _ in range(3)]
    assert len(set(ks)) == 1
    k = ks[0]
    if streams == 1:
        assert k >= 3
    else:
        fewer = BatchLoad(table, tokens=others // 2, committed=float(others // 2))
        assert k <= policy.choose(batch=fewer)
    if streams == 16:
        assert k == 0


def test_a_flat_batch_cost_keeps_speculating_in_a_batch() -> None:
    """A device whose forward costs the same for any width (a GPU far from compute-bound): k stays deep."""
    policy = AdaptivePolicy(max_k=8, costs=costs(c=0.05, v_per_token=0.0),
                            acceptance={"draft": AcceptanceEstimate(accepted=90, trials=100)})
    load = BatchLoad(batch_costs(fixed_s=1.0, per_token_s=0.0, draft_s=0.01), tokens=15, committed=15.0,
                     draft_rows=(3, 3, 3, 3))
    assert policy.choose(batch=load) >= 4


def test_a_stream_joining_the_batchs_draft_forwards_pays_its_rows_not_the_forwards() -> None:
    """Three streams draft 2 tokens each: the step runs 2 batched draft forwards whatever the fourth does, and a
    forward costs the same for 3 rows as for 4 (the draft's weights are read once). Drafting 2 tokens too adds only
    its rows there and 2 tokens to the target's forward, so it pays; charged the two forwards whole (as if they ran
    for it alone), it would look slower than plain decoding."""
    policy = AdaptivePolicy(max_k=4, costs=costs(c=0.05, v_per_token=0.02),
                            acceptance={"draft": AcceptanceEstimate(accepted=80, trials=100)})
    table = BatchCosts(target_s={n: 1.0 + 0.02 * n for n in (1, 2, 4, 8, 16, 32)},
                       draft_s=dict.fromkeys((1, 2, 4, 8), 0.3))
    others = BatchLoad(table, tokens=9, committed=3 * expected_tokens(0.8, 2), draft_rows=(3, 3))
    assert others.draft_seconds(0) == pytest.approx(0.6) and others.draft_seconds(2) == pytest.approx(0.6)
    assert others.draft_seconds(3) == pytest.approx(0.9)  # a third forward, for this stream alone
    assert policy.choose(batch=others) == 2
    alone = BatchLoad(table, tokens=3, committed=3.0)  # nobody else drafts: its forwards are its own
    assert alone.draft_seconds(2) == pytest.approx(0.6)
    assert policy.choose(batch=alone) == 0


def test_a_batchs_draft_seconds_are_its_draft_forwards_each_at_its_rows() -> None:
    """`BatchLoad.draft_seconds(k)` (incremental, read for every k of every stream) is the sum over the step's draft
    forwards of each one's cost at its rows, this stream's among them in the first k."""
    rng = random.Random(7)
    table = BatchCosts(draft_s={w: 1e-4 * (1 + rng.random() * w) for w in (1, 2, 4, 8, 16)})
    for _ in range(200):
        rows = tuple(sorted((rng.randint(1, 9) for _ in range(rng.randint(0, 6))), reverse=True))
        load = BatchLoad(table, tokens=10, committed=10.0, draft_rows=rows)
        for k in range(10):
            forwards = [(rows[j] if j < len(rows) else 0) + (j < k) for j in range(max(len(rows), k))]
            assert load.draft_seconds(k) == pytest.approx(sum(table.draft(n) for n in forwards if n))


def test_a_plain_step_now_and_then_measures_plain_decoding_and_can_switch_speculation_off() -> None:
    """While speculating, every `plain_every` + 1-th solo step is plain: its measured rate, not the calibration,
    is what the realized guard compares with; here plain decoding is faster in fact, so speculation goes off."""
    policy = AdaptivePolicy(max_k=4, costs=costs(c=0.05, v_per_token=0.02), plain_every=5,
                            acceptance={"draft": AcceptanceEstimate(accepted=90, trials=100)})
    assert policy.realized_speedup("draft") == float("inf")
    for _ in range(5):
        assert not policy.plain_due() and policy.choose() > 0
        policy.observe_step("draft", seconds=2.0, tokens=3)  # 0.67 s a token: better than the calibrated 1 s
    assert policy.plain_due()
    policy.observe_step("plain", seconds=0.25, tokens=1)  # but plain decoding measures 0.25 s a token now
    assert not policy.plain_due()
    assert policy.realized_speedup("draft") < 1.0 and policy.choose() == 0


def test_a_probe_of_the_draft_waits_while_its_catch_up_on_a_prompt_would_cost_more_than_a_share_of_the_time_off(
) -> None:
    """A draft off for α: probing it first catches it up on what it has not seen. The steps it sat out are paid at
    any time (they grow with the time off); a prompt of 400 tokens at 0.05 target steps each (20 steps) waits until
    that is within `probe_share` of the time off (400 steps at 5 %), where a probe with nothing beyond the steps off
    comes at `probe_every`."""
    model = costs(c=0.3, v_per_token=0.1)
    model.draft_prefill_s = 0.05
    low = {"draft": AcceptanceEstimate(accepted=2, trials=10)}
    policy = AdaptivePolicy(max_k=8, costs=model, probe_every=4, acceptance=dict(low))
    steady = [policy.choose(catch_up=off + 1) for off in range(8)]
    assert steady == [0, 0, 0, policy.probe_k, 0, 0, 0, policy.probe_k]
    policy = AdaptivePolicy(max_k=8, costs=model, probe_every=4, acceptance=dict(low))
    prompt = [policy.choose(catch_up=400 + off + 1) for off in range(450)]
    assert [off + 1 for off, k in enumerate(prompt) if k] == [400]

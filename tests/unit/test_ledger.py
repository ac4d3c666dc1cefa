from dynaresize.driver.ledger import Ledger, sample_record, token_sha1


def _gen(ledger, sid, version=0, seed=1):
    ledger.generated(sample_id=sid, version=version, device=0, num_tokens=3, token_sha1="x", seed=seed)


def test_clean_run_passes():
    led = Ledger(staleness=1)
    led.expect(0, [(0, 0, 0), (0, 0, 1)])
    for sid in [(0, 0, 0), (0, 0, 1)]:
        _gen(led, sid)
        led.consumed(sid, 0)
    assert led.check() == []
    assert led.step_sample_ids(0) == {(0, 0, 0), (0, 0, 1)}


def test_violations_are_found():
    led = Ledger(staleness=1)
    led.expect(2, [(2, 0, 0), (2, 0, 1), (2, 1, 0)])
    _gen(led, (2, 0, 0), version=0)  # too stale for step 2
    led.consumed((2, 0, 0), 2)
    _gen(led, (2, 0, 1), version=1)
    led.consumed((2, 0, 1), 2)
    led.consumed((2, 0, 1), 2)  # twice
    problems = "\n".join(led.check())
    assert "too stale" in problems
    assert "consumed twice" in problems
    assert "never generated" in problems


def test_dropped_with_reason_is_fine_and_recorded():
    led = Ledger(staleness=1)
    _gen(led, (1, 0, 0), version=1)
    led.dropped((1, 0, 0), "generated ahead, run stopped")
    assert led.check() == []
    rec = sample_record(led.entries[(1, 0, 0)])
    assert rec["sample_id"] == "1-0-0" and rec["dropped"] and rec["consumed_step"] is None


def test_reissue_must_keep_seed():
    led = Ledger(staleness=1)
    _gen(led, (0, 0, 0), seed=5)
    led.dropped((0, 0, 0), "device lost")
    _gen(led, (0, 0, 0), seed=6)
    assert any("different seed" in p for p in led.check())


def test_token_sha1_format():
    import hashlib

    assert token_sha1([1, 22, 3]) == hashlib.sha1(b"1,22,3").hexdigest()


def test_reissued_sample_says_why():
    led = Ledger(staleness=1)
    led.note_reissue((0, 1, 2), "device lost during rollout 0")
    _gen(led, (0, 1, 2))
    _gen(led, (0, 1, 3))
    assert led.entries[(0, 1, 2)].reissued == "device lost during rollout 0"
    assert led.entries[(0, 1, 3)].reissued is None
    assert sample_record(led.entries[(0, 1, 2)])["reissued"].startswith("device lost")


def test_stop_at_drops_unconsumed_samples_and_waives_later_steps():
    led = Ledger(staleness=1)
    led.expect(0, [(0, 0, 0)])
    led.expect(1, [(1, 0, 0), (1, 0, 1)])
    led.expect(2, [(2, 0, 0)])
    _gen(led, (0, 0, 0))
    led.consumed((0, 0, 0), 0)
    _gen(led, (1, 0, 0), version=1)  # generated, never consumed; (1, 0, 1) never generated
    assert len(led.check()) == 3  # unconsumed, never generated (steps 1 and 2)
    dropped = led.stop_at(1, "run stopped")
    assert [e.sample_id for e in dropped] == [(1, 0, 0)]
    assert led.check() == []
    assert led.entries[(0, 0, 0)].dropped is None  # consumed samples are never dropped


def test_state_before_a_boundary_is_an_independent_copy():
    led = Ledger(staleness=1)
    for step in (0, 1):
        led.expect(step, [(step, 0, 0)])
        _gen(led, (step, 0, 0), version=step)
        led.consumed((step, 0, 0), step)
    before = led.state_before(1)
    assert set(before.entries) == {(0, 0, 0)} and set(before.expected) == {0}
    before.entries[(0, 0, 0)].dropped = "changed"
    assert led.entries[(0, 0, 0)].dropped is None
    assert led.check() == []

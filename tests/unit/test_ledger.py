from dynaresize.ledger import Ledger, sample_record, token_sha1


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

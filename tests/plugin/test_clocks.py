"""``outboxkit.testing.clocks`` and the ``outbox_clock`` fixture: the marker, the freezegun tie."""

from __future__ import annotations

import pytest

from tests.plugin.sample import run


def test_clock_marker_and_freezegun_tie(app: pytest.Pytester) -> None:
    result = run(
        app,
        """
        import time
        from datetime import datetime, timezone
        import pytest
        from outboxkit import Event
        from apphelpers import enqueue
        import myapp

        def test_default_start(outbox_clock):
            assert outbox_clock.now().isoformat() == "2030-01-01T00:00:00+00:00"

        @pytest.mark.outbox(now="2031-05-06T07:08:09Z")
        def test_marker(outbox_clock):
            assert outbox_clock.now() == datetime(2031, 5, 6, 7, 8, 9, tzinfo=timezone.utc)
            outbox_clock.advance(1.5)
            assert outbox_clock.now().microsecond == 500000

        @pytest.mark.outbox(now="2031-05-06T07:08:09Z", freezegun=True)
        def test_freezegun(outbox, outbox_drain, outbox_clock):
            seen = []

            def stamp(event, ctx):
                seen.append((datetime.now(timezone.utc), outbox_clock.now(), time.time()))
                if ctx.attempt < 4:
                    raise ConnectionError("not yet")

            outbox.bus.subscribe("stamp", stamp, name="stamp")
            enqueue(outbox, "stamp", {})
            with outbox_drain.expect_failures("stamp"):
                report = outbox_drain()
            assert len(seen) == 4
            for app_now, clock_now, wall in seen:
                assert app_now == clock_now
                assert wall == clock_now.timestamp()
            assert [d.at for d in report.deliveries] == [c for _, c, _ in seen]
            # moving freezegun's time moves the outbox clock too, and the other way round
            before = outbox_clock.now()
            outbox_clock.freezer.tick(5)
            assert outbox_clock.now() == datetime.now(timezone.utc)
            assert (outbox_clock.now() - before).total_seconds() == 5
            outbox_clock.advance(10)
            assert datetime.now(timezone.utc) == outbox_clock.now()
            assert (datetime.now(timezone.utc) - before).total_seconds() == 15
        """,
    )
    result.assert_outcomes(passed=3)


def test_freezegun_tie_lets_an_async_handler_await_a_timer(any_app: pytest.Pytester) -> None:
    # freeze_time without real_asyncio froze the event loop's monotonic clock: an async def
    # handler awaiting any timer never woke up (the drain hung).
    result = run(
        any_app,
        """
        import asyncio
        from datetime import datetime, timezone
        import pytest
        from outboxkit import EventBus, Outbox

        bus = EventBus()
        seen = []

        @bus.handler("tick", name="waits", transactional=False)
        async def waits(event, ctx):
            await asyncio.wait_for(asyncio.sleep(0.001), timeout=5)
            seen.append(datetime.now(timezone.utc))

        @pytest.fixture
        def outbox(outbox_store, outbox_clock):
            return Outbox(outbox_store, bus, clock=outbox_clock)

        @pytest.mark.outbox(freezegun=True)
        def test_awaits_a_timer(outbox, outbox_drain, outbox_clock):
            with outbox.store.transaction() as conn:
                outbox.enqueue(conn, "tick", {})
            outbox_drain().assert_delivered("tick", handler="waits")
            assert seen == [outbox_clock.now()]
        """,
    )
    result.assert_outcomes(passed=1)


def test_time_machine_tie(any_app: pytest.Pytester) -> None:
    result = run(
        any_app,
        """
        import time
        from datetime import datetime, timezone
        import pytest
        from apphelpers import enqueue

        @pytest.mark.outbox(now="2031-05-06T07:08:09Z", time_machine=True)
        def test_time_machine(outbox, outbox_drain, outbox_clock):
            seen = []

            def stamp(event, ctx):
                seen.append((datetime.now(timezone.utc), outbox_clock.now(), time.time()))
                if ctx.attempt < 3:
                    raise ConnectionError("not yet")

            outbox.bus.subscribe("stamp", stamp, name="stamp")
            enqueue(outbox, "stamp", {})
            with outbox_drain.expect_failures("stamp"):
                report = outbox_drain()
            assert len(seen) == 3
            for app_now, clock_now, wall in seen:
                assert app_now == clock_now
                assert wall == clock_now.timestamp()
            assert [d.at for d in report.deliveries] == [c for _, c, _ in seen]
            before = outbox_clock.now()
            outbox_clock.traveller.shift(5)
            assert outbox_clock.now() == datetime.now(timezone.utc)
            assert (outbox_clock.now() - before).total_seconds() == 5
            outbox_clock.advance(10)
            assert (datetime.now(timezone.utc) - before).total_seconds() == 15

        @pytest.mark.outbox(time_machine=True, freezegun=True)
        def test_not_both(outbox_clock):
            pass
        """,
    )
    result.assert_outcomes(passed=1, errors=1)
    assert "either freezegun or time-machine" in result.stdout.str()

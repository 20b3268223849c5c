"""The simulator's report beyond attainment: SLO-breach minutes (minutes whose requests' SLO
percentile of TTFT or time per output token missed its objective, failed requests counted as
over both) and failed requests split into rejected and timed out."""

from __future__ import annotations

from collections.abc import Sequence

from kvasir.simulator.cluster import Result, Slo, nearest_rank
from kvasir.simulator.latency import LogHistogram
from kvasir.simulator.replica import Finished

SLO = Slo(ttft_s=1.0, itl_s=0.1, attainment=0.99)


def minute(start: float, count: int, slow_ttft: int = 0, slow_tpot: int = 0) -> list[Finished]:
    """`count` requests arriving in the minute from `start`, the first `slow_ttft` over the TTFT
    objective and the next `slow_tpot` over the time-per-token one."""
    out = []
    for i in range(count):
        ttft = 2.0 if i < slow_ttft else 0.2
        tpot = 0.5 if slow_ttft <= i < slow_ttft + slow_tpot else 0.02
        out.append(Finished(i, start + i * 59.0 / count, ttft, tpot, 100))
    return out


def result(
    finished: list[Finished], rejected: Sequence[float] = (), timed_out: Sequence[float] = ()
) -> Result:
    return Result(
        "test",
        finished,
        LogHistogram(),
        1.0,
        0,
        1,
        slo=SLO,
        rejected=list(rejected),
        timed_out=list(timed_out),
    )


def test_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert nearest_rank(values, 0.99) == 99.0
    assert nearest_rank(values, 0.5) == 50.0
    assert nearest_rank([3.0], 0.99) == 3.0


def test_a_minute_breaches_when_its_percentile_misses_either_objective() -> None:
    good = minute(0.0, 200, slow_ttft=2)  # 1% over TTFT: the P99 (rank 198) still meets it
    ttft = minute(60.0, 200, slow_ttft=3)  # 1.5% over: the P99 misses
    tpot = minute(120.0, 100, slow_tpot=2)  # 2% over time per token
    quiet = minute(300.0, 10)  # minutes 3 and 4 have no requests: no breach
    run = result([*good, *ttft, *tpot, *quiet])
    assert run.slo_breach_minutes() == 2
    assert run.summary()["slo_breach_minutes"] == 2


def test_failed_requests_count_as_misses_in_their_minute_and_in_attainment() -> None:
    # 2 of 200 failed: as 2 slow requests, within the P99 (rank 198); 3 of 200 miss it.
    assert result(minute(0.0, 198), rejected=[10.0], timed_out=[20.0]).slo_breach_minutes() == 0
    run = result(minute(0.0, 197), rejected=[10.0, 11.0], timed_out=[20.0])
    assert run.slo_breach_minutes() == 1
    assert run.slo_attainment == 197 / 200
    summary = run.summary()
    counts = (summary["failed_requests"], summary["rejected_requests"], summary["timed_out_requests"])
    assert counts == (3, 2, 1)
    # A minute in which every request failed breaches too.
    assert result([], timed_out=[130.0]).slo_breach_minutes() == 1
    assert result([], timed_out=[130.0]).slo_attainment == 0.0

"""The statistics and goodput arithmetic of `tandem bench`, on a fixture of five records whose numbers are worked
out by hand here (tests/bench/fixtures/records.jsonl):

    #  class  due   sent  first  end   token messages (time: tokens)          usage          outcome
    0  short  0.0   0.0   0.2    0.5   0.2:1 0.3:1 0.4:1 0.5:1                100 prompt, 0 cached
    1  short  1.0   1.05  1.5    2.0   1.5:1 1.6:2 2.0:1  (a 2-token message)  100, 50 cached
    2  long   2.0   2.0   4.0    4.6   4.0:1 4.2:1 4.4:1 4.6:1                1000, cached unknown
    3  long   3.0   3.0   -      -     failed: UNAVAILABLE
    4  short  4.0   4.0   4.1    4.1   4.1:1                                  20, 16 cached
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.bench.loadgen.report import read_records, write_records
from tandem.bench.loadgen.stats import RequestMetrics, describe, max_rate_meeting, parse_slo, summarize

FIXTURE = Path(__file__).parent / "fixtures" / "records.jsonl"
SLO = parse_slo("ttft=1s,itl_p99=300ms")


@pytest.fixture(scope="module")
def records():
    return read_records(FIXTURE)


def test_per_request_latencies_count_from_the_due_time(records):
    m = [RequestMetrics.of(r) for r in records if r.ok]
    assert [x.ttft_s for x in m] == pytest.approx([0.2, 0.5, 2.0, 0.1])  # request 1: 0.45 s after it was sent
    assert [x.e2e_s for x in m] == pytest.approx([0.5, 1.0, 2.6, 0.1])
    # TPOT = (e2e - TTFT) / (output tokens - 1): 0.3/3, 0.5/3, 0.6/3; undefined for one token
    assert m[0].tpot_s == pytest.approx(0.1) and m[1].tpot_s == pytest.approx(0.5 / 3)
    assert m[2].tpot_s == pytest.approx(0.2) and m[3].tpot_s is None
    assert m[1].itl_s == pytest.approx((0.1, 0.4))  # the 2-token message is one gap
    assert m[1].pacing_s == pytest.approx(0.05)
    with pytest.raises(ValueError, match="did not complete"):
        RequestMetrics.of(records[3])


def test_the_summary_of_the_fixture(records):
    s = summarize(records, SLO, asked_rate=1.0)
    assert (s["requests"], s["completed"], s["failed"], s["errors"]) == (5, 4, 1, {"UNAVAILABLE": 1})
    assert s["duration_s"] == pytest.approx(4.6)  # first due time 0.0 to the last end 4.6
    assert s["request_throughput"] == pytest.approx(4 / 4.6)
    assert s["output_token_throughput"] == pytest.approx(13 / 4.6)
    assert s["total_token_throughput"] == pytest.approx((13 + 1220) / 4.6)
    # TTFT ms [200, 500, 2000, 100]: sorted [100, 200, 500, 2000]; p50 between 200 and 500; p90 at 2.7 of 3
    assert s["ttft_ms"]["mean"] == pytest.approx(700) and s["ttft_ms"]["p50"] == pytest.approx(350)
    assert s["ttft_ms"]["p90"] == pytest.approx(500 + 0.7 * 1500) and s["ttft_ms"]["max"] == pytest.approx(2000)
    # every gap, ms: [100, 100, 100] + [100, 400] + [200, 200, 200]; sorted, p99 at 6.93 of 7
    assert s["itl_ms"]["count"] == 8 and s["itl_ms"]["mean"] == pytest.approx(175)
    assert s["itl_ms"]["p50"] == pytest.approx(150) and s["itl_ms"]["p99"] == pytest.approx(200 + 0.93 * 200)
    assert s["tpot_ms"]["count"] == 3 and s["tpot_ms"]["mean"] == pytest.approx((100 + 500 / 3 + 200) / 3)
    assert s["e2e_ms"]["max"] == pytest.approx(2600)
    # cached / prompt over the completed requests that report it: (0 + 50 + 16) / (100 + 100 + 20)
    assert s["prefix_hit_rate"] == pytest.approx(66 / 220)
    # sends at 0, 1.05, 2, 3, 4: 4 gaps over 4 s; pacing ms [0, 50, 0, 0, 0], p99 at 3.96 of 4
    assert s["achieved_rate"] == pytest.approx(1.0) and s["asked_rate"] == 1.0
    assert s["pacing_ms"]["p99"] == pytest.approx(48) and s["pacing_ms"]["max"] == pytest.approx(50)


def test_goodput_counts_only_requests_within_every_slo_and_failures_are_misses(records):
    s = summarize(records, SLO)
    # 0: meets both. 1: its own ITL p99 is 100 + 0.99 * 300 = 397 ms > 300. 2: TTFT 2 s > 1 s. 3: failed.
    # 4: one token, no gaps, TTFT 100 ms: meets.
    assert s["goodput_rps"] == pytest.approx(2 / 4.6) and s["slo_attainment"] == pytest.approx(2 / 5)
    assert summarize(records)["goodput_rps"] == pytest.approx(4 / 4.6)  # no SLO: every completed request
    assert summarize(records, parse_slo("ttft=2s,itl_p99=400ms"))["slo_attainment"] == pytest.approx(4 / 5)
    short, long = s["by_class"]["short"], s["by_class"]["long"]
    assert (short["requests"], short["completed"], short["slo_attainment"]) == (3, 3, pytest.approx(2 / 3))
    assert (long["requests"], long["completed"], long["slo_attainment"]) == (2, 1, 0.0)
    assert short["server_timings_ms"]["queue_s"]["mean"] == pytest.approx(20)  # request 4 reported none
    assert long["server_timings_ms"]["prefill_s"]["p50"] == pytest.approx(1400)


def test_the_highest_rate_meeting_the_attainment():
    points = [(1.0, {"slo_attainment": 0.99}), (2.0, {"slo_attainment": 0.95}), (4.0, {"slo_attainment": 0.5})]
    assert max_rate_meeting(points, 0.9) == 2.0
    assert max_rate_meeting(points, 0.999) is None


def test_describe_and_slo_parsing():
    assert describe([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    assert describe([3.0])["p99"] == 3.0
    slo = parse_slo("ttft=2s, itl_p99=200ms,tpot=50ms,e2e=10s,itl_max=1s")
    assert (slo.ttft, slo.itl_p99, slo.tpot, slo.e2e, slo.itl_max) == (2.0, 0.2, 0.05, 10.0, 1.0)
    assert not parse_slo(None) and not parse_slo("")
    with pytest.raises(ValueError, match="with a unit"):
        parse_slo("ttft=2")
    with pytest.raises(ValueError, match="unknown SLO 'ttfb'; known: ttft, tpot, itl_p99, itl_max, e2e"):
        parse_slo("ttfb=2s")


def test_records_round_trip_and_a_bad_line_is_named(records, tmp_path):
    path = tmp_path / "r.jsonl"
    write_records(path, records)
    assert read_records(path) == records
    path.write_text(FIXTURE.read_text() + '{"index": 9, "scheduled_s": 0, "colour": "red"}\n')
    with pytest.raises(ValueError, match=r"r.jsonl:6: not a tandem bench record: unknown field\(s\) colour"):
        read_records(path)

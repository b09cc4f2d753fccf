"""The benches' shared statistics (engine/bench_stats.py) and machine readings
(engine/machine_state.py): intervals, pairing, the tau bound, the verdict, the repeat schedule,
/proc and nvidia-smi parsing, and the busy-machine warning. Pure: no torch, no server.

    python -m pytest -q tests/engine/test_bench_stats.py
"""

from __future__ import annotations

import math

import pytest

from engine.bench_stats import (
    MIN_REPEATS_FOR_VERDICT,
    RepeatSchedule,
    Spread,
    beyond_tau,
    counted,
    exceeds_tau,
    interval_coverage,
    interval_name,
    median_interval,
    paired_ratios,
    rotated,
    spread_fields,
    spread_in,
    verdict,
)
from engine.machine_state import (
    MachineWatch,
    QuietGate,
    Reading,
    between,
    busy_warning,
    parse_gpu_processes,
    parse_gpus,
    parse_loadavg,
    parse_proc_stat,
    summary,
)


def test_rotation_starts_each_repeat_with_the_next_method():
    methods = ["ar", "linear", "ddtree:15"]
    assert [rotated(methods, r) for r in range(4)] == [
        ["ar", "linear", "ddtree:15"],
        ["linear", "ddtree:15", "ar"],
        ["ddtree:15", "ar", "linear"],
        ["ar", "linear", "ddtree:15"],
    ]
    assert rotated([], 3) == []


@pytest.mark.parametrize(("n", "k"), [(5, 1), (8, 1), (9, 2), (10, 2), (12, 3), (20, 6), (30, 10)])
def test_the_median_interval_uses_the_binomial_order_statistics(n, k):
    """k-th smallest to k-th largest: the textbook 95% interval of a median (k = 1 below 9)."""
    values = list(range(1, n + 1))
    spread = median_interval(reversed(values))
    assert (spread.low, spread.high, spread.n) == (k, n + 1 - k, n)
    assert spread.median == (n + 1) / 2
    coverage = 1 - 2 * sum(math.comb(n, j) for j in range(k)) / 2**n
    assert coverage >= 0.95 or k == 1


@pytest.mark.parametrize(
    ("n", "coverage", "name"),
    [
        (1, 0.0, "no interval (1 value)"),
        (3, 0.75, "75% interval (min-max)"),
        (5, 0.9375, "93% interval (min-max)"),
        (6, 0.96875, "95% interval"),
        (9, 1 - 2 * 10 / 512, "95% interval"),
    ],
)
def test_an_interval_is_named_by_what_it_covers(n, coverage, name):
    """Below 6 values the min-max holds the median less than 95% of the time: labels say so."""
    assert interval_coverage(n) == pytest.approx(coverage)
    assert interval_name(n) == name


def test_a_spread_prints_its_interval_and_one_value_prints_alone():
    assert median_interval([1.24, 1.31, 1.38]).text("x") == "1.31x (1.24-1.38)"
    assert median_interval([0.0123]).text(" ms", 1, 1000) == "12.3 ms"
    assert median_interval([]) is None
    spread = Spread(1.3, 1.2, 1.4, 5)
    assert Spread.from_json(spread.to_json()) == spread


def test_a_spread_flattens_into_a_rows_fields_and_back():
    spread = Spread(1.3141, 1.2049, 1.4, 5)
    row = spread_fields("speedup", spread, digits=2)
    assert row == {"speedup": 1.31, "speedup_low": 1.2, "speedup_high": 1.4}
    assert spread_in(spread_fields("speedup", spread), "speedup", 5) == spread
    assert spread_fields("ttft_s", None) == dict.fromkeys(("ttft_s", "ttft_s_low", "ttft_s_high"))
    assert spread_in(spread_fields("ttft_s", None), "ttft_s", 5) is None


def test_ratios_pair_only_what_both_measured():
    rates = {0: 30.0, 1: 20.0, 2: None, 3: 40.0}
    base = {0: 10.0, 1: 10.0, 2: 10.0, 4: 10.0}
    assert paired_ratios(rates, base) == [3.0, 2.0]


def test_a_speedup_above_tau_with_slack_is_disturbed():
    assert not exceeds_tau(3.3, 3.02)  # within 10% of tau: timing jitter
    assert exceeds_tau(43.5, 3.02)  # the incident of issue 31
    assert not exceeds_tau(None, 3.0) and not exceeds_tau(5.0, None) and not exceeds_tau(5.0, 0.0)


def test_a_repeats_methods_beyond_their_tau_are_named_with_their_speedup():
    """Both benches' check of one repeat: each method's rate over the baseline's, against tau."""
    rates = {"ar": 10.0, "linear": 20.0, "ddtree:15": 45.0, "ddtree:8": None}
    taus = {"ar": 1.0, "linear": 2.0, "ddtree:15": 3.0, "ddtree:8": 2.0}
    assert beyond_tau(rates, taus, "ar") == {"ddtree:15": 4.5}  # linear's 2.0x is within tau
    assert beyond_tau({**rates, "ar": None}, taus, "ar") == {}  # no baseline: nothing to pair
    assert beyond_tau({**rates, "ar": 1.0}, {}, "ar") == {}  # no tau: nothing to bound


def three(a: float, b: float, c: float) -> Spread:
    return median_interval([a, b, c])


def test_a_winner_is_named_only_when_its_interval_clears_the_rest():
    clear = verdict({"linear": three(1.1, 1.2, 1.3), "ddtree:15": three(1.5, 1.6, 1.7)})
    assert clear.winner == "ddtree:15" and clear.leaders == ("ddtree:15",)
    assert clear.text == "ddtree:15 wins: 1.60x (1.50-1.70) over ar, clear of the rest"
    # The quiet demo of issue 31: 1.28x, 1.28x, 1.10x within noise is a tie, not a win.
    tie = verdict(
        {
            "ddtree:4": three(1.20, 1.28, 1.35),
            "ddtree:8": three(1.18, 1.28, 1.33),
            "ddtree:15": three(1.02, 1.10, 1.21),
        }
    )
    assert tie.winner is None and tie.leaders == ("ddtree:4", "ddtree:8", "ddtree:15")
    assert tie.text.startswith(
        "no clear winner at this noise (intervals overlap): leaders ddtree:4"
    )


def test_ar_is_a_rival_at_one_and_few_repeats_name_no_winner():
    near_one = verdict({"ddtree:15": three(0.95, 1.1, 1.2)})
    assert near_one.winner is None and near_one.leaders == ("ddtree:15", "ar")
    slower = verdict({"linear": three(0.4, 0.5, 0.6), "ddtree:15": three(0.5, 0.6, 0.7)})
    assert slower.winner == "ar" and "every other is clearly slower" in slower.text
    few = verdict({"ddtree:15": median_interval([3.0, 3.1])})
    assert few.winner is None and "only 2 clean repeats" in few.text
    assert MIN_REPEATS_FOR_VERDICT == 3
    assert verdict({"ar": three(1, 1, 1)}).text == "no verdict: no method measured against ar"


def test_a_time_is_won_by_the_lowest_and_only_when_its_interval_lies_below_the_rest():
    """A TTFT over the first server's: below 1x answers sooner (issue 37's servers verdict)."""
    sooner = verdict({"s2": three(0.4, 0.5, 0.6), "s3": three(0.9, 1.0, 1.1)}, "s1",
                     lower_is_better=True)  # fmt: skip
    assert sooner.winner == "s2" and sooner.leaders == ("s2",)
    assert sooner.text == "s2 wins: 0.50x (0.40-0.60) of s1's, clear of the rest"
    later = verdict({"s2": three(1.5, 2.0, 2.5)}, "s1", lower_is_better=True)
    assert later.winner == "s1" and later.text == "s1 wins: every other is clearly higher"
    # The same figures read as rates would name s3 (the highest): the direction matters.
    assert verdict({"s2": three(0.4, 0.5, 0.6), "s3": three(1.2, 1.3, 1.4)}, "s1").winner == "s3"
    noise = verdict({"s2": three(0.8, 0.95, 1.05)}, "s1", lower_is_better=True)
    assert noise.winner is None and noise.leaders == ("s2", "s1")
    few = verdict({"s2": median_interval([0.2, 0.3])}, "s1", lower_is_better=True)
    assert few.winner is None and "only 2 clean repeats" in few.text


def test_the_schedule_runs_the_minimum_then_fills_its_share_and_redoes_disturbed_repeats():
    schedule = RepeatSchedule(min_repeats=2, max_repeats=10, share_s=35.0)
    runs = 0
    while schedule.more():
        schedule.record(10.0, disturbed=runs == 1)
        runs += 1
    # 2 clean + 1 disturbed redone = 30 s; a 4th (at 10 s a repeat) would pass 35 s
    assert (schedule.clean, schedule.disturbed, runs) == (2, 1, 3)
    capped = RepeatSchedule(min_repeats=1, max_repeats=3, share_s=1e9)
    while capped.more():
        capped.record(1.0, disturbed=False)
    assert capped.clean == 3
    busy = RepeatSchedule(min_repeats=2, max_repeats=5, share_s=0.0)
    while busy.more():
        busy.record(1.0, disturbed=True)
    assert (busy.clean, busy.disturbed) == (0, 3)  # a machine that stays busy: give up


def test_under_bursts_the_share_buys_clean_repeats_past_the_redo_limit():
    """Issue 37, Must 8: 4 disturbed repeats of 6 ended the group with 2 clean ones, whose
    median moved with the bursts; while the share lasts every disturbed repeat is redone."""
    bursts = RepeatSchedule(min_repeats=3, max_repeats=20, share_s=100.0)
    verdicts = iter([True, True, False, True, True, False] + [True, False] * 20)
    while bursts.more():
        bursts.record(5.0, disturbed=next(verdicts))
    # 20 repeats of 5 s fill the share: 9 clean beside 11 disturbed (the old limit stopped at 2)
    assert (bursts.clean, bursts.disturbed) == (9, 11)
    spent = RepeatSchedule(min_repeats=3, max_repeats=20, share_s=10.0)
    while spent.more():
        spent.record(5.0, disturbed=True)
    assert (spent.clean, spent.disturbed) == (0, 4)  # past the share: min_repeats redone at most


PROC_STAT = """cpu  100 5 50 800 20 3 2 0 0 0
cpu0 50 2 25 400 10 1 1 0 0 0
cpu1 50 3 25 400 10 2 1 0 0 0
intr 12345
"""


def test_proc_stat_and_loadavg_parse():
    assert parse_proc_stat(PROC_STAT) == (160, 980, 2)
    assert parse_loadavg("0.52 0.61 0.70 2/345 6789\n") == (0.52, 0.61, 0.70)


def test_others_cpu_is_busy_time_less_the_bench_and_engine_s():
    before = Reading(at=0.0, busy_jiffies=1000, total_jiffies=10000, cpus=2, own_cpu_s=5.0)
    after = Reading(
        at=10.0, busy_jiffies=2500, total_jiffies=12000, load=(3.5, 1, 1), own_cpu_s=12.0
    )
    figures = between(before, after)
    # 1500 busy jiffies of 2000: 700 are ours (7 s at USER_HZ 100), 800 someone else's
    assert figures == {
        "seconds": 10.0,
        "load_1m": 3.5,
        "busy_cpu": 0.75,
        "own_cpu": 0.35,
        "others_cpu": 0.4,
    }
    unknown_own = between(before, Reading(at=1.0, busy_jiffies=2500, total_jiffies=12000))
    assert "others_cpu" not in unknown_own and unknown_own["busy_cpu"] == 0.75


def test_nvidia_smi_csv_parses_with_missing_values():
    gpus = parse_gpus("0, 1980, 2520, 9501, 61, 97\n1, [N/A], 2520, 9501, 40, 0\n")
    assert gpus[0] == {
        "index": 0,
        "sm_mhz": 1980.0,
        "sm_max_mhz": 2520.0,
        "mem_mhz": 9501.0,
        "temperature_c": 61.0,
        "utilization_pct": 97.0,
    }
    assert gpus[1]["sm_mhz"] is None
    apps = parse_gpu_processes("4242, python3, 81000\n4343, /usr/bin/other, 512\n")
    assert [p["pid"] for p in apps] == [4242, 4343] and apps[0]["used_mib"] == 81000.0
    assert parse_gpu_processes("") == ()


def test_a_watch_reads_through_its_readers_and_survives_what_it_cannot_read():
    calls = []

    def run(argv):
        calls.append(argv[1].split("=")[0])
        if "--query-gpu" in argv[1]:
            return "0, 1800, 2520, 9501, 70, 99\n"
        return "4242, python3, 81000\n"

    texts = {"/proc/stat": PROC_STAT, "/proc/loadavg": "2.5 1 1 1/1 1\n"}
    watch = MachineWatch(texts.__getitem__, run, lambda: 1.0, clock=lambda: 5.0)
    reading = watch.reading()
    assert (reading.busy_jiffies, reading.cpus, reading.load[0], reading.at) == (160, 2, 2.5, 5.0)
    assert reading.gpus[0]["sm_mhz"] == 1800 and reading.gpu_processes[0]["pid"] == 4242
    assert calls == ["--query-gpu", "--query-compute-apps"]

    def missing(argv):
        raise FileNotFoundError(argv[0])

    blind = MachineWatch(lambda path: (_ for _ in ()).throw(OSError(path)), missing)
    assert blind.reading().busy_jiffies is None and blind.reading().gpus == ()


def test_the_quiet_gate_looks_at_the_cpu_times_only():
    """Two looks a request (over SSH each read is a command): /proc/stat, not the load average
    nor nvidia-smi, which only the run's readings take."""
    read, ran = [], []

    def read_text(path):
        read.append(path)
        return {"/proc/stat": PROC_STAT, "/proc/loadavg": "2.5 1 1 1/1 1\n"}[path]

    def run(argv):
        ran.append(argv)
        return ""

    gate = QuietGate(MachineWatch(read_text, run, lambda: 1.0, clock=lambda: 5.0))
    assert gate.measure(lambda: "sent") == ("sent", {"others_cpu": None, "tries": 1, "quiet": True})
    assert read == ["/proc/stat", "/proc/stat"] and ran == []


def test_the_summary_warns_when_others_took_the_cpu_or_a_repeat_was_disturbed():
    quiet = [
        Reading(at=0.0, busy_jiffies=0, total_jiffies=0, cpus=2, load=(0.5, 1, 1), own_cpu_s=0.0),
        Reading(
            at=10.0, busy_jiffies=1000, total_jiffies=2000, cpus=2, load=(1.0, 1, 1), own_cpu_s=9.0
        ),
    ]
    calm = summary(quiet)
    assert calm["others_cpu"] == 0.05 and calm["warning"] is None
    busy = summary(
        quiet[:1] + [Reading(**{**quiet[1].__dict__, "busy_jiffies": 1900, "load": (4.2, 1, 1)})], 2
    )
    assert busy["others_cpu"] == 0.5
    assert busy["warning"] == (
        "the machine was busy: other processes used 50% of the CPU; load average up to 4.2 on "
        "2 CPUs; 2 repeats disturbed (speedup above tau), redone (figures are noisier)"
    )
    gpu = busy_warning({"gpu_processes": [{"pid": 1}, {"pid": 2}]})
    assert gpu == "the machine was busy: 2 processes on the GPU (figures are noisier)"
    assert summary([]) == {"warning": None}


def test_a_count_s_noun_agrees_with_it():
    assert [counted(n, "repeat") for n in (0, 1, 2)] == ["0 repeats", "1 repeat", "2 repeats"]

"""What the machine was doing while a bench ran: load, the CPU other processes took, the GPUs.

    watch = MachineWatch(read_text=local_read, run=local_run, own_cpu_s=time.process_time)
    before = watch.reading(); ...measure...; after = watch.reading()
    between(before, after)  # {"busy_cpu": 0.94, "others_cpu": 0.43, "own_cpu": 0.51, "load_1m": 3.2}
    summary([before, ..., after], disturbed=1)   # the run's figures and a warning when busy
    gate = QuietGate(watch); response, load = gate.measure(lambda: send_request())

`ddops bench` and `python -m engine bench` both record it (issue 31): a figure measured while
other processes took the cores is noisier, and the report says so. The CPU figures come from
/proc/stat (jiffies in USER_HZ, 100 on Linux) and /proc/loadavg, read where the engine runs;
"own" is the CPU time of the bench and the engine (`own_cpu_s`), "others" the rest of the busy
time, each a share of all cores over the interval (without `own_cpu_s`, only the busy share).
GPUs (where `nvidia-smi` answers): SM and memory clocks against the SM maximum, temperature,
utilization, and the processes on them (the engine is one). Reading never fails a bench: what
cannot be read is left out.

`QuietGate` measures each request in one of the machine's quiet moments: a request during which
other processes took the cores is sent again once they have let go. Contention only ever slows
a measurement, and a burst that lands on one method's request and not another's would decide a
speedup; the tau bound catches that only when the baseline is the one slowed. A machine that is
never quiet is measured as it is, and the warning says so.

`uneven_load` is the pairing's guard (issue 37): the gate gives up on a request after its tries,
and on every request while the machine stays busy (QUIET_PATIENCE), so when bursts of load come
and go faster than a quiet moment lasts, one method's request can be measured in a burst and
the next one's out of it: that repeat's ratio is the burst's, not the methods'. A repeat whose
requests saw other processes' CPU share differ by more than UNEVEN_SHARE is redone like one
whose speedup beats tau. Load that stays (busy throughout) slows every method alike and counts.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from engine.bench_stats import counted

T = TypeVar("T")

USER_HZ = 100  # the unit of /proc/stat's times on every Linux the engine runs on
BUSY_OTHERS_SHARE = 0.25  # other processes above a quarter of all cores: a busy machine
QUIET_SHARE = 0.10  # other processes above a tenth of all cores during a request disturbed it
QUIET_WINDOW_S = 0.2  # a stretch this long below QUIET_SHARE is a quiet moment
QUIET_WAIT_S = 3.0  # the longest wait for a quiet moment before sending again
QUIET_TRIES = 4  # a disturbed request is sent this many times at most
QUIET_PATIENCE = 3  # requests in a row measured busy: the machine is never quiet, stop waiting
UNEVEN_SHARE = 0.10  # a repeat's requests seeing others' share differ by more: not paired
GPU_QUERY = (
    "index",
    "clocks.sm",
    "clocks.max.sm",
    "clocks.mem",
    "temperature.gpu",
    "utilization.gpu",
)
GPU_APPS_QUERY = ("pid", "process_name", "used_memory")

ReadText = Callable[[str], str]  # a path on the engine's machine -> its text (raises when absent)
Run = Callable[[Sequence[str]], str]  # argv on the engine's machine -> stdout (raises on failure)


@dataclass(frozen=True)
class Reading:
    """One look at the machine."""

    at: float  # the watch's clock (time.monotonic)
    busy_jiffies: int | None = None
    total_jiffies: int | None = None
    cpus: int | None = None
    load: tuple[float, float, float] | None = None
    own_cpu_s: float | None = None
    gpus: tuple[dict, ...] = ()
    gpu_processes: tuple[dict, ...] | None = None


def parse_proc_stat(text: str) -> tuple[int, int, int]:
    """(busy, total, cpu count) from /proc/stat: busy = user nice system irq softirq steal,
    total = busy + idle + iowait (guest time is already inside user and nice)."""
    lines = text.splitlines()
    user, nice, system, idle, iowait, irq, softirq, steal = (
        int(v) for v in (lines[0].split()[1:] + ["0"] * 8)[:8]
    )
    busy = user + nice + system + irq + softirq + steal
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return busy, busy + idle + iowait, cpus


def parse_loadavg(text: str) -> tuple[float, float, float]:
    one, five, fifteen = (float(v) for v in text.split()[:3])
    return one, five, fifteen


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_gpus(csv_text: str) -> tuple[dict, ...]:
    """nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader,nounits -> one dict per GPU."""
    gpus = []
    for line in csv_text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(GPU_QUERY):
            continue
        index, sm, sm_max, mem, temperature, utilization = cells
        gpus.append(
            {
                "index": int(index),
                "sm_mhz": _number(sm),
                "sm_max_mhz": _number(sm_max),
                "mem_mhz": _number(mem),
                "temperature_c": _number(temperature),
                "utilization_pct": _number(utilization),
            }
        )
    return tuple(gpus)


def parse_gpu_processes(csv_text: str) -> tuple[dict, ...]:
    """nvidia-smi --query-compute-apps=GPU_APPS_QUERY --format=csv,noheader,nounits."""
    processes = []
    for line in csv_text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == len(GPU_APPS_QUERY) and cells[0].isdigit():
            used = _number(cells[2])
            processes.append({"pid": int(cells[0]), "name": cells[1], "used_mib": used})
    return tuple(processes)


def local_read(path: str) -> str:
    return Path(path).read_text()


def local_run(argv: Sequence[str]) -> str:
    """Run argv here (the first word found on PATH) and return its stdout; raises on failure."""
    if shutil.which(argv[0]) is None:
        raise FileNotFoundError(argv[0])
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=10, check=True)
    return done.stdout


@dataclass
class MachineWatch:
    """Takes Readings of the engine's machine; a reader left None is not asked."""

    read_text: ReadText | None = None
    run: Run | None = None
    own_cpu_s: Callable[[], float | None] = lambda: None
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep  # on `clock`: a scripted clock advances
    _gpu_missing: bool = field(default=False, repr=False)

    def reading(self, full: bool = True) -> Reading:
        """A look at the machine; `full=False` reads the CPU times only, not the load average
        nor nvidia-smi (the quiet gate's many looks: over SSH each read is a command)."""
        values: dict = {"at": self.clock(), "own_cpu_s": self.own_cpu_s()}
        if self.read_text is not None:
            with contextlib.suppress(OSError, ValueError, IndexError):
                busy, total, cpus = parse_proc_stat(self.read_text("/proc/stat"))
                values.update(busy_jiffies=busy, total_jiffies=total, cpus=cpus)
            if full:
                with contextlib.suppress(OSError, ValueError):
                    values["load"] = parse_loadavg(self.read_text("/proc/loadavg"))
        if full and self.run is not None and not self._gpu_missing:
            values.update(self._gpu_values())
        return Reading(**values)

    def _gpu_values(self) -> dict:
        try:
            gpus = self.run(["nvidia-smi", f"--query-gpu={','.join(GPU_QUERY)}", _CSV])
            apps = self.run(
                ["nvidia-smi", f"--query-compute-apps={','.join(GPU_APPS_QUERY)}", _CSV]
            )
        except Exception:  # no nvidia-smi, no driver, a dead transport: no GPU figures
            self._gpu_missing = True
            return {}
        return {"gpus": parse_gpus(gpus), "gpu_processes": parse_gpu_processes(apps)}


_CSV = "--format=csv,noheader,nounits"


def between(before: Reading, after: Reading) -> dict:
    """Others' and own share of all cores between two readings, and the load at the end."""
    figures: dict = {"seconds": after.at - before.at}
    if after.load is not None:
        figures["load_1m"] = after.load[0]
    if before.total_jiffies is None or after.total_jiffies is None:
        return figures
    total = after.total_jiffies - before.total_jiffies
    busy = after.busy_jiffies - before.busy_jiffies
    if total <= 0:
        return figures
    figures["busy_cpu"] = round(busy / total, 3)
    if before.own_cpu_s is not None and after.own_cpu_s is not None:
        own = (after.own_cpu_s - before.own_cpu_s) * USER_HZ
        figures["own_cpu"] = round(min(own, busy) / total, 3)
        figures["others_cpu"] = round(max(0.0, busy - own) / total, 3)
    return figures


def others_share(load: dict) -> float | None:
    """Other processes' share of all cores in a `between` interval: the busy share when the
    bench's and engine's own CPU is unknown."""
    others = load.get("others_cpu")
    return others if others is not None else load.get("busy_cpu")


@dataclass
class QuietGate:
    """Requests measured in the machine's quiet moments (see the module docstring).

    A request during which other processes took more than `share` of all cores was disturbed:
    it is sent again, `tries` times in all, the last one kept. After a disturbed request the
    next send first waits (at most `wait_s`) for a `window_s` stretch below `share`, so that a
    burst has passed; after a quiet one nothing waits. `measure(send, retry=False)` sends once:
    for a request whose repeat would measure something else (a turn that fills the prefix
    cache). After `patience` requests in a row measured busy the machine is taken to be never
    quiet: no more waiting or re-sending until a request measures quiet again. Without /proc (a
    remote URL) nothing is known and nothing waits: every request counts as quiet.
    """

    watch: MachineWatch
    share: float = QUIET_SHARE
    window_s: float = QUIET_WINDOW_S
    wait_s: float = QUIET_WAIT_S
    tries: int = QUIET_TRIES
    patience: int = QUIET_PATIENCE
    busy_in_a_row: int = 0
    busy_requests: int = 0  # requests kept although measured busy
    last_quiet: bool = True

    @property
    def never_quiet(self) -> bool:
        return self.busy_in_a_row >= self.patience

    def measure(self, send: Callable[[], T], retry: bool = True) -> tuple[T, dict]:
        """send()'s result and the machine during it: {"others_cpu", "tries", "quiet"}."""
        allowed, tries = (self.tries if retry else 1), 0
        while True:
            tries += 1
            if not self.last_quiet and not self.never_quiet:
                self._wait_for_quiet()
            before = self.watch.reading(full=False)
            result = send()
            others = others_share(between(before, self.watch.reading(full=False)))
            quiet = self.last_quiet = others is None or others <= self.share
            if quiet or self.never_quiet or tries == allowed:
                break
        self.busy_in_a_row = 0 if quiet else self.busy_in_a_row + 1
        self.busy_requests += not quiet
        return result, {"others_cpu": others, "tries": tries, "quiet": quiet}

    def _wait_for_quiet(self) -> None:
        deadline = self.watch.clock() + self.wait_s
        while True:
            before = self.watch.reading(full=False)
            self.watch.sleep(self.window_s)
            others = others_share(between(before, self.watch.reading(full=False)))
            if others is None or others <= self.share or self.watch.clock() >= deadline:
                return


def uneven_load(shares: Iterable[float | None], spread: float = UNEVEN_SHARE) -> bool:
    """Whether the requests of one repeat saw other processes' CPU share differ by more than
    `spread` (of all cores): the load fell on some and not the others. Unknown shares (no /proc)
    are never uneven."""
    known = [share for share in shares if share is not None]
    return bool(known) and max(known) - min(known) > spread


def _gpu_summary(readings: Sequence[Reading]) -> list[dict]:
    by_index: dict[int, list[dict]] = {}
    for reading in readings:
        for gpu in reading.gpus:
            by_index.setdefault(gpu["index"], []).append(gpu)
    summary = []
    for index, seen in sorted(by_index.items()):
        clocks = [g["sm_mhz"] for g in seen if g["sm_mhz"] is not None]
        temperatures = [g["temperature_c"] for g in seen if g["temperature_c"] is not None]
        summary.append(
            {
                "index": index,
                "sm_mhz_min": min(clocks, default=None),
                "sm_mhz_max": max(clocks, default=None),
                "sm_max_mhz": seen[-1]["sm_max_mhz"],
                "mem_mhz": seen[-1]["mem_mhz"],
                "temperature_c_max": max(temperatures, default=None),
            }
        )
    return summary


def summary(
    readings: Sequence[Reading], disturbed: int = 0, busy_requests: int = 0, uneven: int = 0
) -> dict:
    """The run's machine state from its readings (first to last) and, when the machine was
    busy or a measurement disturbed, a warning in words. `busy_requests`: requests kept although
    other processes took the cores during them (QuietGate); `uneven`: repeats redone because the
    load fell unevenly on their requests (uneven_load)."""
    if not readings:
        return {"warning": None}
    first, last = readings[0], readings[-1]
    document: dict = {
        "cpus": last.cpus,
        "load_start": first.load,
        "load_end": last.load,
        **between(first, last),
        "gpus": _gpu_summary(readings),
        "gpu_processes": list(last.gpu_processes) if last.gpu_processes is not None else None,
        "disturbed_repeats": disturbed,
        "busy_requests": busy_requests,
        **({"uneven_repeats": uneven} if uneven else {}),
    }
    document["warning"] = busy_warning(document)
    return document


def busy_warning(state: dict) -> str | None:
    """Why the run's figures are noisier than a quiet machine's, or None."""
    reasons = []
    others, cpus = state.get("others_cpu"), state.get("cpus")
    if others is not None and others > BUSY_OTHERS_SHARE:
        reasons.append(f"other processes used {others:.0%} of the CPU")
    loads = [load[0] for load in (state.get("load_start"), state.get("load_end")) if load]
    if cpus and loads and max(loads) > cpus:
        reasons.append(f"load average up to {max(loads):.1f} on {cpus} CPUs")
    processes = state.get("gpu_processes")
    if processes and len(processes) > 1:
        reasons.append(f"{len(processes)} processes on the GPU")
    if state.get("busy_requests"):
        reasons.append(
            f"{counted(state['busy_requests'], 'request')} measured while other processes took the cores "
            f"(each sent up to {QUIET_TRIES} times)"
        )
    if state.get("uneven_repeats"):
        reasons.append(
            f"{counted(state['uneven_repeats'], 'repeat')} redone: other processes' load fell "
            "unevenly on its requests"
        )
    if state.get("disturbed_repeats"):
        reasons.append(
            f"{counted(state['disturbed_repeats'], 'repeat')} disturbed (speedup above tau), redone"
        )
    if not reasons:
        return None
    return "the machine was busy: " + "; ".join(reasons) + " (figures are noisier)"

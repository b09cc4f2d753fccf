"""The chain's checks one at a time on a sim host (real LXC), and the runner on a scripted chain.

    python -m pytest -q tests/integration/test_checks.py

Each fault is injected through the sim (ops/sim/faults.py, `reboot_host`); each probe must name
it, and its remedy must make the same probe pass. No engine runs here: the engine-side checks
are covered end to end by tests/integration/test_provision.py and tests/integration/test_recover.py.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from datetime import datetime
from pathlib import Path

import pytest
from rich.console import Console

from ops.chain import checks, output
from ops.chain import report as report_module
from ops.chain import runner as recover
from ops.chain.checks import ChainContext, Check, Finding, Policy
from ops.chain.report import Outcome
from ops.host.transport import LocalTransport
from ops.results import find_stale_runs
from ops.sim import faults
from ops.sim.host import reboot_host
from ops.site.inventory import ContainerSpec, EngineSpec, ModelRef, ModelSpec
from tests.helpers.simhost import DEV_GPU_CONF, RAW_GPU_CONF, sim_host, start_ct

MODEL = ModelSpec(ModelRef("ddops/tiny-target", name="target"))
ENGINE = EngineSpec(dtype="float32", device="cpu", python="/usr/bin/python3")


def context(t, **changes) -> ChainContext:
    ct = changes.pop("ct", ContainerSpec(200, shm_gib=1, device_style="raw"))
    return ChainContext(t=t, ct=ct, model=MODEL, engine=ENGINE, **changes)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    yield from sim_host(tmp_path_factory.mktemp("checks"))


@pytest.fixture(scope="module")
def running_ct(host):
    start_ct(host, RAW_GPU_CONF.format(uvm=511))
    return host


def root(t: LocalTransport) -> Path:
    return Path(t.sysroot)


# -- host-level checks -------------------------------------------------------------------------
@pytest.mark.lxc
def test_modules_and_nodes_name_what_is_missing_and_their_remedies_fix_it(running_ct):
    c = context(running_ct)
    faults.unload_module(root(running_ct), "nvidia_uvm")
    assert checks.probe_modules(c) == Finding(
        False, f"{running_ct.label}: kernel module(s) nvidia_uvm not loaded"
    )
    assert checks.load_modules(c, True).detail == "would run `modprobe -a nvidia nvidia_uvm`"
    assert not checks.probe_modules(c).ok  # a dry run changes nothing
    checks.load_modules(c, False)
    assert checks.probe_modules(c).ok

    faults.remove_host_node(root(running_ct), "nvidia-uvm")
    assert checks.probe_nodes(c).evidence == f"{running_ct.label}: /dev/nvidia-uvm is missing"
    checks.create_nodes(c, False)
    assert checks.probe_nodes(c) == Finding(True, "4 nodes present, uvm major 511")


@pytest.mark.lxc
def test_stale_raw_rule_after_reboot_is_named_then_rewritten_and_cuda_works(running_ct):
    reboot_host(root(running_ct), uvm_major=509)
    running_ct.run(["nvidia-modprobe", "-u", "-c=0"]).check("nodes")
    c = context(running_ct)
    config_before = running_ct.read_text("/etc/pve/lxc/200.conf")

    finding = checks.probe_ct_config(c)
    assert not finding.ok
    assert finding.evidence.startswith(
        "CT 200: /dev/nvidia-uvm major 509 is not allowed by the CT config (allows 511)"
    )
    # The CT started onboot before the uvm node existed: its optional bind mount left a file.
    assert checks.probe_cuda(c) == Finding(
        False,
        "CT 200: /dev/nvidia-uvm: not a device node "
        "(placeholder left by an optional mount: host node absent)",
    )

    plan = checks.write_ct_config(c, True)
    assert plan.detail == (
        "would write /etc/pve/lxc/200.conf, removing stale grant(s) "
        "`lxc.cgroup2.devices.allow: c 511:* rwm`; restart the CT to apply it"
    )
    assert "-lxc.cgroup2.devices.allow: c 511:* rwm" in plan.diff
    assert "+lxc.cgroup2.devices.allow: c 509:* rwm" in plan.diff
    assert running_ct.read_text("/etc/pve/lxc/200.conf") == config_before

    done = checks.write_ct_config(c, False)
    assert done.detail.startswith("wrote /etc/pve/lxc/200.conf (backup /var/lib/ddops/backups/")
    assert done.detail.endswith("; restarted")
    assert running_ct.exists(done.detail.split("(backup ")[1].split(")")[0])
    assert checks.probe_ct_config(c).ok
    assert checks.probe_cuda(c) == Finding(
        True, "CT 200: cuInit ok, driver 550.90.07 on host and in the CT"
    )
    assert checks.write_ct_config(c, True).diff == ""  # nothing left to change


@pytest.mark.lxc
def test_lock_is_unfixable_unless_unlock_is_allowed(running_ct):
    running_ct.run(["pct", "stop", "200"]).check("stop")
    faults.lock_ct(root(running_ct), 200, "backup")
    refused = checks.probe_ct_running(context(running_ct))
    assert refused == Finding(
        False,
        "CT 200 is locked (backup): once the backup is over, rerun with --unlock "
        "(or `pct unlock 200`)",
        fixable=False,
    )
    c = context(running_ct, policy=Policy(mode="recover", unlock=True))
    assert checks.probe_ct_running(c) == Finding(False, "CT 200 is stopped and locked (backup)")
    assert checks.start_ct(c, False).detail == "ran pct unlock 200 (backup), pct start 200"
    assert checks.probe_ct_running(c).ok


@pytest.mark.lxc
def test_driver_mismatch_names_both_versions_and_is_not_fixable(running_ct):
    faults.set_ct_driver_version(root(running_ct), 200, "550.54.14")
    try:
        assert checks.probe_cuda(context(running_ct)) == Finding(
            False,
            "CT 200: driver userspace 550.54.14 does not match the host kernel module "
            "550.90.07: install the 550.90.07 userspace in the CT (NVIDIA-Linux-x86_64-550.90.07"
            ".run --no-kernel-module); LXC's NVIDIA mount hook, which would mount the host's own, "
            "runs in unprivileged CTs only and CT 200 is privileged",
            fixable=False,
        )
    finally:
        faults.set_ct_driver_version(root(running_ct), 200, "550.90.07")


@pytest.mark.lxc
def test_gpu_block_style_follows_the_pve_version(host):
    c = context(host, ct=ContainerSpec(200, shm_gib=2))
    assert checks.desired_gpu_block(c).style == "devN"  # PVE 8.2
    (root(host) / "usr/sbin/pveversion").unlink()
    fake = root(host) / "usr/local/sbin/pveversion"
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_text("#!/bin/sh\necho 'pve-manager/7.4-3/9002ab8a (running kernel: 5.15.0)'\n")
    fake.chmod(0o755)
    block = checks.desired_gpu_block(c)
    assert block.style == "raw" and block.shm_size_gib == 2
    assert [d.path for d in block.devices] == checks.required_nodes(c.ct)


# -- stale bench runs --------------------------------------------------------------------------
def dead_pid() -> int:
    """A pid that existed and is gone: a child that has exited and been reaped."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_stale_bench_run_is_marked_crashed_and_its_partial_files_moved_aside(tmp_path):
    run = tmp_path / "run-1"
    run.mkdir()
    manifest = {"state": "running", "pid": dead_pid(), "host": socket.gethostname()}
    (run / "manifest.json").write_text(json.dumps(manifest))
    (run / "cell-ar-256.json").write_text('{"tok_s": 26.4}')
    (run / "cell-ddtree-256.json.tmp").write_text('{"tok_')
    live = tmp_path / "run-2"
    live.mkdir()
    (live / "manifest.json").write_text(json.dumps({**manifest, "pid": os.getpid()}))
    c = context(LocalTransport(), results_dir=tmp_path)

    assert checks.probe_bench(c) == Finding(
        False, f"{tmp_path}: run(s) run-1 say running but their process is gone"
    )
    outcome = checks.quarantine_runs(c, False)
    aside = next(run.glob("crashed-*"))
    assert outcome.detail == f"marked crashed, partial files moved to {aside}"
    assert json.loads((run / "manifest.json").read_text())["state"] == "crashed"
    assert (run / "cell-ar-256.json").exists()  # a finished cell stays for a resume
    assert (aside / "cell-ddtree-256.json.tmp").read_text() == '{"tok_'  # never deleted
    assert checks.probe_bench(c).ok
    assert find_stale_runs(tmp_path) == []


# -- the runner, on a scripted chain -----------------------------------------------------------
class Scripted:
    """A check whose probe fails until its remedy ran (or forever, when `fixes` is False)."""

    def __init__(self, key: str, ok: bool = True, fixes: bool = True, fixable: bool = True):
        self.key, self.ok, self.fixes, self.fixable = key, ok, fixes, fixable
        self.remedied = 0

    def probe(self, c) -> Finding:
        return Finding(self.ok, f"{self.key} {'fine' if self.ok else 'broken'}", self.fixable)

    def remedy(self, c, dry_run: bool) -> Outcome:
        if not dry_run:
            self.remedied += 1
            self.ok = self.fixes
        return Outcome(True, f"{'would fix' if dry_run else 'fixed'} {self.key}", "diff")

    def check(self, needs: tuple[str, ...] = ()) -> Check:
        return Check(self.key, self.key, self.probe, self.remedy, needs)


def run_scripted(monkeypatch, scripted: list[tuple[Scripted, tuple]], **kwargs):
    monkeypatch.setattr(recover, "chain_for", lambda policy: [s.check(n) for s, n in scripted])
    report = recover.run_chain(context(LocalTransport()), **kwargs)
    return [(r.key, r.status, r.evidence, r.action) for r in report.results], report


def test_health_probes_everything_and_skips_what_needs_a_failed_check(monkeypatch):
    a, b, c, d = Scripted("a"), Scripted("b", ok=False), Scripted("c"), Scripted("d")
    rows, report = run_scripted(
        monkeypatch, [(a, ()), (b, ("a",)), (c, ("b",)), (d, ("a",))], mode="health"
    )
    assert rows == [
        ("a", "ok", "a fine", ""),
        ("b", "failed", "b broken", ""),
        ("c", "skipped", "needs b", ""),
        ("d", "ok", "d fine", ""),
    ]
    assert not report.ok and b.remedied == 0


def test_recover_fixes_in_order_and_stops_at_the_first_unfixable(monkeypatch):
    a, b, c, d = (
        Scripted("a", ok=False),
        Scripted("b", ok=False, fixable=False),
        Scripted("c"),
        Scripted("d"),
    )
    rows, report = run_scripted(monkeypatch, [(a, ()), (b, ()), (c, ()), (d, ())], mode="recover")
    assert rows == [
        ("a", "changed", "a broken", "fixed a"),
        ("b", "failed", "b broken", ""),
        ("c", "skipped", "an earlier check failed", ""),
        ("d", "skipped", "an earlier check failed", ""),
    ]
    assert (a.remedied, b.remedied) == (1, 0) and not report.ok


def test_a_remedy_that_does_not_fix_fails_after_the_reprobe(monkeypatch):
    a = Scripted("a", ok=False, fixes=False)
    rows, _ = run_scripted(monkeypatch, [(a, ())], mode="recover")
    assert rows == [("a", "failed", "a broken", "fixed a; still failing: a broken")]


def test_dry_run_plans_and_skips_what_depends_on_the_plan(monkeypatch):
    a, b, c = Scripted("a", ok=False), Scripted("b"), Scripted("c")
    rows, report = run_scripted(
        monkeypatch, [(a, ()), (b, ("a",)), (c, ())], mode="recover", dry_run=True
    )
    assert rows == [
        ("a", "would change", "a broken", "would fix a"),
        ("b", "skipped", "needs a", ""),
        ("c", "unchanged", "c fine", ""),
    ]
    assert a.remedied == 0 and report.results[0].diff == "diff"


def test_creating_a_ct_is_left_to_provision(monkeypatch):
    missing = Scripted("ct-exists", ok=False)
    check = Check("ct-exists", "CT exists", missing.probe, missing.remedy, provision_only="remedy")
    monkeypatch.setattr(recover, "chain_for", lambda policy: [check])
    report = recover.run_chain(context(LocalTransport()), mode="recover")
    assert report.results[0].evidence == ("ct-exists broken: `ddops provision --ct 200` creates it")
    assert missing.remedied == 0


def test_the_host_lock_makes_a_second_holder_wait(tmp_path):
    t = LocalTransport(sysroot=str(tmp_path))
    first_in, second_in, release = threading.Event(), threading.Event(), threading.Event()

    def hold(entered: threading.Event) -> None:
        with recover.host_lock(t):
            entered.set()
            release.wait(10)

    first = threading.Thread(target=hold, args=(first_in,))
    first.start()
    assert first_in.wait(10)
    second = threading.Thread(target=hold, args=(second_in,))
    second.start()
    assert not second_in.wait(0.5)  # blocked while the first holds the lock
    release.set()
    assert second_in.wait(10)
    first.join()
    second.join()
    assert (tmp_path / "run/lock/ddops/recover.lock").exists()


def test_the_hookscript_makes_a_start_with_missing_uvm_nodes_succeed(tmp_path):
    """Attached by provision, its pre-start recreates the nodes a devN entry needs at start."""
    for t in sim_host(tmp_path):
        start_ct(t, DEV_GPU_CONF)
        c = context(t, ct=ContainerSpec(200, shm_gib=1, device_style="devN"))
        assert not checks.probe_hookscript(c).ok
        done = checks.install_hookscript(c, dry_run=False)
        assert done.detail == (
            "write /var/lib/vz/snippets/ddops-hook.sh, "
            "pct set 200 --hookscript local:snippets/ddops-hook.sh"
        )
        assert checks.probe_hookscript(c).ok and not checks.install_hookscript(c, False).changed
        t.run(["pct", "stop", "200"]).check("stop")
        faults.remove_host_node(root(t), "nvidia-uvm")
        t.run(["pct", "start", "200"]).check("start")  # without the hook: devN node missing
        assert t.exists("/dev/nvidia-uvm")


def test_a_users_own_hookscript_is_left_as_it_is(tmp_path):
    for t in sim_host(tmp_path):
        t.write_file("/var/lib/vz/snippets/mine.sh", "#!/bin/sh\nexit 0\n", mode=0o755)
        start_ct(t, DEV_GPU_CONF + "hookscript: local:snippets/mine.sh\n")
        finding = checks.probe_hookscript(context(t))
        assert finding.ok and finding.evidence.endswith("local:snippets/mine.sh: ddops leaves it")
        assert "hookscript: local:snippets/mine.sh\n" in t.read_text("/etc/pve/lxc/200.conf")


def test_in_a_pipe_each_check_is_one_plain_line_and_each_ct_one_verdict(monkeypatch):
    a, b = Scripted("a", ok=False), Scripted("b")
    console = Console(record=True, width=100, force_terminal=False)
    out = output.chain_output(console)
    assert isinstance(out, output.PlainChainOutput)
    c = context(LocalTransport())
    out.start(c, "recover")
    monkeypatch.setattr(recover, "chain_for", lambda policy: [a.check(()), b.check(("a",))])
    report = recover.run_chain(c, mode="recover", on_result=out.result)
    out.finish([report])
    lines = console.export_text().splitlines()
    assert lines[0] == "recover CT 200 on local"
    assert lines[1].split() == ["changed", "a", *lines[1].split()[2:]]
    assert lines[1].endswith("a broken -> fixed a")
    assert lines[2].split()[:2] == ["unchanged", "b"]
    assert lines[3:] == ["diff", f"recover: CT 200 on local: healthy ({report.seconds:.1f}s)"]
    assert not any(ch in "".join(lines) for ch in "│┃━─┏")  # no box drawing in a log


def test_a_recover_leaves_its_record_and_health_describes_it(monkeypatch, tmp_path):
    from ops.chain import last_recover

    t = LocalTransport(sysroot=str(tmp_path))
    a, b = Scripted("a", ok=False), Scripted("b")
    monkeypatch.setattr(recover, "chain_for", lambda policy: [a.check(()), b.check(())])
    report = recover.run_chain(context(t), mode="recover")
    written = last_recover.record(t, report, trigger="boot")
    assert last_recover.read(t, 200) == written
    assert written["repaired"] == [
        {"key": "a", "title": "a", "found": "a broken", "done": "fixed a"}
    ]
    assert (written["trigger"], written["ok"], written["failed"]) == ("boot", True, None)
    when = datetime.fromisoformat(written["when"]).timestamp()
    assert last_recover.describe(written, now=when + 190) == (
        f"last recover at boot 3 min ago: repaired a ({written['seconds']:g} s)"
    )
    assert last_recover.read(t, 201) is None


def test_reports_render_as_a_table_and_one_json_document(monkeypatch):
    a, b = Scripted("a", ok=False), Scripted("b")
    _, report = run_scripted(monkeypatch, [(a, ()), (b, ("a",))], mode="recover", dry_run=True)
    console = Console(record=True, width=120)
    output.render_reports([report], console)
    text = console.export_text()
    assert text.startswith("recover: CT 200 on local: changes planned (")
    assert "│ a     │ would change │" in text and "a broken" in text and "-> would fix a" in text
    assert "│ b     │ skipped      │" in text and "needs a" in text
    assert text.rstrip().endswith("diff")  # the planned diff follows the table
    document = report_module.reports_json([report])
    assert document["ok"] is False
    assert document["cts"][0]["checks"][0] == {
        "key": "a",
        "title": "a",
        "status": "would change",
        "seconds": document["cts"][0]["checks"][0]["seconds"],
        "evidence": "a broken",
        "action": "would fix a",
        "diff": "diff",
    }

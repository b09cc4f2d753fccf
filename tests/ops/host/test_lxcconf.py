"""ops/host/lxcconf.py on real-world-shaped CT configs (tests/data/lxc/): round trip, edits, validation.

python -m pytest -q tests/ops/host/test_lxcconf.py
"""

from __future__ import annotations

from collections import Counter

import pytest

from ops.diffs import unified_diff
from ops.errors import DdopsError
from ops.host.lxcconf import (
    ConfigError,
    GpuBlock,
    GpuDevice,
    Problem,
    find_problems,
    find_stale_rules,
    parse,
    plan_gpu_block,
    validate,
)
from tests.helpers import DATA as HELPERS_DATA

DATA = HELPERS_DATA / "lxc"
SAMPLES = sorted(p.name for p in DATA.glob("*.conf"))
EDITABLE = [name for name in SAMPLES if name != "problems.conf"]

# /proc/devices after the driver update: the uvm major moved from 511 to 509.
HOST_MAJORS = {
    "mem": 1,
    "misc": 10,
    "nvidia-frontend": 195,
    "drm": 226,
    "nvidia-caps": 237,
    "nvidia-uvm": 509,
}
GPU_NODES = (
    GpuDevice("/dev/nvidia0", 195, 0, gid=44),
    GpuDevice("/dev/nvidiactl", 195, 255, gid=44),
    GpuDevice("/dev/nvidia-uvm", 509, 0, gid=44),
    GpuDevice("/dev/nvidia-uvm-tools", 509, 1, gid=44),
)


def read(name: str) -> str:
    return (DATA / name).read_bytes().decode()


def marked_incident() -> str:
    """The incident config as ddops would have written it before the uvm major moved: its
    rules marked as its own (the mark below the description, where Proxmox keeps it)."""
    lines = read("incident-raw.conf").splitlines(keepends=True)
    return "".join(lines[:2] + [MARK_511] + lines[2:])


def block(style: str = "devN", shm: int | None = 32) -> GpuBlock:
    return GpuBlock(GPU_NODES, style=style, shm_size_gib=shm)


# An oracle independent of ops/host/lxcconf.py: every line of the samples that concerns the GPU block.
GPU_MARKERS = ("/dev/nvidia", "dev/shm", "c 195:", "c 509:", "c 511:", "#ddops owns")
MARK_511 = "#ddops owns devices.allow majors 195 511\n"


def _is_gpu_line(text: str) -> bool:
    return any(marker in text for marker in GPU_MARKERS)


def line_changes(old: str, new: str) -> tuple[Counter, Counter]:
    """(removed, added) lines as multisets."""
    before, after = Counter(old.splitlines()), Counter(new.splitlines())
    return before - after, after - before


# -- parsing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SAMPLES)
def test_unchanged_input_round_trips_byte_for_byte(name):
    raw = (DATA / name).read_bytes()
    assert parse(raw.decode()).text().encode() == raw


def test_samples_cover_crlf_trailing_spaces_and_missing_final_newline():
    assert "\r\n" in read("crlf-fresh.conf") and "  \r\n" in read("crlf-fresh.conf")
    assert not read("devn-pve8.conf").endswith("\n")
    assert not read("legacy-v1.conf").endswith("\n")


def test_sections_are_split_where_proxmox_splits_them():
    config = parse(read("incident-raw.conf"))
    assert [s.name for s in config.sections] == [None, "pve:pending", "before-driver-570"]
    assert config.main.lines[0].text == "#Qwen3.6-27B with DDTree, 1x RTX PRO 6000"
    assert [e.key for e in config.section("pve:pending").entries()] == ["memory"]
    snapshot = config.section("before-driver-570")
    assert snapshot.header.number == 30
    assert (
        snapshot.entries()[-1].value
        == "/dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file"
    )


def test_lxc_keys_parse_with_either_separator_and_empty_values():
    config = parse("lxc.cap.drop:\nlxc.apparmor.profile = unconfined\n")
    assert [(e.key, e.value) for e in config.main.entries()] == [
        ("lxc.cap.drop", ""),
        ("lxc.apparmor.profile", "unconfined"),
    ]


# -- editing the GPU block -----------------------------------------------------------------------


@pytest.mark.parametrize("style", ["devN", "raw"])
@pytest.mark.parametrize("name", EDITABLE)
def test_an_edit_changes_only_owned_lines_and_never_the_sections(name, style):
    old = read(name)
    new = plan_gpu_block(old, block(style), HOST_MAJORS)
    removed, added = line_changes(old, new)
    owned_before = {line.text for line in parse(old).main.lines if _is_gpu_line(line.text)}
    assert set(removed) <= owned_before
    assert all(_is_gpu_line(text) for text in added)
    header = old.index("\n[") if "\n[" in old else len(old)
    assert new.endswith(old[header:])  # the sections below the main one, byte for byte
    untouched = [t for t in old.splitlines() if not _is_gpu_line(t)]
    assert [t for t in new.splitlines() if not _is_gpu_line(t)] == untouched


@pytest.mark.parametrize("style", ["devN", "raw"])
@pytest.mark.parametrize("name", EDITABLE)
def test_reapplying_the_same_block_is_a_no_op(name, style):
    once = plan_gpu_block(read(name), block(style), HOST_MAJORS)
    assert plan_gpu_block(once, block(style), HOST_MAJORS) == once


def test_incident_stale_uvm_rule_is_replaced_where_it_stood():
    old = marked_incident()
    new = plan_gpu_block(old, block("raw"), HOST_MAJORS)
    assert unified_diff(old, new, "/etc/pve/lxc/200.conf") == (
        "--- /etc/pve/lxc/200.conf\n"
        "+++ /etc/pve/lxc/200.conf (planned)\n"
        "@@ -1,6 +1,6 @@\n"
        " #Qwen3.6-27B with DDTree, 1x RTX PRO 6000\n"
        " #GPU passthrough set up by hand from a forum post (raw lines)\n"
        "-#ddops owns devices.allow majors 195 511\n"
        "+#ddops owns devices.allow majors 195 509\n"
        " arch: amd64\n"
        " cores: 16\n"
        " features: nesting=1\n"
        "@@ -16,7 +16,7 @@\n"
        " swap: 0\n"
        " unprivileged: 0\n"
        " lxc.cgroup2.devices.allow: c 195:* rwm\n"
        "-lxc.cgroup2.devices.allow: c 511:* rwm\n"
        "+lxc.cgroup2.devices.allow: c 509:* rwm\n"
        " lxc.cgroup2.devices.allow: c 10:200 rwm\n"
        " lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\n"
        " lxc.mount.entry: /dev/nvidiactl dev/nvidiactl none bind,optional,create=file\n"
    )


def test_an_unmarked_rule_for_a_major_no_driver_holds_is_the_users_and_stays():
    """Set up by hand from a forum post: `c 511:* rwm` is not ddops' (no mark), so it stays
    byte for byte; ddops adds its own rule for the current uvm major and marks that."""
    old = read("incident-raw.conf")
    new = plan_gpu_block(old, block("raw"), HOST_MAJORS)
    removed, added = line_changes(old, new)
    assert removed == Counter()
    assert set(added) == {
        "#ddops owns devices.allow majors 195 509",
        "lxc.cgroup2.devices.allow: c 509:* rwm",
    }
    assert new.splitlines()[2] == "#ddops owns devices.allow majors 195 509"
    assert not find_stale_rules(new, HOST_MAJORS).stale
    assert plan_gpu_block(new, block("raw"), HOST_MAJORS) == new


def test_a_users_rule_for_a_dynamic_major_survives_recover_byte_for_byte():
    """The finding: `c 240:* rwm` (not NVIDIA, nothing on 240 now) was taken for a stale
    ddops rule and deleted. Only NVIDIA majors now, or majors ddops marked, are ddops'."""
    user_rule = "lxc.cgroup2.devices.allow:   c 240:* rwm  \n"  # spacing as the user wrote it
    old = f"arch: amd64\nhostname: llm\n{user_rule}"
    new = plan_gpu_block(old, block("raw"), HOST_MAJORS)
    assert user_rule in new
    assert find_stale_rules(new, HOST_MAJORS).ok
    # also when ddops' own mark is there (from an earlier run) but does not name 240
    again = plan_gpu_block(new, block("raw", shm=16), HOST_MAJORS)
    assert again != new and user_rule in again


def test_a_marked_rule_whose_major_moved_is_replaced_and_the_mark_follows():
    before_move = GpuBlock(
        tuple(GpuDevice(d.path, 511 if d.major == 509 else d.major, d.minor) for d in GPU_NODES),
        style="raw",
    )
    first = plan_gpu_block("arch: amd64\n", before_move, {**HOST_MAJORS, "nvidia-uvm": 511})
    assert first.startswith("#ddops owns devices.allow majors 195 511\n")
    moved = plan_gpu_block(first, block("raw"), HOST_MAJORS)
    assert "c 511:" not in moved and "c 509:* rwm" in moved
    assert moved.startswith("#ddops owns devices.allow majors 195 509\n")


def test_switching_to_devn_removes_the_rules_and_their_mark():
    raw = plan_gpu_block("arch: amd64\n", block("raw"), HOST_MAJORS)
    devn = plan_gpu_block(raw, block("devN"), HOST_MAJORS)
    assert "#ddops" not in devn and "devices.allow" not in devn


def test_a_correct_block_without_a_mark_is_left_as_it_is():
    """Adding only the mark would restart a healthy CT for nothing."""
    raw = plan_gpu_block("arch: amd64\n", block("raw"), HOST_MAJORS)
    unmarked = "".join(raw.splitlines(keepends=True)[1:])
    assert plan_gpu_block(unmarked, block("raw"), HOST_MAJORS) == unmarked


def test_without_the_host_majors_a_stale_rule_is_not_recognised_and_stays():
    new = plan_gpu_block(read("incident-raw.conf"), block("raw"))
    assert "lxc.cgroup2.devices.allow: c 511:* rwm\n" in new
    assert "lxc.cgroup2.devices.allow: c 509:* rwm\n" in new


def test_switching_raw_to_devn_puts_entries_at_their_sorted_place():
    new = plan_gpu_block(read("incident-raw.conf"), block("devN"), HOST_MAJORS)
    main = new.split("\n\n[", 1)[0].splitlines()
    assert main[2:9] == [
        "arch: amd64",
        "cores: 16",
        "dev0: /dev/nvidia0,gid=44",
        "dev1: /dev/nvidiactl,gid=44",
        "dev2: /dev/nvidia-uvm,gid=44",
        "dev3: /dev/nvidia-uvm-tools,gid=44",
        "features: nesting=1",
    ]
    assert main[-3:] == [
        "lxc.cgroup2.devices.allow: c 10:200 rwm",
        "lxc.mount.entry: /dev/net dev/net none bind,create=dir",
        "lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,size=32g,create=dir 0 0",
    ]


def test_devn_indices_stay_and_new_ones_skip_foreign_and_pending_indices():
    old = read("devn-pve8.conf")
    new = plan_gpu_block(old, block("devN", shm=16), HOST_MAJORS)
    removed, added = line_changes(old, new)
    assert not removed  # dev0, dev1, dev3 keep their index; dev2 is the DRI node
    assert set(added) == {
        "dev5: /dev/nvidia-uvm-tools,gid=44",  # dev4 is pending in [pve:pending]
        "lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,size=16g,create=dir 0 0",
    }
    assert new.index("dev5:") > new.index("dev3:") and new.index("dev5:") < new.index("features:")
    assert not new.endswith("\n")


def test_a_changed_device_property_is_rewritten_in_place():
    old = read("devn-pve8.conf")
    no_gid = GpuBlock(tuple(GpuDevice(d.path, d.major, d.minor) for d in GPU_NODES[:3]))
    new = plan_gpu_block(old, no_gid, HOST_MAJORS)
    lines = new.splitlines()
    assert lines[3:7] == [
        "dev0: /dev/nvidia0",
        "dev1: /dev/nvidiactl",
        "dev2: /dev/dri/renderD128,gid=104",
        "dev3: /dev/nvidia-uvm",
    ]


def test_v1_gpu_rules_become_cgroup2_rules_and_other_v1_rules_stay():
    old = read("legacy-v1.conf")
    new = plan_gpu_block(old, GpuBlock(GPU_NODES[::2], style="raw"), HOST_MAJORS)
    assert (
        new.splitlines()[1] == "#ddops owns devices.allow majors 195 509"
    )  # below the description
    assert new.splitlines()[10:15] == [
        "lxc.cgroup2.devices.allow: c 195:* rwm",
        "lxc.cgroup2.devices.allow: c 509:* rwm",
        "lxc.cgroup.devices.allow: c 226:* rwm",
        "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file",
        "lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file",
    ]


def test_new_lines_go_above_the_first_section_header_and_keep_crlf():
    old = read("crlf-fresh.conf")
    new = plan_gpu_block(old, block("devN", shm=8), HOST_MAJORS)
    assert "\n" not in new.replace("\r\n", "")
    main, sections = new.split("\r\n\r\n[clean]", 1)
    assert main.endswith(
        "swap: 0\r\nlxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,size=8g,create=dir 0 0"
    )
    assert "cores: 4\r\ndev0: /dev/nvidia0,gid=44\r\n" in main
    assert "#Fresh CT, written on Windows  \r\n" in main and "memory: 16384  \r\n" in main
    assert old.endswith(sections)


def test_a_block_at_the_end_of_a_file_without_final_newline_keeps_it_open():
    old = "arch: amd64\nhostname: x"
    new = plan_gpu_block(old, GpuBlock((), shm_size_gib=4))
    assert (
        new
        == "arch: amd64\nhostname: x\nlxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,size=4g,create=dir 0 0"
    )
    assert plan_gpu_block(new, GpuBlock(())) == "arch: amd64\nhostname: x"


def test_an_empty_block_removes_every_owned_line():
    new = plan_gpu_block(read("incident-raw.conf"), GpuBlock(()), HOST_MAJORS)
    main = new.split("\n\n[", 1)[0]
    assert "nvidia" not in main and "dev/shm" not in main
    assert "lxc.cgroup2.devices.allow: c 10:200 rwm" in main


def test_no_free_devn_index_is_a_named_error():
    taken = "".join(f"dev{i}: /dev/dri/card{i}\n" for i in range(256))
    with pytest.raises(DdopsError, match="no free devN index"):
        plan_gpu_block(taken, block("devN"))


@pytest.mark.parametrize(
    ("device", "cause"),
    [
        (dict(path="/dev/dri/card0", major=226, minor=0), "must be /dev/nvidia"),
        (dict(path="/dev/nvidia0", major=195, minor=-1), "no such device number"),
        (dict(path="/dev/nvidia0", major=195, minor=0, gid=-5), "gid must be >= 0"),
    ],
)
def test_gpu_devices_are_validated(device, cause):
    with pytest.raises(DdopsError, match=cause):
        GpuDevice(**device)


def test_gpu_blocks_are_validated():
    with pytest.raises(DdopsError, match="style must be one of devN, raw"):
        GpuBlock(GPU_NODES, style="cgroup")
    with pytest.raises(DdopsError, match="listed twice"):
        GpuBlock(GPU_NODES[:1] * 2)
    with pytest.raises(DdopsError, match="shm_size_gib must be >= 1"):
        GpuBlock(GPU_NODES, shm_size_gib=0)


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("problem", "line"),
    [
        (Problem.DUPLICATE_DEV_INDEX, 4),
        (Problem.DEV_INDEX_OUT_OF_RANGE, 5),
        (Problem.DUPLICATE_KEY, 8),
        (Problem.MALFORMED_LINE, 9),
        (Problem.CGROUP_V1_KEY, 10),
        (Problem.KEY_BELOW_SECTION, 17),
    ],
)
def test_each_problem_is_named_with_its_line(problem, line):
    found = {(p.problem, p.line) for p in find_problems(read("problems.conf"))}
    assert (problem, line) in found


def test_problems_are_exactly_the_planted_ones():
    assert len(find_problems(read("problems.conf"))) == 6


def test_validate_raises_config_error_naming_the_first_problem_and_listing_all():
    with pytest.raises(ConfigError) as caught:
        validate(read("problems.conf"), "/etc/pve/lxc/204.conf")
    error = caught.value
    assert str(error) == (
        "/etc/pve/lxc/204.conf: line 4: duplicate devN index 0: dev0 is already set at line 3 "
        "[duplicate-dev-index] (and 5 more)"
    )
    assert len(error.detail.splitlines()) == len(error.problems) == 6
    assert isinstance(error, DdopsError)


@pytest.mark.parametrize("name", ["incident-raw.conf", "devn-pve8.conf", "crlf-fresh.conf"])
def test_clean_real_world_configs_validate(name):
    assert validate(read(name)).text() == read(name)


def test_validate_names_the_v1_spelling_in_a_legacy_config():
    problems = find_problems(read("legacy-v1.conf"))
    assert [(p.problem, p.line) for p in problems] == [
        (Problem.CGROUP_V1_KEY, n) for n in (10, 11, 12)
    ]
    assert "use lxc.cgroup2.devices.allow" in problems[0].message


def test_snapshot_sections_as_proxmox_writes_them_are_in_order():
    snapshot_only = read("incident-raw.conf").split("\n\n", 1)[1]
    assert not [
        p
        for p in find_problems("arch: amd64\n\n" + snapshot_only)
        if p.problem is Problem.KEY_BELOW_SECTION
    ]


# -- stale rules ---------------------------------------------------------------------------------


def test_the_incident_stale_uvm_rule_is_reported_as_evidence():
    report = find_stale_rules(marked_incident(), HOST_MAJORS)
    assert not report.ok
    assert report.evidence() == [
        "/dev/nvidia-uvm major 509 is not allowed by the CT config (allows 511)",
        "line 19: `lxc.cgroup2.devices.allow: c 511:* rwm` is a stale grant (major 511 was "
        "NVIDIA's, no NVIDIA driver holds it now)",
    ]


def test_after_the_edit_the_config_grants_the_current_majors():
    fixed = plan_gpu_block(read("incident-raw.conf"), block("raw"), HOST_MAJORS)
    assert find_stale_rules(fixed, HOST_MAJORS).ok


def test_devn_entries_grant_whatever_major_the_node_has():
    moved = {**HOST_MAJORS, "nvidia-uvm": 234}
    assert find_stale_rules(read("devn-pve8.conf"), moved).ok


def test_v1_rules_grant_nothing_on_pve7():
    report = find_stale_rules(read("legacy-v1.conf"), HOST_MAJORS)
    assert [(u.node, u.major) for u in report.ungranted] == [
        ("/dev/nvidia*", 195),
        ("/dev/nvidia-uvm", 509),
    ]
    assert [r.number for r in report.v1_rules] == [10, 11]


def test_another_drivers_dynamic_major_is_not_taken_for_stale():
    config = "arch: amd64\nlxc.cgroup2.devices.allow: c 195:* rwm\nlxc.cgroup2.devices.allow: c 240:* rwm\n"
    with_hidraw = {**HOST_MAJORS, "hidraw": 240}
    assert find_stale_rules(config, with_hidraw).stale == ()
    assert (
        plan_gpu_block(config, GpuBlock(GPU_NODES[:1], style="raw"), with_hidraw).count("c 240:*")
        == 1
    )
    assert find_stale_rules(config, HOST_MAJORS).stale == ()  # not marked: the user's
    marked = "#ddops owns devices.allow majors 195 240\n" + config
    assert [r.number for r in find_stale_rules(marked, HOST_MAJORS).stale] == [4]


# -- the dry-run diff ----------------------------------------------------------------------------


def test_unified_diff_is_empty_without_change_and_marks_a_missing_final_newline():
    assert unified_diff("a: 1\n", "a: 1\n", "/x.conf") == ""
    assert unified_diff("a: 1", "a: 2", "/x.conf") == (
        "--- /x.conf\n+++ /x.conf (planned)\n@@ -1 +1 @@\n-a: 1\n\\ No newline at end of file\n"
        "+a: 2\n\\ No newline at end of file\n"
    )


# -- stale grants: rules for a major that was NVIDIA's (the host's history) ------------------------


def test_a_hand_added_rule_for_a_major_nvidia_held_before_is_stale_and_removed():
    """The issue: `c 511:* rwm` added by hand while 511 was the uvm major, never marked by ddops.
    With the host's history naming 511, it is stale once uvm moved: removed, reported."""
    user_rule = "lxc.cgroup2.devices.allow:   c 240:* rwm  \n"
    old = f"arch: amd64\nhostname: llm\nlxc.cgroup2.devices.allow: c 511:* rwm\n{user_rule}"
    history = {195, 511}
    new = plan_gpu_block(old, block("devN"), HOST_MAJORS, history)
    assert "c 511:" not in new
    assert user_rule in new  # never NVIDIA's: byte for byte
    report = find_stale_rules(old, HOST_MAJORS, history)
    assert [line.text for line in report.stale] == ["lxc.cgroup2.devices.allow: c 511:* rwm"]
    assert find_stale_rules(new, HOST_MAJORS, history).ok


def test_a_v1_spelt_rule_for_an_old_nvidia_major_is_stale_too():
    old = "arch: amd64\nlxc.cgroup.devices.allow: c 507:* rwm\n"
    assert [s.number for s in find_stale_rules(old, HOST_MAJORS, {507}).stale] == [2]
    assert "507" not in plan_gpu_block(old, block("devN"), HOST_MAJORS, {507})


def test_a_major_that_was_nvidias_and_is_again_is_not_stale():
    old = "arch: amd64\nlxc.cgroup2.devices.allow: c 509:* rwm\n"
    assert not find_stale_rules(old, HOST_MAJORS, {509, 511}).stale


def test_a_major_now_held_by_another_driver_but_nvidias_before_is_stale():
    """237 is nvidia-caps today; had 226 (drm now) been NVIDIA's once, its rule grants the GPU's
    neighbour: stale, whatever holds it now."""
    old = "arch: amd64\nlxc.cgroup2.devices.allow: c 226:* rwm\n"
    assert find_stale_rules(old, HOST_MAJORS).stale == ()
    assert [s.number for s in find_stale_rules(old, HOST_MAJORS, {226}).stale] == [2]

"""templates/ rendered by ops/render.py: golden text, validation, quoting, and parity with Ansible.

python -m pytest -q tests/ops/test_render.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from engine.cli import serve
from ops.errors import DdopsError
from ops.host.lxcconf import GpuBlock, GpuDevice
from ops.render import (
    EngineUnit,
    GpuNodesUnit,
    Hookscript,
    NvidiaModules,
    RecoverUnit,
    TemplateSpec,
    render,
    render_template,
)
from ops.resources import templates_dir

UVM = GpuDevice("/dev/nvidia-uvm", 509, 0, gid=44)
BLOCK = GpuBlock((GpuDevice("/dev/nvidia0", 195, 0), UVM), style="devN", shm_size_gib=16)
ENGINE = EngineUnit(
    python="/opt/ddops/bin/python",
    model="/dev/shm/models/Qwen3.6-27B",
    draft="/dev/shm/models/Qwen3.6-27B-DFlash",
    port=8000,
    max_model_len=32768,
    method="ddtree",
    budget=15,
    tp=1,
    cuda_visible_devices="0",
    env_file="/etc/ddops/engine.env",
)


def gpu_block_text(block: GpuBlock) -> str:
    return render_template("ct-gpu.conf.j2", block.variables([0, 1]))


# -- golden text ---------------------------------------------------------------------------------


def test_ct_gpu_block_in_devn_style():
    assert gpu_block_text(BLOCK) == (
        "dev0: /dev/nvidia0\n"
        "dev1: /dev/nvidia-uvm,gid=44\n"
        "lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,size=16g,create=dir 0 0\n"
    )


def test_ct_gpu_block_in_raw_style_grants_each_major_once():
    devices = (GpuDevice("/dev/nvidia0", 195, 0), GpuDevice("/dev/nvidiactl", 195, 255), UVM)
    raw = GpuBlock(devices, style="raw", shm_size_gib=None)
    assert render_template("ct-gpu.conf.j2", raw.variables([None] * 3)) == (
        "lxc.cgroup2.devices.allow: c 195:* rwm\n"
        "lxc.cgroup2.devices.allow: c 509:* rwm\n"
        "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\n"
        "lxc.mount.entry: /dev/nvidiactl dev/nvidiactl none bind,optional,create=file\n"
        "lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file\n"
    )


def test_nvidia_modules():
    assert render(NvidiaModules()) == (
        "# Written by ddops: load the NVIDIA kernel modules at boot, before the GPU containers start.\n"
        "nvidia\n"
        "nvidia_uvm\n"
    )


def test_gpu_nodes_unit_runs_before_pve_guests():
    assert render(GpuNodesUnit(gpu_minors=(0, 1))) == (
        "[Unit]\n"
        "Description=ddops: create the NVIDIA device nodes before containers start\n"
        "After=systemd-modules-load.service\n"
        "Before=pve-guests.service\n"
        "\n"
        "[Service]\n"
        "Type=oneshot\n"
        "RemainAfterExit=yes\n"
        "ExecStart=/usr/bin/nvidia-modprobe -u -c=0\n"
        "ExecStart=/usr/bin/nvidia-modprobe -u -c=1\n"
        "ExecStart=/usr/bin/nvidia-modprobe -m\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def test_recover_unit_runs_after_pve_guests_for_each_ct():
    text = render(RecoverUnit(vmids=(200, 201), inventory="/etc/ddops/site.yml"))
    assert text == (
        "[Unit]\n"
        "Description=ddops: recover the GPU containers after boot\n"
        "After=pve-guests.service\n"
        "\n"
        "[Service]\n"
        "Type=oneshot\n"
        "TimeoutStartSec=1800\n"
        "ExecStart=-/usr/local/bin/ddops -i /etc/ddops/site.yml recover --ct 200 --at-boot\n"
        "ExecStart=-/usr/local/bin/ddops -i /etc/ddops/site.yml recover --ct 201 --at-boot\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )
    assert "--host local recover --ct 200 --at-boot\n" in render(RecoverUnit(vmids=(200,)))


def test_engine_unit():
    text = render(ENGINE)
    assert text.startswith(
        "[Unit]\n"
        "Description=ddops engine: OpenAI-compatible server on port 8000\n"
        "After=network.target\n"
        "\n"
        "[Service]\n"
        "Type=simple\n"
        "User=ddops-engine\n"
        "Group=44\n"
        "Environment=CUDA_VISIBLE_DEVICES=0\n"
        "Environment=HOME=/var/cache/ddops-engine\n"
        "EnvironmentFile=/etc/ddops/engine.env\n"
        "ExecStart=/opt/ddops/bin/python -m engine serve --model /dev/shm/models/Qwen3.6-27B"
        " --draft /dev/shm/models/Qwen3.6-27B-DFlash --host 127.0.0.1 --port 8000"
        " --max-model-len 32768 --method ddtree --budget 15 --dtype bfloat16 --device cuda\n"
        "Restart=on-failure\n"
        "RestartSec=5\n"
        "CacheDirectory=ddops-engine\n"
        "UMask=0077\n"
        "NoNewPrivileges=yes\n"
        "CapabilityBoundingSet=\n"
        "AmbientCapabilities=\n"
        "ProtectSystem=strict\n"
    )
    assert text.endswith("\n[Install]\nWantedBy=multi-user.target\n")
    for sandbox in ("PrivateTmp=yes", "ProtectHome=yes", "RestrictSUIDSGID=yes"):
        assert f"\n{sandbox}\n" in text
    assert "PrivateDevices" not in text and "DevicePolicy" not in text  # the GPU stays reachable


def test_the_engine_unit_names_its_key_file_raw_and_requires_it():
    """systemd reads EnvironmentFile= raw (a quoted path is no path) and a leading "-" would let
    the engine start without its key: the file is required and its path plain."""
    assert "\nEnvironmentFile=/etc/ddops/engine.env\n" in render(ENGINE)
    for bad in ("/etc/dd ops/engine.env", '/etc/"x"', "/etc/%n.env", "relative.env"):
        with pytest.raises(DdopsError, match="env_file"):
            EngineUnit(python="/p", model="/m", method="ar", env_file=bad)
    with pytest.raises(DdopsError, match="env_file"):
        RecoverUnit(vmids=(200,), env_file="/etc/ddops/hf token.env")


def test_a_port_below_1024_is_the_one_capability_the_engine_keeps():
    text = render(EngineUnit(python="/p", model="/m", method="ar", port=443))
    assert "\nCapabilityBoundingSet=CAP_NET_BIND_SERVICE\n" in text
    assert "\nAmbientCapabilities=CAP_NET_BIND_SERVICE\n" in text


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_rates_the_engine_unit_at_most_4_5(tmp_path):
    """`systemd-analyze security --offline=yes` on the rendered unit: 0 is best, 10 worst; the
    unit as first shipped (root, no sandbox) scored 9.6."""
    unit = tmp_path / "ddops-engine.service"
    unit.write_text(render(ENGINE))
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", unit.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    score = float(re.search(r"Overall exposure level for \S+: ([\d.]+)", out)[1])
    assert score <= 4.5, out


def test_engine_unit_leaves_out_what_is_not_set():
    ar = EngineUnit(
        python="/usr/bin/python3", model="/m", method="ar", dtype="float32", device="cpu"
    )
    text = render(ar)
    assert "CUDA_VISIBLE_DEVICES" not in text and "--draft" not in text
    assert "--max-model-len" not in text
    assert next(x for x in text.splitlines() if x.startswith("ExecStart=")).endswith(
        "--port 8000 --method ar --budget 15 --dtype float32 --device cpu"
    )
    assert " --tp 4 --dtype" in render(EngineUnit(python="/p", model="/m", method="ar", tp=4))


def test_the_engine_accepts_the_rendered_command_line():
    """The ExecStart arguments parse with `python -m engine serve`'s own argument parser."""
    argv = _exec_start_argv(render(ENGINE))
    assert argv[1:4] == ["-m", "engine", "serve"]
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(argv[4:])
    assert (args.method, args.budget, args.max_model_len, args.device) == (
        "ddtree",
        15,
        32768,
        "cuda",
    )
    assert str(args.draft) == ENGINE.draft
    assert args.max_num_seqs is None  # not given: the engine's default


def test_max_num_seqs_reaches_the_engine_s_command_line():
    unit = dataclasses.replace(ENGINE, max_num_seqs=8, kv_cache_tokens=262_144)
    argv = _exec_start_argv(render(unit))
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(argv[4:])
    assert (args.max_num_seqs, args.kv_cache_tokens) == (8, 262_144)
    with pytest.raises(DdopsError, match="max_num_seqs"):
        dataclasses.replace(ENGINE, max_num_seqs=0)


def test_hookscript_golden_head():
    text = render(Hookscript(gpu_minors=(0,), modeset=False))
    assert text.startswith("#!/bin/sh\n# ddops hookscript, written by ddops.")
    assert "        '/usr/bin/nvidia-modprobe' -u -c=0 || {\n" in text
    assert "-m ||" not in text
    assert text.endswith("        ;;\nesac\nexit 0\n")


# -- systemd quoting -----------------------------------------------------------------------------

AWKWARD = EngineUnit(
    python="/opt/my venv/bin/python",
    model="/models/50% done",
    draft='/models/$HOME/say "hi"',
    method="linear",
)


def _exec_start_argv(unit_text: str) -> list[str]:
    """ExecStart read back as systemd does for these characters: %% and $$ are literal % and $,
    double quotes group words with backslash escapes (as in a POSIX shell)."""
    line = next(x for x in unit_text.splitlines() if x.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart=").replace("%%", "%").replace("$$", "$"))


def test_exec_start_arguments_are_quoted_for_systemd():
    text = render(AWKWARD)
    assert (
        'ExecStart="/opt/my venv/bin/python" -m engine serve --model "/models/50%% done"'
        ' --draft "/models/$$HOME/say \\"hi\\""' in text
    )
    argv = _exec_start_argv(text)
    assert argv[:7] == [
        AWKWARD.python,
        "-m",
        "engine",
        "serve",
        "--model",
        AWKWARD.model,
        "--draft",
    ]
    assert argv[7] == AWKWARD.draft


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze")
def test_systemd_accepts_the_rendered_units(tmp_path):
    units = {
        "ddops-engine.service": render(
            EngineUnit(python=sys.executable, model="/m 50%", draft="/d", env_file="/e")
        ),
        "ddops-gpu-nodes.service": render(GpuNodesUnit(nvidia_modprobe=shutil.which("true"))),
        "ddops-recover.service": render(
            RecoverUnit(vmids=(200,), ddops=shutil.which("true"), inventory="/it's.yml")
        ),
    }
    for name, text in units.items():
        (tmp_path / name).write_text(text)
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *(str(tmp_path / n) for n in units)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "cause"),
    [
        (lambda: RecoverUnit(vmids=(99,)), "vmid must be an integer in 100.."),
        (lambda: RecoverUnit(vmids=("200; reboot",)), "vmid must be an integer"),
        (lambda: RecoverUnit(vmids=()), "at least one container"),
        (lambda: RecoverUnit(vmids=(200,), ddops="ddops"), "ddops must be an absolute path"),
        (lambda: Hookscript(inventory="site.yml"), "inventory must be an absolute path"),
        (lambda: GpuNodesUnit(gpu_minors=()), "at least one GPU"),
        (lambda: NvidiaModules(modules=("nvidia; rm",)), "is not of the form"),
        (
            lambda: EngineUnit(python="/p", model="/m", draft="/d", port=0),
            "port must be an integer in 1..65535",
        ),
        (lambda: EngineUnit(python="/p", model="/m", draft="/d", port=70000), "port must be"),
        (
            lambda: EngineUnit(python="/p", model="/m", method="beam"),
            "method must be one of ar, linear, ddtree",
        ),
        (lambda: EngineUnit(python="/p", model="/m"), "method ddtree needs a draft model"),
        (lambda: EngineUnit(python="/p", model="m", method="ar"), "model must be an absolute path"),
        (lambda: EngineUnit(python="/p", model="/m\n", method="ar"), "control characters"),
        (lambda: EngineUnit(python="/p", model="/m", method="ar", host="0.0.0.0 --x"), "host"),
        (
            lambda: EngineUnit(python="/p", model="/m", method="ar", cuda_visible_devices="0;1"),
            "cuda_visible_devices",
        ),
        (
            lambda: EngineUnit(python="/p", model="/m", method="ar", tp=True),
            "tp must be an integer",
        ),
    ],
)
def test_bad_values_are_refused_with_a_named_cause(make, cause):
    with pytest.raises(DdopsError, match=cause.replace("(", r"\(")) as caught:
        make()
    assert caught.value.obj.startswith("template ")


def test_a_missing_variable_is_an_error_not_an_empty_string():
    with pytest.raises(DdopsError, match="missing variable"):
        render_template("ddops-engine.service.j2", {"python": "/p"})


def test_every_template_is_installed_where_its_spec_says():
    for spec in (NvidiaModules, GpuNodesUnit, RecoverUnit, Hookscript, EngineUnit):
        assert (templates_dir() / spec.TEMPLATE).is_file()
        assert spec.INSTALL_PATH.startswith("/")


# -- the hookscript, run --------------------------------------------------------------------------


@pytest.fixture
def hook(tmp_path):
    """The rendered hookscript with a fake nvidia-modprobe and systemd-run that log their argv."""
    bin_dir = tmp_path / "fake bin's"  # a space and a quote: the script must quote its paths
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for name in ("nvidia-modprobe", "systemd-run"):
        fake = bin_dir / name
        fake.write_text(f'#!/bin/sh\necho "{name} $*" >> "$CALLS"\nexit "${{FAKE_RC:-0}}"\n')
        fake.chmod(0o755)
    script = tmp_path / "ddops-hook.sh"
    script.write_text(
        render(
            Hookscript(
                nvidia_modprobe=str(bin_dir / "nvidia-modprobe"),
                systemd_run=str(bin_dir / "systemd-run"),
                gpu_minors=(0, 1),
                ddops="/opt/ddops/bin/ddops",
            )
        )
    )

    def call(*args: str, rc: int = 0) -> tuple[int, list[str], str]:
        env = {**os.environ, "CALLS": str(log), "FAKE_RC": str(rc)}
        done = subprocess.run(
            ["sh", str(script), *args], env=env, capture_output=True, text=True, timeout=30
        )
        calls = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return done.returncode, calls, done.stderr

    return call


def test_hook_pre_start_creates_every_node(hook):
    assert hook("200", "pre-start") == (
        0,
        ["nvidia-modprobe -u -c=0", "nvidia-modprobe -u -c=1", "nvidia-modprobe -m"],
        "",
    )


def test_hook_pre_start_aborts_the_start_when_nodes_cannot_be_made(hook):
    rc, calls, stderr = hook("200", "pre-start", rc=1)
    assert (rc, calls) == (1, ["nvidia-modprobe -u -c=0"])
    assert "CT 200: nvidia-modprobe -u -c=0 failed" in stderr


def test_hook_post_start_starts_recovery_in_the_background(hook):
    rc, calls, _ = hook("200", "post-start")
    assert rc == 0
    assert calls == [
        "systemd-run --no-block --collect --unit=ddops-recover-ct-200 "
        "/opt/ddops/bin/ddops --host local recover --ct 200"
    ]
    assert hook("200", "post-start", rc=1)[0] == 0  # a failed trigger never fails the CT


@pytest.mark.parametrize(
    "args", [("200", "pre-stop"), ("200", "post-stop"), ("200", "x"), ("2; x", "pre-start"), ()]
)
def test_hook_does_nothing_for_other_phases_or_bad_arguments(hook, args):
    rc, calls, _ = hook(*args)
    assert (rc, calls) == (0, [])


# -- parity with Ansible's template module ------------------------------------------------------

SPECS: dict[str, TemplateSpec] = {
    "nvidia-modules": NvidiaModules(),
    "gpu-nodes": GpuNodesUnit(gpu_minors=(0, 1)),
    "recover": RecoverUnit(
        vmids=(200, 201), inventory="/etc/ddops/it's.yml", env_file="/etc/ddops/hf-token.env"
    ),
    "hook": Hookscript(inventory="/etc/ddops/site.yml"),
    "engine": ENGINE,
    "engine-awkward-paths": AWKWARD,
}
PARITY_CASES: dict[str, tuple[str, dict]] = {
    "ct-gpu-devn": ("ct-gpu.conf.j2", BLOCK.variables([0, 1])),
    "ct-gpu-raw": (
        "ct-gpu.conf.j2",
        GpuBlock(BLOCK.devices, style="raw", shm_size_gib=None).variables([None, None]),
    ),
    **{case: (spec.TEMPLATE, spec.variables()) for case, spec in SPECS.items()},
}


@pytest.mark.slow  # ansible-playbook takes 10-50 s on a loaded machine
@pytest.mark.ansible
def test_ansible_renders_the_same_bytes(tmp_path):
    """One playbook renders every case with Ansible's template module; the files must equal ours."""
    tasks = [
        {
            "name": case,
            "ansible.builtin.template": {
                "src": str(templates_dir() / template),
                "dest": str(tmp_path / case),
            },
            "vars": variables,
        }
        for case, (template, variables) in PARITY_CASES.items()
    ]
    playbook = tmp_path / "render.yml"
    playbook.write_text(
        json.dumps(
            [{"hosts": "localhost", "connection": "local", "gather_facts": False, "tasks": tasks}]
        )
    )
    env = {**os.environ, "ANSIBLE_LOCALHOST_WARNING": "false", "ANSIBLE_NOCOLOR": "1"}
    done = subprocess.run(
        [
            "ansible-playbook",
            "-i",
            "localhost,",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            str(playbook),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for case, (template, variables) in PARITY_CASES.items():
        assert (tmp_path / case).read_text() == render_template(template, variables), case

"""The YAML inventory: parsing, defaults, and validation of every value that reaches a command."""

from __future__ import annotations

import textwrap

import pytest

from ops.errors import DdopsError
from ops.site.inventory import load_site

SITE = """\
all:
  vars:
    ddops_model:
      target: {repo: Qwen/Qwen3.6-27B, revision: main}
      draft: {repo: z-lab/Qwen3.6-27B-DFlash, revision: 0123abcd}
    ddops_engine: {method: ddtree, budget: 15, port: 8000, max_model_len: 32768}
  hosts:
    pve1:
      ansible_host: 192.0.2.10
      ddops_containers:
        - {vmid: 200, hostname: llm, cores: 16, memory_mib: 131072, gpus: [0, 1], shm_gib: 64}
    lab:
      ddops_target: sim:/tmp/pve-sim
      ddops_containers: [{vmid: 300}]
"""


def write(tmp_path, text):
    path = tmp_path / "site.yml"
    path.write_text(textwrap.dedent(text))
    return path


def test_parses_hosts_containers_model_engine(tmp_path):
    site = load_site(write(tmp_path, SITE))
    host, ct = site.find_container(200)
    assert host.target == "ssh://root@192.0.2.10:22"
    assert (ct.hostname, ct.cores, ct.memory_mib, ct.gpus, ct.shm_gib) == (
        "llm",
        16,
        131072,
        (0, 1),
        64,
    )
    assert site.model.target.name == "qwen3.6-27b"
    assert site.model.draft.revision == "0123abcd"
    assert site.engine.budget == 15
    host, ct = site.find_container(300)
    assert host.target == "sim:/tmp/pve-sim" and ct.memory_mib == 8192


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("vmid: 200", "vmid: '200; reboot'", "a vmid is a number from 100"),
        ("vmid: 200", "vmid: 99", "a vmid is a number from 100 to"),
        ("repo: Qwen/Qwen3.6-27B", "repo: ../../etc/passwd", "not a Hugging Face repo id"),
        ("revision: main}", "revision: '$(id)'}", "not a branch, tag or commit"),
        ("method: ddtree", "method: beam", "choose one of ar, linear, ddtree"),
        ("hostname: llm", "hostname: 'bad host'", "not a valid hostname"),
        ("cores: 16", "corez: 16", "unknown key(s) corez"),
        ("max_model_len: 32768}", "max_model_len: 32768, max_num_seqs: 0}", "out of range 1..1024"),
        ("max_model_len: 32768}", "max_model_len: 32768, max_num_seqs: '8'}", "must be an integer"),
        ("max_model_len: 32768}", "max_model_len: 32768, kv_cache_tokens: 8}", "out of range 16.."),
    ],
)
def test_bad_values_get_a_clear_error(tmp_path, old, new, message):
    assert old in SITE
    with pytest.raises(DdopsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_site(write(tmp_path, SITE.replace(old, new, 1)))


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(DdopsError, match="inventory file not found"):
        load_site(tmp_path / "nope.yml")
    with pytest.raises(DdopsError, match="not valid YAML"):
        load_site(write(tmp_path, "all: [unclosed"))
    with pytest.raises(DdopsError, match="CT 999: not in the inventory"):
        load_site(write(tmp_path, SITE)).find_container(999)


def test_max_num_seqs_is_read_and_defaults_to_the_engine_s(tmp_path):
    assert load_site(write(tmp_path, SITE)).engine.max_num_seqs is None
    text = SITE.replace("max_model_len: 32768}", "max_model_len: 32768, max_num_seqs: 8}")
    assert load_site(write(tmp_path, text)).engine.max_num_seqs == 8


def test_tp_needs_as_many_gpus_in_the_ct(tmp_path):
    text = SITE.replace("max_model_len: 32768}", "max_model_len: 32768, tp: 2}")
    two = text.replace("[{vmid: 300}]", "[{vmid: 300, gpus: [0, 1]}]")
    assert load_site(write(tmp_path, two)).engine.tp == 2  # both CTs have two GPUs
    with pytest.raises(DdopsError, match="CT 300: engine tp 2 needs 2 GPUs, the CT has 1"):
        load_site(write(tmp_path, text))

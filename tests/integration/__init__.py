"""Tests that need real LXC containers, a real sshd or real Ansible runs (markers lxc, ssh, ansible)."""

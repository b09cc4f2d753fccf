"""The host side: how ddops reaches a Proxmox host and what it reads and changes there.

- transport.py (the seam: run an argv, read and write files), ssh.py (over paramiko),
  targets.py (`local`, `sim:PATH`, `ssh://...` strings -> Transports);
- pve.py (`pct`, `pveversion`), gpu.py (NVIDIA devices and driver), lxcconf.py (CT configs);
- wheel.py (this ddops as a wheel).
"""

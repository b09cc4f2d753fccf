"""The simulated Proxmox VE host (see ARCHITECTURE.md "The simulated host"): a test double of Proxmox, not of ddops.

A directory PATH plays a whole host through `LocalTransport(sysroot=PATH)`:

    state.py      the simulated kernel/driver state (PATH/var/lib/ddops-sim/state.json), lock, log
    kernel.py     nvidia modules, /proc/devices|modules|driver/nvidia/version, mknod'd GPU nodes
    pct.py        `pct` with Proxmox's messages and exit codes; containers from one of:
    lxc.py          real LXC containers (root + lxc): PVE config -> LXC config, lxc-start/attach/stop
    processct.py    plain processes (fallback without root or lxc)
    startplan.py  what `pct start` derives from a CT config (devN resolution, device rules, mounts)
    pveconf.py    the sim's own tiny /etc/pve/lxc/<id>.conf reader/writer
    nvidia.py     nvidia-smi, nvidia-modprobe, modprobe, lsmod, pveversion
    commands.py   the entry point of those executables; launcher.py writes them
    boot.py       what a reboot honours: modules-load.d and enabled units' ExecStart
    hookscript.py a CT's `hookscript:` around pct start (pre-start, post-start)
    host.py       init_host / reboot_host / destroy_host (behind `ddops sim`)
    faults.py     fault injection for tests
    hub.py        a local Hugging Face hub (served beside the host)

ddops logic never imports this package; `ddops sim`, `ddops demo` and tests do.
"""

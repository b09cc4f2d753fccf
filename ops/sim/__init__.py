"""The simulated Proxmox VE host (see ARCHITECTURE.md "The simulated host"); a test double of Proxmox, not of ddops."""

"""ddops control plane: provision, recover and benchmark GPU LLM engines on Proxmox VE LXC containers.

This package never imports torch at import time; the engine lives in the `engine` package.
"""

__version__ = "0.1.0"

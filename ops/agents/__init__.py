"""What runs inside a container: the CUDA probe (stdlib only), the engine's supervisor where
a CT has no systemd (stdlib only), and the staging agent (huggingface_hub).
"""

"""The site: the inventory the CLI and the playbooks read, the containers a command acts on,
the templates rendered from it, and the playbooks run over it with ansible-runner.
"""

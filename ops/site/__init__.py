"""The site: the inventory the CLI and the playbooks read, the containers a command acts on,
and the playbooks run over it with ansible-runner.
"""

"""The site: the inventory the CLI and the playbooks read, and the containers a command acts on."""

"""One module per `ddops` command; each registers itself on `ops.cli.cli`."""

"""One module per `ddops` command (ops/cli.py registers them); shared.py holds what they share."""

"""The `python -m engine` commands, one module each: add_arguments(parser) and run(args) -> int."""

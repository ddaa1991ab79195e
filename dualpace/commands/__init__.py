"""Subcommands of the `dualpace` CLI; each module has register(subparsers) and run(args)."""

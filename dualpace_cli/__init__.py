"""The `dualpace` command line (tools floor): the dispatcher and the subcommands that drive
the tools (bench, sim, profile). `python -m dualpace` runs it too."""

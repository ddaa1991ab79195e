"""The `dualpace` command line (tools floor): the dispatcher (main) and one module per
subcommand: generate, model, up, client, bench, sim, profile, cluster. `python -m dualpace`
runs it too."""

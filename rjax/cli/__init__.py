"""The `rjax` command (`main`) and its subcommands' modules (chat REPL, info, bench). Imports every
layer below it, rjax.server included."""

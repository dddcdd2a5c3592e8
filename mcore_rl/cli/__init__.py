"""The `mcore-rl` command line (thin: parse, call). Nothing imports this package."""

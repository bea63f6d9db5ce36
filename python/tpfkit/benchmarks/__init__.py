"""Every benchmark of an op: `tpf bench NAME` (cli.py) and the entry scripts in bench/ run them."""

"""Benchmarks shared by `tpf bench` and the scripts in bench/."""

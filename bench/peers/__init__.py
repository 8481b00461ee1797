"""Peers the benchmarks compare tandem with, beyond transformers: installed by `make bench-peers`, never by
`make test`."""

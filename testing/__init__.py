"""Test doubles for the tests and the benchmarks, never the serving path: the synthetic
worker (the real RPC server and heartbeats over engines that answer in fixed time) and
stacks that start ``kvroute serve`` in a subprocess as a user would."""

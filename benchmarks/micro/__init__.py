"""Micro-benchmarks of baton's own parts, run on a CPU (no GPU, no cluster to load).

Each module is `python -m baton.benchmarks.micro.<name>`: it prints a table and writes
JSON with the date, the device and the command (`results/<name>.json`).

- `cpu_step_ops`: the kernels one decoder layer launches in a decode step and `sample()`'s
  host time: a proxy for a GPU step, to compare changes by.
- `scheduler`: the prefix cache and overlap on against off.
- `engine_offline`: offline engine throughput against transformers' `generate()`.
- `kv_transfer`: loopback KV transfer throughput per backend and prompt size.
- `router_relay`: a real router's CPU per streamed token, between fake workers.
"""

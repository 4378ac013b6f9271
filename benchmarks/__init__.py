"""`baton bench`: the load-test tool users run, and the fakes it is tried against.

This package is the tool: `bench serve` (`serve`, `client`, `datasets`, `schedule`,
`metrics`, `presence`, `progress`, `report`), `bench pd-sweep` (`pd_sweep`,
`sweep_report`), their settings (`config`, flags made by `cli`) and `load_report` (an
overload run as an operator reads it). `fake_server` (an OpenAI-compatible server) and
`fake_worker` (a worker's gRPC service) stand in for baton without a model.

Two subpackages are not the tool: `micro` holds CPU micro-benchmarks of baton's own parts
(a step's kernels, the scheduler, the KV transfer, the router's relay), `lab` the GPU
investigations run through `gpu_session.sh`. `results/` keeps what they recorded.
"""

"""The GPU lab: one-off investigations of the engine on a GPU, not the `baton bench` tool.

Each module is `python -m baton.benchmarks.lab.<name>`, most run by a stage of
`benchmarks/gpu_session.sh`; what each found is in `benchmarks/results/gpu_*/report.md`.
They build their engine with `gpu_setup.make_engine` (Llama-3.1-8B's shape, random weights)
and judge it against `floors` (the bytes and FLOPs a step cannot avoid) divided by the
rates `device_rates` measures on the same GPU in the same run.

- `gpu_engine`: decode step time and TTFT against their floors, offline throughput.
- `gpu_pd`: the KV handoff between two processes (also on CPU, `--devices cpu`).
- `gpu_offload_step`: a decode step with and without GPU→host offload of the host tier
  (also on CPU, `--device cpu --model DIR`).
- diagnostics: `gpu_gaps` (kernel gaps), `gpu_profile` (time by kernel),
  `gpu_host_profile` (cProfile of the host), `gpu_ttft` (a prompt phase by phase),
  `gpu_prompt_graphs` (prompt CUDA graphs), `gpu_linear`, `gpu_gate_up` and
  `gpu_attention` (kernel variants at the engine's shapes).
"""

"""Helpers of bench/gpu_peers.py: the model (model.py), the Python peers (optimizers.py) and the C++ one
(cli_peer.py), running a peer (run.py), timing and memory (measure.py), profiler counts (counts.py),
the report (report.py) and writing it (files.py, also used by bench/megatron_bench/)."""

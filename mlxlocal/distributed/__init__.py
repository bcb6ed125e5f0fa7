"""One model over several ranks (mx.distributed): what a front end, the loader and the engine
use of a cluster. The loader splits a model by a plan (tensor.py: heads, the Megatron layout;
stages.py: layer ranges); rank 0 runs the whole engine on a leader runner (leader.py,
pipeline.py) that announces each step on the channel (channel.py), and every other rank
follows it (follower.py). processes.py starts the ranks (`launch-cluster`); report.py
measures what a cluster costs.
"""

from __future__ import annotations

from mlxlocal.distributed.channel import cluster_problem, launched, release
from mlxlocal.distributed.follower import follower_main
from mlxlocal.distributed.processes import free_ports, hosts_in, run_hosts, run_local
from mlxlocal.distributed.report import cluster_report
from mlxlocal.distributed.stages import stage_report
from mlxlocal.distributed.tensor import shard_report

__all__ = ["cluster_problem", "cluster_report", "follower_main", "free_ports", "hosts_in", "launched", "release",
           "run_hosts", "run_local", "shard_report", "stage_report"]

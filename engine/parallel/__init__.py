"""One replica across several processes: the layout (who holds what) and the groups that talk. The processes
themselves (driver and ranks) live in engine/runner/ranks/."""

from tandem.engine.parallel.layout import ParallelConfig, RankShard, ReplicaLayout, split_evenly

__all__ = ["ParallelConfig", "RankShard", "ReplicaLayout", "split_evenly"]

"""One replica across several processes: the layout (who holds what), the groups that talk, the workers."""

from tandem.engine.parallel.layout import ParallelConfig, RankShard, ReplicaLayout, split_evenly

__all__ = ["ParallelConfig", "RankShard", "ReplicaLayout", "split_evenly"]

"""Active-active: the processor instances of one cluster share capacity and fairness through Redis (docs/cluster.md)."""

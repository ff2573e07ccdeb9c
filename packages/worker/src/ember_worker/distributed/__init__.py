"""Running one model over several ranks: groups, per-rank workers, multiprocess and Ray executors."""

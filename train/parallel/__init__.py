"""Multi-process training pieces that need no processes to test: the dynamic expert-parallel planner
(k3.train.parallel.planner) and the EP dispatch volume (k3.train.parallel.comm). docs/parallel.md."""

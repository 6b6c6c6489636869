"""Multi-process training (docs/parallel.md): the run's process group and mesh (runtime), FSDP2 (fsdp), expert
parallelism over all ranks or within each of dp EP groups (ep), Muon on sharded matrices (muon), DCP checkpoints
(checkpoint), each rank's batch rows (data) and the distributed loop (trainer); and the pieces that need no
processes to test: the dynamic expert-parallel planner (planner) and the EP dispatch volume (comm)."""

"""The checkpoint engine and its policy: the engine that runs criu with its steps (engine), the job's
checkpoint policy around it with the load gate (policy, load), the bookkeeping of each checkpoint (checkpoints), the
pre-dump (predump) and the storage guard (guard).

May import files, lazyrestore, gpus, network, pipeline, storage and processes; never running nor node."""

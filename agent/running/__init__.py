"""Running jobs: the supervisor (jobs) and what it knows of each job (runtime), the launcher with its
namespaces and dead man's switch (launcher), the job's user, environment and working-directory rules (jobuser), and
the self-fence's freezing (freezing).

May import checkpointing, lazyrestore, files, network, pipeline, storage and processes; never node."""

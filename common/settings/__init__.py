"""Configuration: the files and their sections (config, checkpoint_config, cluster), health thresholds
(thresholds), limits (limits), what jobs ask of nodes (resources), intervals in the scheduler's formats
(intervals), and the bus's identities and permissions (security).

May import common's base modules only."""

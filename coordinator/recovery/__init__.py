"""Moving jobs off dead and sick nodes: failover from the last good epoch (failover), a dead node's jobs
taken over (takeover), and proactive moves off sick nodes (sick).

May import table and nodes."""

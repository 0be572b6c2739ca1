"""Moving jobs off dead and sick nodes: failover from the last good epoch (failover), a dead node's jobs
taken over (takeover), proactive moves off sick nodes (sick), and the rules failover follows (guards).

May import table and nodes."""

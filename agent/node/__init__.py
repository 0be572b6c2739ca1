"""The node service: the agent's lifecycle and node commands (agent), heartbeats and probe replies on their own
thread (liveness) and the lease that fences the node (lease), the readings each heartbeat carries (probes) and the
health rules over them (health, anomaly), reconciling the jobs the node runs with the table (reconcile) and
`revenant check`'s reading of a running job (checkable).

The top of the agent: it may import every other part of it."""

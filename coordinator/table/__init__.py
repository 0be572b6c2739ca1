"""The job table: the lifecycle rules (lifecycle, job_inputs, epoch_rules, userlimits), the table and
its store (jobs, store, archive, paging), the requests it serves (requests), periodic checkpoints (periodic), the
events it publishes (job_events), the commands it sends to agents (agents) and where a job goes (placement).

Never imports nodes nor recovery."""

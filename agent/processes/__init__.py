"""Processes: child processes through pidfds, the subreaper and PDEATHSIG (procs), what a job's processes
hold, read from /proc (jobprocs), and how a job ended (exits, pure).

The bottom of the agent, beside storage: it imports nothing of the agent."""

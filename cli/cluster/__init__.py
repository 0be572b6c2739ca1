"""revenant's own processes, as the command line runs them: a service in the foreground
(``revenant agent``, ``revenant coordinator``: service), and a local cluster (``revenant up`` and
``down``: local; the supervisor that restarts what dies: supervise; starting and stopping its
processes in order: processes; each in a network namespace of its own with ``up --netns``:
netns).  The client commands that speak to a cluster are in cli/ itself."""

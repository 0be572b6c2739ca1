"""The file gate: a job's changed files copied as they were at the dump after it resumes, one
fanotify group per agent that nobody outside the job waits on for long (cowgate.py), its group
and threads (group.py) and the keeper process that answers for a stopped agent (keeper.py)."""

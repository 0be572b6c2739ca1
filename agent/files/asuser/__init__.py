"""What a job's restore makes as the job's user, never as root: its listening sockets and its
FIFOs and deleted files in directories the user can change (agent/files/remade.py says why)."""

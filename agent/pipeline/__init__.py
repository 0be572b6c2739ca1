"""The pipeline every dump and restore runs: criu itself, its command lines and errors (criu), its
statistics (criustats), its action scripts' handshake with the agent (handshake), the contract of an engine step
(steps), what in a job criu cannot carry (blockers), and the progress of a dump or restore (progress).

May import storage and processes only: the steps that implement the contract sit above it."""

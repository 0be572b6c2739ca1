"""Epoch storage on shared storage: epochs and their manifests (epochs, manifest), the checksums taken as
criu writes (imagesum), incremental epochs' packs and recipes (chain, packs) and what they cost (packusage), durable
file I/O (fileio), private images (private) and images encrypted at rest (sealed).

The bottom of the agent, beside processes: it imports nothing of the agent."""

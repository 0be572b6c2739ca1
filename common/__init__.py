"""Pieces shared by the agent, the coordinator and the CLI: config, errors, the bus."""

"""The cluster's nodes and coordinators: the failure detector (detector) fed by heartbeats (heartbeats),
the policy on sick nodes (proactive), and the leader among coordinators (leader).

Never imports table nor recovery."""

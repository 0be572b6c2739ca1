"""The bus: the NATS connection (bus), key-value buckets (kv), raw subscriptions without per-message
objects (rawsub), the nats-server the tests and `revenant up` start (natsserver), and the event stream (events).

May import settings and common's base modules."""

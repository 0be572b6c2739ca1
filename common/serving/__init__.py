"""The process around a service: its main loop and signals (service), the HTTP endpoints (httpserver) and
Prometheus metrics (metrics), the event-loop monitor (loopmonitor) and the garbage collector's pauses (gcpause).

May import common's base modules only."""

"""Kvasir's autoscaler: replicas that follow KV-cache occupancy, queue depth and the shape of the
latency tail. `decide.decide()` is the pure policy; `loop.Autoscaler` reads the pods and acts."""

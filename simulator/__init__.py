"""`kvasir simulate`: replay a load trace against simulated replicas (Kvasir's real scheduler and
KV cache manager, with a fitted step-time model) under autoscaling policies, and compare them on
SLO attainment and GPU-hours."""

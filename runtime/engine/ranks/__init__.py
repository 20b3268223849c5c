"""Tensor parallelism's processes: rank 0 (the serving process) drives ranks 1..N-1.

`start.py` builds rank 0's runner and spawns the others; `driver.py` mirrors each runner call to
them; `plan_wire.py` is a step's plan on the wire; `calls.py` the call records; `rank_main.py` the
other ranks' process; `supervisor.py` watches them and turns a death or a hang into a failure."""

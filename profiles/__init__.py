"""Profiles (tools floor): the offline profiler (profiler/), the stored profiles (reference/, local/) and the simulator (sim/). What the daemons read at run time lives in dualpace.profile."""

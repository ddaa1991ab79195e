"""The offline profiler (`dualpace profile`): measures the tables of dualpace.profile.schema on this
machine's real runners. Not pure — it imports torch, grpc and reads clocks; the pure
schema and cost model stay in dualpace.profile.schema and dualpace.profile.cost_model.

    fingerprint.py  hardware and model fingerprints (also used by the daemons' profile checks)
    timing.py       warm-up + repeats, robust statistics
    measure.py      one function per table, over the real runners and the real daemons' paths
    plots.py        PNG plots of a profile
    run.py          grids, the progress bar, assembling and storing the profile, reuse
"""

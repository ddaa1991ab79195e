"""Pure decisions, shared by the daemons and the simulator: engine views (views.py),
admission (admission.py), the migration planner (migration_planner.py) and the CPU
engine's Local/Assisted mode choice (mode_choice.py). No torch, grpc, asyncio or clock."""

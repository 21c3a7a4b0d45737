"""The planner: what a training configuration needs per rank before it runs (memory, the
collectives' bytes, FLOPs), the largest class count a device holds and a step time, for this
machine's CPU or a GPU profile (`tools/plan.py`, docs/scaling.md)."""
from .devices import PROFILES, Profile, profile
from .model import Plan, capacity, fits, memory, plan

__all__ = ["PROFILES", "Profile", "profile", "Plan", "plan", "memory", "capacity", "fits"]

"""Hand-written runtime: planner (indices -> byte ranges), transfer backends, control plane, sessions."""

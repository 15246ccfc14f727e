"""Placement: one GPU model, the fewest racks and NVLink domains, the pods' node affinity."""

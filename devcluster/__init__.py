"""A local Kubernetes control plane built from pinned upstream Go modules."""

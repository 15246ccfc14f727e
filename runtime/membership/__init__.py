"""Membership: where the world comes from, who is alive, and what a member reports back."""

"""Checkpoints: snapshot to host memory, write in the background, atomic, verified, keep K."""
